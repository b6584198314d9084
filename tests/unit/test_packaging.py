"""pyproject.toml lists its packages by hand, so a new package folder must be added there or
the wheel ships without it: every folder under ``weighbridge/`` is in the list, a data-only
one too (left out, every build warns about it). The parts, the scenarios and the deployment
files are reached through their symbolic links (``weighbridge/sidecar`` -> ``sidecar/``), as
setuptools reaches them."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _setuptools() -> dict[str, Any]:
    table: dict[str, Any] = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]
    return table["setuptools"]


def _folders() -> dict[str, Path]:
    """Every folder under weighbridge/, links followed, by its package name."""
    return {".".join(Path(folder).relative_to(REPO).parts): Path(folder)
            for folder, _, _ in os.walk(REPO / "weighbridge", followlinks=True)
            if "__pycache__" not in Path(folder).parts}


def test_every_package_folder_is_in_the_wheel() -> None:
    setuptools = _setuptools()
    listed = set(setuptools["packages"])
    found = set(_folders())
    assert {"weighbridge.sidecar", "weighbridge.emulator"} <= found  # the links were followed
    assert {"weighbridge.dashboards.json", "weighbridge.deploy.stacks"} <= found  # data only
    assert found <= listed, sorted(found - listed)
    # A simple layout, every package where its name says: an editable install is a path
    # entry, without the import hook (and the warning) a mapped package needs.
    assert setuptools["package-dir"] == {"": "."}


def test_each_package_data_glob_finds_its_files() -> None:
    """A glob that matches nothing ships nothing: a renamed folder or suffix would leave the
    wheel without the files and only the wheel's own test would notice."""
    folders = _folders()
    for package, patterns in _setuptools()["package-data"].items():
        for pattern in patterns:
            assert list(folders[package].glob(pattern)), (package, pattern)


LINKED = ["sidecar", "emulator", "loadgen", "exporters", "analysis", "dashboards", "scenarios",
          "deploy"]


def test_each_part_is_installed_under_weighbridge_through_its_link() -> None:
    """The folders stay at the root; ``weighbridge/<part>`` links to each, so the one
    installed name is ``weighbridge`` (docs/architecture.md, "Installed names")."""
    for part in LINKED:
        link = REPO / "weighbridge" / part
        assert link.is_symlink() and os.readlink(link) == f"../{part}", part
        assert (REPO / part / "__init__.py").is_file() and not (REPO / part).is_symlink()
