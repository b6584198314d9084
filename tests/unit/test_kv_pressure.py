"""benchmarks/kv_pressure.py's candidate rule: an answer's expected final length given what it
has generated (the mean residual life of a tenant's recent outputs), and the footprint that
counts each in-flight request at it."""

from __future__ import annotations

import statistics

from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.kv_pressure import OutputHistory, ResidualFootprint
from tests.unit.sidecar.builders import make_request
from weighbridge.sidecar.request import QueuedRequest

OUTPUTS = st.lists(st.integers(0, 5000), min_size=1, max_size=300)


@settings(max_examples=200, deadline=None)
@given(outputs=OUTPUTS, generated=st.integers(0, 6000))
def test_the_expected_final_length_is_the_mean_of_the_longer_recent_outputs(
        outputs: list[int], generated: int) -> None:
    history = OutputHistory()
    for tokens in outputs:
        history.observe("t", tokens)
    recent = outputs[-OutputHistory.HISTORY:]
    longer = [o for o in recent if o > generated]
    final = history.final("t", generated)
    assert final == (round(statistics.fmean(longer)) if longer else generated)
    assert final is not None and final >= generated
    assert history.final("other", generated) is None


@given(outputs=OUTPUTS, a=st.integers(0, 6000), b=st.integers(0, 6000))
def test_the_expected_final_length_never_falls_as_an_answer_grows(
        outputs: list[int], a: int, b: int) -> None:
    history = OutputHistory()
    for tokens in outputs:
        history.observe("t", tokens)
    low, high = sorted((a, b))
    assert history.final("t", low) <= history.final("t", high)  # type: ignore[operator]


def test_a_bimodal_tenants_long_answer_counts_at_the_long_mode_once_past_the_short() -> None:
    history = OutputHistory()
    for _ in range(8):
        history.observe("runner", 16)
    history.observe("runner", 960)
    history.observe("runner", 960)
    requests: dict[str, QueuedRequest] = {"long": make_request("runner", max_tokens=None),
                                          "short": make_request("runner", max_tokens=16)}
    kv = ResidualFootprint(32, requests.get, history)
    kv.add("long", "runner", 64, 200)
    kv.add("short", "runner", 128, 16)
    mean = round(statistics.fmean([16] * 8 + [960] * 2))
    assert kv.blocks() == -(-(64 + mean) // 32) + -(-(128 + 16) // 32)  # short: its cap
    kv.on_tokens("long", 17)  # past every short answer seen
    assert kv.blocks() == -(-(64 + 960) // 32) + -(-(128 + 16) // 32)
    kv.remove("long")
    kv.remove("short")
    assert kv.blocks() == 0
    assert history.final("runner", 0) == round(statistics.fmean([16] * 8 + [960] * 2 + [17]))
