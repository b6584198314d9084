#!/usr/bin/env bash
# xds-protos (Envoy's API, the epp extra) ships an old copy of opentelemetry-proto's modules
# under the same package; when pip installs it second, its files replace the real ones and
# the sidecar's OTLP exporter fails to import (no InstrumentationScope). This puts
# opentelemetry-proto's own files back, at the version installed; nothing when it is absent.
# Usage: scripts/restore-opentelemetry-proto.sh [python]
set -euo pipefail
py=${1:-python}
version=$("$py" -m pip show opentelemetry-proto 2>/dev/null | sed -n 's/^Version: //p')
if [ -n "$version" ]; then
    "$py" -m pip install --quiet --force-reinstall --no-deps "opentelemetry-proto==$version"
fi
