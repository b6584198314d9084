"""The wheel of this checkout, built once per session for the install tests."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built from a copy of the sources: setuptools builds in the source tree and would
    # leave build/ and *.egg-info in the checkout.
    source = tmp_path_factory.mktemp("source") / "weighbridge"
    shutil.copytree(REPO, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv*", ".cache", "build", "runs", "*.egg-info", "__pycache__", ".*_cache",
        ".hypothesis"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--wheel-dir", str(out), str(source)], check=True, timeout=600)
    (built,) = out.glob("weighbridge-*.whl")
    return built
