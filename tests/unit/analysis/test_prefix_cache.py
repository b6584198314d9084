"""Prompt tokens computed against cached, per tenant and per run: the report's tables,
summary.json, the headline row when two runs' hit rates differ, and the load generator's
exporter series."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import generate_latest

from tests.support.metrics import parse
from tests.support.records import rec, write_run
from weighbridge.analysis.frame import load_run
from weighbridge.analysis.headline import headline
from weighbridge.analysis.summary import analyse, summary
from weighbridge.analysis.tables import report_tables
from weighbridge.exporters.loadgen import LoadgenExporter

TENANTS = [("chat", "interactive", 1.0), ("api", "standard", 1.0)]


def _run(tmp_path: Path, name: str, cached: int | None) -> dict:  # type: ignore[type-arg]
    # chat: 10 requests of 300 prompt tokens, ``cached`` of each from the cache; api: 5 of
    # 100 tokens whose server reported nothing (cached_tokens empty), and one rejection.
    records = [rec("chat", scheduled=float(i), prompt=300, cached_tokens=cached,
                   tier="interactive") for i in range(10)]
    records += [rec("api", scheduled=float(i), prompt=100) for i in range(5)]
    records.append(rec("api", scheduled=6.0, prompt=None, output=None, ttft=None,
                       status="rejected"))
    run = write_run(tmp_path / name, records, tenants=TENANTS, duration=12.0, run_id=name)
    return summary(analyse(load_run(run), window_s=2.0))


def test_tenants_and_the_run_count_computed_and_cached_prompt_tokens(tmp_path: Path) -> None:
    s = _run(tmp_path, "on", cached=288)
    chat, api = s["tenants"]["chat"], s["tenants"]["api"]
    assert (chat["computed_prompt_tokens"], chat["cached_prompt_tokens"]) == (120, 2880)
    assert chat["prefix_cache_hit_rate"] == pytest.approx(0.96)
    assert chat["prompt_tokens"] == 3000
    assert api["cached_prompt_tokens"] is None and api["prefix_cache_hit_rate"] is None
    # The run's figures are over the requests that reported: chat's alone.
    assert s["prefix_cache"] == {"computed_prompt_tokens": 120, "cached_prompt_tokens": 2880,
                                 "prefix_cache_hit_rate": pytest.approx(0.96)}
    (tenants,) = [t for t in report_tables(s) if t.title == "Tenants: requests and tokens"]
    rows = {r[0]: dict(zip(tenants.columns, r, strict=True)) for r in tenants.rows}
    assert (rows["chat"]["computed"], rows["chat"]["cached"],
            rows["chat"]["hit rate %"]) == ("120", "2,880", "96.0")
    assert "--enable-prompt-tokens-details" in rows["api"]["hit rate %"]
    health = [t for t in report_tables(s) if t.title.startswith(("Little", "Stability"))]
    assert all("cached ones too" in " ".join(t.notes) for t in health)


def test_the_headline_shows_the_hit_rates_when_they_differ(tmp_path: Path) -> None:
    on, off, again = (_run(tmp_path, "on", 288), _run(tmp_path, "off", 0),
                      _run(tmp_path, "again", 288))
    label = "prefix cache: prompt tokens cached"
    rows = {r.label: (r.this, r.baseline) for r in headline(on, off).rows}
    assert rows[label] == ("96.0% (2,880 of 3,000 prompt tokens)",
                           "0.0% (0 of 3,000 prompt tokens)")
    assert label not in {r.label for r in headline(on, again).rows}  # the same: no row
    assert label not in {r.label for r in headline(on).rows}  # no baseline: no row
    unreported = _run(tmp_path, "unreported", None)
    rows = {r.label: (r.this, r.baseline) for r in headline(on, unreported).rows}
    assert rows[label][1].startswith("— (the server reported no cached tokens")


def test_the_exporter_counts_computed_and_cached_prompt_tokens() -> None:
    exporter = LoadgenExporter(tiers={"chat": "interactive"})
    for cached in (288, 0, None):
        exporter.request_ended(rec("chat", prompt=300, cached_tokens=cached,
                                   tier="interactive"), 1.0)
    s = parse(generate_latest(exporter.registry).decode())
    labels = {"tenant": "chat", "tier": "interactive"}
    assert s.value("weighbridge_client_cached_prompt_tokens_total", **labels) == 288
    assert s.value("weighbridge_client_computed_prompt_tokens_total", **labels) == 12 + 300
    assert s.value("weighbridge_client_prompt_tokens_total", **labels) == 900
