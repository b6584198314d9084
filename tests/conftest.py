"""What every tier shares: the Hypothesis profile, the tier markers and ``processes``.

Hypothesis without wall-clock checks: its per-example deadline (200 ms by default) and its
too-slow health check time the machine, not the property, and fail on a loaded 2-core
machine (a dashboard layout example took 623 ms there). In CI (``CI`` set, as .ci/run runs)
the examples are derandomized: the same inputs every run, so a red run is reproducible and
never a new random draw; locally they keep exploring.

A test's tier is its directory (docs/testing.md): ``tests/unit``, ``tests/integration`` (and
``tests/conformance``, which starts the emulator and real vLLM) and ``tests/acceptance``.
The hook below gives each test its directory's marker, so ``-m`` selects by tier and no
module sets one by hand. Before any test of the two tiers that start processes runs, the
system programs they start are checked once (scripts/system-programs.sh, which `make test`
runs to install them): a missing one stops the session with one message instead of failing
each test that needs it. Helpers are plain modules in tests/support/ (imported, never from
a conftest).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

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
        item.add_marker(tier)


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
