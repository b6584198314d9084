"""A quiet install, and a base install that says what it lacks.

``pip wheel`` of the checkout and ``pip install -e`` print no warning (setuptools warned
once per data folder the package list left out). The wheel installed with its base
dependencies alone, resolved by pip from the package index, as ``pip install weighbridge``
does: every command that needs an extra answers with its one line on stderr and exit
status 2, no traceback (the table is tests/support/commands.py; tests/unit/test_extras.py
walks it in process).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.commands import COMMANDS
from tests.support.wheel import Built, copy_of_the_sources

pytestmark = pytest.mark.timeout(600)


def warnings_in(output: str) -> list[str]:
    """The lines that warn. pip's own notes on this machine's index configuration (a
    find-links location that is absent) say nothing of the package and are left out."""
    return [line for line in output.splitlines()
            if re.search(r"(?i)warn", line) and not line.startswith("WARNING: Location ")]


def _venv(where: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=120)
    return where / "bin" / "python"


def _pip(python: Path, *args: str) -> str:
    """pip install into the venv of ``python``, run by this environment's pip: the version
    `make` upgrades to, not the venv's bundled one (older pips hide the build's warnings)."""
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                           "--no-compile", *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


def test_building_the_wheel_prints_no_warning(built: Built) -> None:
    assert warnings_in(built.output) == []


def test_the_editable_install_prints_no_warning(tmp_path: Path) -> None:
    source = copy_of_the_sources(tmp_path)
    output = _pip(_venv(tmp_path / "venv"), "--no-deps", "-e", str(source))
    assert warnings_in(output) == []


@pytest.fixture(scope="module")
def base_venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    venv = tmp_path_factory.mktemp("base") / "venv"
    output = _pip(_venv(venv), str(wheel))
    assert warnings_in(output) == []
    return venv


def test_the_base_install_holds_no_extra(base_venv: Path) -> None:
    done = subprocess.run([str(base_venv / "bin" / "python"), "-c",
                           "import importlib.util as u; print([m for m in "
                           "('aiohttp', 'pandas', 'locust', 'grafana_foundation_sdk') "
                           "if u.find_spec(m)])"], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("words", sorted(COMMANDS))
def test_each_command_of_the_base_install_names_its_extras(
        base_venv: Path, words: str, tmp_path: Path) -> None:
    argv, line = COMMANDS[words]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run([str(base_venv / "bin" / "weighbridge"), *words.split(), *argv],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env)
    if line is None:  # the base is all it needs
        assert done.returncode == 0, done.stderr
        return
    assert (done.returncode, done.stderr) == (2, line + "\n"), done.stdout
