"""pyproject.toml lists its packages by hand (its package-dir rules out setuptools' `find`),
so a new package folder must be added there or the wheel ships without it: every folder
under the installed roots is in the list, a data-only one too (left out, every build warns
about it). The parts are reached through their symbolic links (``weighbridge/sidecar`` ->
``sidecar/``), as setuptools reaches them."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _setuptools() -> dict[str, Any]:
    table: dict[str, Any] = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]
    return table["setuptools"]


def _package(folder: Path, mapped: dict[str, str]) -> str:
    """The installed name of a folder: package-dir's mapping, else its path."""
    parts = folder.relative_to(REPO).parts
    return ".".join((mapped.get(parts[0], parts[0]), *parts[1:]))


def test_every_package_folder_is_in_the_wheel() -> None:
    setuptools = _setuptools()
    listed = set(setuptools["packages"])
    mapped = {folder: package for package, folder in setuptools["package-dir"].items()}
    roots = {p.split(".")[0] for p in listed} | set(mapped)
    found = {_package(Path(folder), mapped)
             for root in roots
             for folder, _, _ in os.walk(REPO / root, followlinks=True)
             if "__pycache__" not in Path(folder).parts}
    assert {"weighbridge.sidecar", "weighbridge.emulator"} <= found  # the links were followed
    assert {"weighbridge.dashboards.json", "weighbridge.deploy.stacks"} <= found  # data only
    assert found <= listed, sorted(found - listed)
    # The mapped ones (scenarios/, deploy/) are where package-dir says.
    for package, folder in setuptools["package-dir"].items():
        assert package in listed and (REPO / folder / "__init__.py").is_file(), package


def test_each_package_data_glob_finds_its_files() -> None:
    """A glob that matches nothing ships nothing: a renamed folder or suffix would leave the
    wheel without the files and only the wheel's own test would notice."""
    setuptools = _setuptools()
    folders = {_package(Path(folder), {f: p for p, f in setuptools["package-dir"].items()}):
               Path(folder)
               for root in ("weighbridge", *setuptools["package-dir"].values())
               for folder, _, _ in os.walk(REPO / root, followlinks=True)}
    for package, patterns in setuptools["package-data"].items():
        for pattern in patterns:
            assert list(folders[package].glob(pattern)), (package, pattern)


PARTS = ["sidecar", "emulator", "loadgen", "exporters", "analysis", "dashboards"]


def test_each_part_is_installed_under_weighbridge_through_its_link() -> None:
    """The folders stay at the root; ``weighbridge/<part>`` links to each, so the one
    installed name is ``weighbridge`` (docs/architecture.md, "Installed names")."""
    for part in PARTS:
        link = REPO / "weighbridge" / part
        assert link.is_symlink() and os.readlink(link) == f"../{part}", part
        assert (REPO / part / "__init__.py").is_file() and not (REPO / part).is_symlink()
