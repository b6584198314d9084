"""Where the files weighbridge ships beside its code are: the load scenarios and the
deployment files (Prometheus configuration and rules, Grafana provisioning, the stacks).

They live at the repository's root (``scenarios/``, ``deploy/``), where the docs and
docker-compose.yml name them, and install as the packages ``weighbridge.scenarios`` and
``weighbridge.deploy`` (``weighbridge/scenarios`` and ``weighbridge/deploy`` are symbolic
links to them, as for the parts). importlib.resources finds them the same way in a checkout,
an editable install and a wheel installed anywhere.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

__all__ = ["DEPLOY_DIR", "SCENARIOS_DIR"]


def _directory(package: str) -> Path:
    found = files(package)
    # Locust, Prometheus and the stack files take these as paths on disk: a zipped install
    # (zipimport) cannot serve them, so it fails here, by name, rather than later.
    if not isinstance(found, Path) or not found.is_dir():
        raise RuntimeError(f"{package}: its files are not on disk ({found!r}); install "
                           "weighbridge from a wheel or a checkout, not a zip archive")
    return found


SCENARIOS_DIR = _directory("weighbridge.scenarios")
DEPLOY_DIR = _directory("weighbridge.deploy")
