"""pyproject.toml lists its packages by hand (its package-dir rules out setuptools' `find`),
so a new package folder must be added there or the wheel ships without it: every folder with
an ``__init__.py`` under the installed roots is in the list."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_package_folder_is_in_the_wheel() -> None:
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    roots = {p.split(".")[0] for p in listed}
    found = {".".join(init.parent.relative_to(REPO).parts)
             for root in roots for init in (REPO / root).rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)
    # The mapped ones (scenarios/, deploy/) are where package-dir says.
    for package, folder in setuptools["package-dir"].items():
        assert package in listed and (REPO / folder / "__init__.py").is_file(), package
