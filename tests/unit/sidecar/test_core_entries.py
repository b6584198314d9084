"""SchedulingCore's one fold point (sidecar.core, "Streamed tokens"): every public method that
reads or changes what a fold changes is an ``@_entry`` and folds before its body runs; the
views (``fleet``, ``scheduler``, ``meter``) are plain reads."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

from tests.unit.sidecar.test_core import arrive, make_config
from weighbridge.sidecar.admission import GateLimits
from weighbridge.sidecar.core import Dispatch, SchedulingCore
from weighbridge.sidecar.request import QueuedRequest

# Public methods that read and change nothing a fold changes (the schedulers' charges, the
# route's outstanding tokens, the KV footprints, the meters): the model catalog, the ledger's
# count of early rejections, the prefix indexes, the output estimate, the route's session
# bindings; and the two calls that defer, and the loop over ``next_dispatch`` (an entry).
NOT_ENTRIES = {
    "on_first_token", "on_tokens_streamed", "dispatch_ready",
    "has_backend", "serves", "pool_for",
    "on_backend_models", "request_model", "learn_sent_prefix", "learn_sent_tokens",
    "poll_period_s", "estimated_tokens", "learn_session",
}


def test_every_public_method_is_an_entry_or_reads_nothing_a_fold_changes() -> None:
    members = vars(SchedulingCore)
    public = {name for name, member in members.items()
              if not name.startswith("_") and callable(member)}
    entries = {name for name in public if getattr(members[name], "folds_first", False)}
    assert public - entries == NOT_ENTRIES
    assert entries >= {"arrive", "next_dispatch", "cancel", "on_completed", "on_failed",
                       "on_client_gone", "stats", "snapshot", "fold_streamed"}


def streaming() -> tuple[SchedulingCore, Dispatch]:
    """A core with one request past its first token and 40 tokens streamed, not folded."""
    core = SchedulingCore(make_config(), gate_limits=GateLimits(max_inflight=4))
    assert isinstance(arrive(core, "a", prompt_tokens=100), QueuedRequest)
    arrive(core, "b", prompt_tokens=100)  # stays queued (a one-request dispatch below)
    dispatch = core.next_dispatch(0.0)
    assert dispatch is not None
    core.on_first_token(dispatch.request, 0.1)
    core.on_tokens_streamed(dispatch.request, 40, 0.2)
    return core, dispatch


def test_the_views_are_plain_reads() -> None:
    core, dispatch = streaming()
    backend = dispatch.backend
    # 100 expected output tokens left: the 40 streamed are counted but not yet folded.
    assert core.fleet[backend].outstanding_tokens == 100
    for _ in range(2):
        assert (core.fleet, core.scheduler, core.meter) is not None
    assert core.fleet[backend].outstanding_tokens == 100
    assert dispatch.request.streamed_output_tokens == 40
    core.fold_streamed()
    assert core.fleet[backend].outstanding_tokens == 100 - 40


ENTRIES: dict[str, Callable[[SchedulingCore, Dispatch], Any]] = {
    "arrive": lambda core, _: arrive(core, "i", 0.3),
    "next_dispatch": lambda core, _: core.next_dispatch(0.3),
    "cancel": lambda core, _: core.cancel("no-such-request", 0.3),
    "share_slots": lambda core, _: core.share_slots(0.3),
    "stats": lambda core, _: core.stats(0.3),
    "snapshot": lambda core, _: core.snapshot(0.3),
    "mark_backend_healthy": lambda core, d: core.mark_backend_healthy(d.backend),
    "pools": lambda core, _: core.pools(),
}


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_an_entry_folds_every_stream_first(name: str) -> None:
    core, dispatch = streaming()
    ENTRIES[name](core, dispatch)
    assert core.fleet[dispatch.backend].outstanding_tokens == 100 - 40


def test_the_core_keeps_the_lifecycle_and_nothing_more() -> None:
    """Issue 39: SchedulingCore holds a request's lifecycle and its statistics, under 750
    lines; a rule that grows it belongs in a part (sidecar.fairness, sidecar.routing,
    sidecar.eligibility) or a pure module beside it."""
    lines, _ = inspect.getsourcelines(SchedulingCore)
    assert len(lines) < 750, len(lines)
