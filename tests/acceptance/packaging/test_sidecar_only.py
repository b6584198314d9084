"""Dependencies by role (docs/architecture.md, "Installs"): the sidecar's code path loads
none of the other parts' heavy dependencies, and an install of ``weighbridge[sidecar]``
alone, outside the checkout, serves the sidecar without them.

The first check runs in this environment (which has everything): a fresh interpreter builds
the sidecar as ``weighbridge sidecar`` does and lists what got imported. The second installs
the wheel with the ``sidecar`` extra into a fresh venv, which is what the sidecar's
container image does.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
SIDECAR_YAML = REPO / "deploy" / "compose" / "sidecar.yaml"

# Modules of the other roles' dependencies; urllib3_future is how urllib3-future shows up
# when it did not install over urllib3 (it replaces urllib3's files otherwise: checked in
# the venv test through the installed distributions).
FOREIGN = ("locust", "gevent", "geventhttpclient", "pandas", "matplotlib", "pyarrow", "bokeh",
           "niquests", "urllib3_future", "grafana_client", "grafana_foundation_sdk")

# What `weighbridge sidecar --config ...` runs, short of listening: the CLI module, the
# config, the whole Sidecar application object.
BUILD_SIDECAR = f"""
import sys
import weighbridge.app.cli
from weighbridge.sidecar.app import Sidecar, run_sidecar
from weighbridge.sidecar.config import load_config
Sidecar(load_config({str(SIDECAR_YAML)!r}))
print("\\n".join(sorted(sys.modules)))
"""


# The parts' folders at the checkout's root: imported by these bare names, their files would
# load a second time as other modules (docs/architecture.md, "Installed names").
BARE_PARTS = ("sidecar", "emulator", "loadgen", "exporters", "analysis", "dashboards")


def _loaded_modules(python: str | Path, cwd: Path) -> tuple[set[str], set[str]]:
    """Every module the sidecar's build loaded, and their top-level names."""
    out = subprocess.run([str(python), "-c", BUILD_SIDECAR], cwd=cwd, capture_output=True,
                         text=True, timeout=120, check=True)
    names = set(out.stdout.split())
    return names, {name.split(".")[0] for name in names}


def test_the_sidecar_imports_no_other_roles_dependencies(tmp_path: Path) -> None:
    names, loaded = _loaded_modules(sys.executable, REPO)
    assert "aiohttp" in loaded and "weighbridge.sidecar.app" in names  # it built the sidecar
    assert not loaded & set(FOREIGN), sorted(loaded & set(FOREIGN))
    # From the checkout's root, where the bare folders are importable, none was imported.
    assert not loaded & set(BARE_PARTS), sorted(loaded & set(BARE_PARTS))


def test_a_sidecar_only_install_serves_without_the_other_roles(
        tmp_path: Path, wheel: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-compile",
                    f"weighbridge[sidecar] @ {wheel.as_uri()}"],
                   check=True, timeout=600)
    listed = subprocess.run([str(python), "-m", "pip", "list", "--format=freeze"],
                            capture_output=True, text=True, check=True, timeout=120).stdout
    installed = {line.split("==")[0].lower() for line in listed.split()}
    assert "aiohttp" in installed
    assert not installed & {"locust", "gevent", "geventhttpclient", "pandas", "matplotlib",
                            "pyarrow", "bokeh", "grafana-client", "niquests", "urllib3-future"}, \
        sorted(installed)
    # Outside the checkout, so that nothing is imported from its folders.
    names, loaded = _loaded_modules(python, tmp_path)
    assert "weighbridge.sidecar.app" in names
    assert not loaded & set(FOREIGN)
    assert not loaded & set(BARE_PARTS)  # one installed name: there are none to import
