"""Building this checkout's wheel for the install tests (tests/acceptance/packaging/)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def copy_of_the_sources(dest: Path) -> Path:
    """A copy to build from: setuptools builds in the source tree and would leave build/
    and *.egg-info in the checkout."""
    source = dest / "weighbridge"
    shutil.copytree(REPO, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv*", ".cache", "build", "runs", "*.egg-info", "__pycache__", ".*_cache",
        ".hypothesis"))
    return source


@dataclass(frozen=True)
class Built:
    wheel: Path
    output: str  # what pip and the build backend printed, stdout and stderr
