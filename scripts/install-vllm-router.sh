#!/usr/bin/env bash
# Build the peer's virtual environment for benchmarks/peer_router.py: vllm-router, vLLM's Rust
# router from PyPI, pinned, in a venv of its own.
#
#   bash scripts/install-vllm-router.sh PYTHON VENV_DIR
#
# Its own venv, not an extra of ours: the package's Python launcher pulls in fastapi, uvicorn
# and requests, which would change the development environment's HTTP stack
# (docs/architecture.md, "Installs by role"). The router itself is a Rust extension module
# inside the wheel (manylinux x86_64); no Rust toolchain is needed.
set -euo pipefail

VLLM_ROUTER_VERSION="0.1.17"
PYTHON="${1:?python}"
VENV="${2:?venv dir}"

say() { echo "install-vllm-router: $*" >&2; }

installed() {
    [[ -x "$VENV/bin/vllm-router" ]] && "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-router') != '$VLLM_ROUTER_VERSION')" 2>/dev/null
}

if installed; then
    say "vllm-router==$VLLM_ROUTER_VERSION already installed in $VENV"
else
    "$PYTHON" -m venv "$VENV"
    say "installing vllm-router==$VLLM_ROUTER_VERSION into $VENV"
    "$VENV/bin/pip" install --quiet "vllm-router==$VLLM_ROUTER_VERSION"
fi
# The binary runs: its launcher loads the Rust extension and parses its arguments.
if ! "$VENV/bin/vllm-router" --help > /dev/null; then
    say "FAILED: $VENV/bin/vllm-router --help did not run"
    exit 1
fi
say "ok: $("$VENV/bin/python" -c "import importlib.metadata as m; print('vllm-router', m.version('vllm-router'))")"
