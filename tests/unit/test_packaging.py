"""pyproject.toml lists its packages by hand (its package-dir rules out setuptools' `find`),
so a new package folder must be added there or the wheel ships without it: every folder with
an ``__init__.py`` under the installed roots is in the list. The parts are reached through
their symbolic links (``weighbridge/sidecar`` -> ``sidecar/``), as setuptools reaches them."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_in_the_wheel() -> None:
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    roots = {p.split(".")[0] for p in listed}
    found = {".".join(Path(folder).relative_to(REPO).parts)
             for root in roots
             for folder, _, files in os.walk(REPO / root, followlinks=True)
             if "__init__.py" in files}
    assert {"weighbridge.sidecar", "weighbridge.emulator"} <= found  # the links were followed
    assert found <= listed, sorted(found - listed)
    # The mapped ones (scenarios/, deploy/) are where package-dir says.
    for package, folder in setuptools["package-dir"].items():
        assert package in listed and (REPO / folder / "__init__.py").is_file(), package


PARTS = ["sidecar", "emulator", "loadgen", "exporters", "analysis", "dashboards"]


def test_each_part_is_installed_under_weighbridge_through_its_link() -> None:
    """The folders stay at the root; ``weighbridge/<part>`` links to each, so the one
    installed name is ``weighbridge`` (docs/architecture.md, "Installed names")."""
    for part in PARTS:
        link = REPO / "weighbridge" / part
        assert link.is_symlink() and os.readlink(link) == f"../{part}", part
        assert (REPO / part / "__init__.py").is_file() and not (REPO / part).is_symlink()
