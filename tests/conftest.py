"""What every tier shares: the Hypothesis profile, the tier markers and ``processes``.

Hypothesis without wall-clock checks: its per-example deadline (200 ms by default) and its
too-slow health check time the machine, not the property, and fail on a loaded 2-core
machine (a dashboard layout example took 623 ms there). In CI (``CI`` set, as .ci/run runs)
the examples are derandomized: the same inputs every run, so a red run is reproducible and
never a new random draw; locally they keep exploring.

A test's tier is its directory (docs/testing.md): ``tests/unit``, ``tests/integration`` (and
``tests/conformance``, which starts the emulator and real vLLM) and ``tests/acceptance``.
The hook below gives each test its directory's marker, so ``-m`` selects by tier and no
module sets one by hand. ``make test`` runs in two passes: every test but the ``quiet`` ones
on two workers (pytest-xdist; the scheduler below gives a worker a module at a time, with
its module-scoped processes, and conformance and packaging each whole, with their
session-scoped servers and wheel), then the ``quiet`` ones alone. ``quiet`` is a module's own
statement that it asserts latency or CPU cost against a baseline taken on this machine; only
the acceptance tier may make it, so every integration test holds with another test beside
it.

Before any test of the two tiers that start processes runs, the system programs they start
are checked once (scripts/system-programs.sh, which `make test` runs to install them): a
missing one stops the session with one message instead of failing each test that needs it.
Helpers are plain modules in tests/support/ (imported, never from a conftest).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "weighbridge", deadline=None, suppress_health_check=[HealthCheck.too_slow],
    derandomize=bool(os.environ.get("CI")))
settings.load_profile("weighbridge")

TESTS = Path(__file__).parent
TIERS = ("unit", "integration", "acceptance")
TIER_OF_FOLDER = {"unit": "unit", "integration": "integration", "conformance": "integration",
                  "acceptance": "acceptance"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if not item.path.is_relative_to(TESTS):
            continue  # a benchmark's own test, run by path
        folder = item.path.relative_to(TESTS).parts[0]
        tier = TIER_OF_FOLDER.get(folder)
        if tier is None:
            raise pytest.UsageError(f"{item.nodeid}: a test lives under tests/unit, "
                                    "tests/integration or tests/acceptance")
        wrong = [m.name for m in item.iter_markers() if m.name in TIERS and m.name != tier]
        if wrong:
            raise pytest.UsageError(f"{item.nodeid}: marked {wrong[0]} under tests/{folder}; "
                                    "the directory sets the tier")
        if item.get_closest_marker("quiet") and tier != "acceptance":
            raise pytest.UsageError(f"{item.nodeid}: only an acceptance test may run quiet")
        item.add_marker(tier)


# Folders whose session-scoped fixtures serve several modules: conformance's vLLM servers
# (one start-up each) and packaging's wheel (one build of the checkout).
SESSION_GROUPS = (Path("conformance"), Path("acceptance", "packaging"))


def _process_group(nodeid: str) -> str:
    """The tests that share one worker: a module's, or a whole folder's where its
    session-scoped fixtures serve several modules (``nodeid`` is relative to the root)."""
    path = Path(nodeid.split("::", 1)[0])
    for folder in SESSION_GROUPS:
        if path.is_relative_to(TESTS.name / folder):
            return str(TESTS.name / folder)
    return str(path)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist (``make test``'s first pass), a worker takes a process group at a
    time, so a module's processes and a folder's session servers start once."""
    from xdist.scheduler import LoadScopeScheduling

    class ProcessGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _process_group(nodeid)

    return ProcessGroups(config, log)


def pytest_collection_finish(session: pytest.Session) -> None:
    if not any(item.get_closest_marker(tier) for item in session.items
               for tier in ("integration", "acceptance")):
        return
    check = subprocess.run(["bash", str(TESTS.parent / "scripts" / "system-programs.sh"),
                            "check"], capture_output=True, text=True, timeout=30)
    if check.returncode != 0:
        raise pytest.UsageError(
            f"the integration and acceptance tests start programs that are not installed: "
            f"{check.stdout.strip()}; run make test (it installs them as root) or "
            "bash scripts/system-programs.sh install")


@pytest.fixture(scope="module")
def processes() -> Iterator[contextlib.ExitStack]:
    """An exit stack owning every process a module starts; all are stopped at its end."""
    with contextlib.ExitStack() as stack:
        yield stack
