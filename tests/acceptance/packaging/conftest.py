"""The wheel of this checkout, built once per session for the install tests, with what the
build printed (test_install.py holds it to no warning)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.wheel import Built, copy_of_the_sources


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    source = copy_of_the_sources(tmp_path_factory.mktemp("source"))
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir",
                           str(out), str(source)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = out.glob("weighbridge-*.whl")
    return Built(wheel, done.stdout + done.stderr)


@pytest.fixture(scope="session")
def wheel(built: Built) -> Path:
    return built.wheel
