#!/usr/bin/env bash
# Build the peer's virtual environment for benchmarks/sidecar_overhead.py: LiteLLM's proxy,
# pinned, in a venv of its own.
#
#   bash scripts/install-litellm.sh PYTHON VENV_DIR
#
# Its own venv, not an extra of ours: the proxy's dependencies (fastapi, starlette, boto3,
# azure, polars, ...) would change the development environment's HTTP stack, as
# grafana-client's urllib3-future once did (docs/architecture.md, "Installs by role").
# The `proxy` extra of litellm also names `litellm-proxy`, which the package index does not
# carry; the proxy's code ships in litellm itself, so its other requirements are installed one
# by one and a missing optional one does not stop the build.
set -euo pipefail

LITELLM_VERSION="1.110.2"
PYTHON="${1:?python}"
VENV="${2:?venv dir}"

say() { echo "install-litellm: $*" >&2; }

if [[ -x "$VENV/bin/litellm" ]] && "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('litellm') != '$LITELLM_VERSION')"; then
    say "litellm==$LITELLM_VERSION already installed in $VENV"
    exit 0
fi
"$PYTHON" -m venv "$VENV"
say "installing litellm==$LITELLM_VERSION into $VENV (a few minutes)"
"$VENV/bin/pip" install --quiet "litellm==$LITELLM_VERSION" packaging
"$VENV/bin/python" - <<'PY' > "$VENV/proxy-requirements.txt"
from importlib.metadata import requires
from packaging.markers import Marker
from packaging.requirements import Requirement

for line in requires("litellm") or []:
    req = Requirement(line)
    if req.name == "litellm-proxy" or req.marker is None:
        continue
    if req.marker.evaluate({"extra": "proxy"}) and not Marker(str(req.marker)).evaluate({"extra": ""}):
        print(str(req).split(";")[0])
PY
while read -r requirement; do
    "$VENV/bin/pip" install --quiet "$requirement" \
        || say "optional proxy requirement not installed: $requirement"
done < "$VENV/proxy-requirements.txt"
"$VENV/bin/litellm" --help > /dev/null
say "ok: $("$VENV/bin/python" -c "import importlib.metadata as m; print('litellm', m.version('litellm'))")"
