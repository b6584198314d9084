"""The one fixture the integration suites share. Helpers are plain modules in tests/support/
(imported, never from a conftest)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def processes() -> Iterator[contextlib.ExitStack]:
    """An exit stack owning every process a module starts; all are stopped at its end."""
    with contextlib.ExitStack() as stack:
        yield stack
