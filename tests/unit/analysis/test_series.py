"""The report's plots as data: their order, and each tenant's token share against its
entitlement (docs/analysis.md's worked example)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tests.support.records import flood_run, rec, write_run
from weighbridge.analysis.fairness import fairness
from weighbridge.analysis.frame import load_run
from weighbridge.analysis.interactive import render
from weighbridge.analysis.plots import png
from weighbridge.analysis.series import charts, share_and_entitlement
from weighbridge.analysis.summary import analyse
from weighbridge.analysis.windows import Windows


def test_share_against_entitlement_by_hand(tmp_path: Path) -> None:
    # Weights a = 1, b = 2, both backlogged in two 10 s windows, served (100, 200) then
    # (300, 100); c is in the tier too but never backlogged and served 100 in window 2.
    # Shares of the tier's tokens: a 100/300, 300/500; b 200/300, 100/500; c 0, 100/500.
    # Entitled: a 1/3 of the backlogged tenants' tokens (300, then 400): 100/300, then
    # 133.3/500; b 2/3: 200/300, then 266.7/500; c none (not backlogged).
    run = load_run(write_run(tmp_path, [rec(n) for n in "abc"],
                             tenants=[("a", "standard", 1.0), ("b", "standard", 2.0),
                                      ("c", "standard", 1.0)], duration=20.0))
    a = analyse(run, window_s=10.0)
    edges = np.array([0.0, 10.0, 20.0])
    service = {"a": np.array([100.0, 300.0]), "b": np.array([200.0, 100.0]),
               "c": np.array([0.0, 100.0])}
    backlogged = {"a": np.array([True, True]), "b": np.array([True, True]),
                  "c": np.array([False, False])}
    zeros = {n: np.zeros(2) for n in "abc"}
    a = replace(a, windows=Windows(edges, service, zeros, zeros, zeros),
                fairness=fairness(edges, service, backlogged, {"a": 1.0, "b": 2.0, "c": 1.0},
                                  dict.fromkeys("abc", "standard"), 0.9, 10.0))
    out = share_and_entitlement(a)
    assert out["a"][0] == pytest.approx([1 / 3, 3 / 5])
    assert out["a"][1] == pytest.approx([1 / 3, 400 / 3 / 500])
    assert out["b"][0] == pytest.approx([2 / 3, 1 / 5])
    assert out["b"][1] == pytest.approx([2 / 3, 800 / 3 / 500])
    assert out["c"][0] == pytest.approx([0.0, 1 / 5])
    assert np.isnan(out["c"][1]).all()


def test_charts_in_reading_order_and_both_renderers(tmp_path: Path) -> None:
    this = analyse(load_run(flood_run(tmp_path / "wb", flood_ttft=0.075, run_id="wb")), 2.0)
    base = analyse(load_run(flood_run(tmp_path / "fifo", flood_ttft=2.15, run_id="fifo")),
                   2.0)
    drawn = charts(this, base)
    assert [c.key for c in drawn] == ["victim-ttft", "token-share", "ttft-cdf", "in-flight",
                                      "tenant-ttft"]
    victim = drawn[0]
    assert [ln.name for ln in victim.lines] == ["baseline (fifo)", "this run (wb)"]
    # Window [10, 12) holds the victim's flood requests at 10 and 11: p99 TTFT 2,150 ms
    # in the baseline, 75 ms here; [0, 2) holds quiet ones at 50 ms in both.
    assert victim.lines[0].y[[0, 5]] == pytest.approx([50.0, 2150.0])
    assert victim.lines[1].y[[0, 5]] == pytest.approx([50.0, 75.0])
    assert not victim.y_log  # 2,150 / 50 = 43: under the 50x that turns the axis to log
    assert charts(this)[0].key == "victim-ttft"  # the victim alone, without a baseline
    assert png(drawn[0])[:8] == b"\x89PNG\r\n\x1a\n"
    rendered = render(drawn)
    assert set(rendered.divs) == {c.key for c in drawn}
    # A click on a legend entry hides its lines; hovering shows the values.
    assert rendered.script.count('"click_policy":"hide"') == len(drawn)
    assert rendered.script.count('"type":"object","name":"HoverTool"') == len(drawn)
