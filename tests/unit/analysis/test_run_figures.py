"""Per-tenant, per-tier, isolation, Little's Law and stability figures from small synthetic
run directories whose answers were worked out by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.support.records import rec, write_run
from weighbridge.analysis.frame import load_run
from weighbridge.analysis.isolation import isolation, leakage
from weighbridge.analysis.littles_law import littles_law
from weighbridge.analysis.slo import tier_stats
from weighbridge.analysis.stability import offered_tokens, stability
from weighbridge.analysis.summary import analyse, summary
from weighbridge.analysis.tenants import tenant_stats
from weighbridge.analysis.windows import served_tokens, tenant_windows


def test_tenant_counts_tokens_and_latency(tmp_path: Path) -> None:
    records = [
        rec("a", scheduled=0, ttft=0.1, duration=1.0, prompt=100, output=11),
        rec("a", scheduled=1, ttft=0.3, duration=2.0, prompt=50, output=21),
        rec("a", scheduled=2, ttft=None, duration=0.01, prompt=None, output=None,
            status="rejected", reason="queue_full", http_status=429),
        rec("a", scheduled=3, ttft=None, duration=5.0, prompt=None, output=None,
            status="timeout", reason="read_timeout"),
        rec("b", scheduled=0, ttft=0.2, duration=1.0, status="cancelled", output=3),
    ]
    run = load_run(write_run(tmp_path, records, tenants=[("a", "standard", 2.0)]))
    stats = tenant_stats(run.frame, run.info)
    a = stats["a"]
    assert (a.requests, a.ok, a.rejected, a.failed, a.cancelled) == (4, 2, 1, 1, 0)
    assert (a.tier, a.weight, a.prompt_tokens, a.output_tokens) == ("standard", 2.0, 150, 32)
    assert a.rejections == {"queue_full": 1}
    assert a.ttft.count == 2 and a.ttft.p50 == pytest.approx(0.2)
    assert a.e2e.p50 == pytest.approx(1.5)
    # decode speed: (11 - 1) / 0.9 s and (21 - 1) / 1.7 s; median of two is their mean
    assert a.decode_tps.p50 == pytest.approx((10 / 0.9 + 20 / 1.7) / 2)
    assert stats["b"].tier == "standard" and stats["b"].cancelled == 1  # only in the records


def test_slo_attainment_and_goodput(tmp_path: Path) -> None:
    records = [
        rec("i", tier="interactive", ttft=0.2, prompt=10, output=10),   # met (TTFT 0.2 <= 0.5)
        rec("i", tier="interactive", ttft=0.7, prompt=10, output=10),   # missed
        rec("i", tier="interactive", ttft=None, status="rejected", prompt=None, output=None),
        rec("i", tier="interactive", ttft=0.1, status="cancelled"),     # not judged
        rec("s", tier="standard", ttft=1.0, duration=5.0, prompt=100, output=100),  # met
        rec("s", tier="standard", ttft=1.0, duration=12.0),            # missed (E2E > 10 s)
        rec("s", tier="standard", ttft=None, status="error", duration=1.0),
    ]
    run = load_run(write_run(tmp_path, records, duration=20.0))
    tiers = tier_stats(run.frame, run.info, run.duration_s)
    assert tiers["interactive"].requests == 4 and tiers["interactive"].judged == 3
    assert tiers["interactive"].slo_attainment == pytest.approx(1 / 3)
    assert tiers["interactive"].goodput_tokens_per_s == pytest.approx(20 / 20.0)
    assert tiers["standard"].slo_attainment == pytest.approx(1 / 3)
    assert tiers["standard"].goodput_tokens_per_s == pytest.approx(200 / 20.0)
    assert "batch" not in tiers  # configured by default, used by nobody


def test_service_backlog_and_in_flight_per_window(tmp_path: Path) -> None:
    # Scheduled 0.5, first token 1, last token (and end) 3; 10 prompt, 21 output tokens.
    records = [rec("a", scheduled=0.5, ttft=0.5, duration=2.5, prompt=10, output=21)]
    run = load_run(write_run(tmp_path, records, duration=4.0))
    edges = np.array([0.0, 2.0, 4.0])
    assert served_tokens(run.frame, edges).tolist() == [10 + 10.5, 10.5]
    w = tenant_windows(run.frame, ["a"], 4.0, 2.0)
    assert w.backlogged_s["a"].tolist() == [0.5, 0.0]  # waiting from 0.5 to the first token
    assert w.in_flight["a"].tolist() == [0.75, 0.5]  # 1.5 s of 2, then 1 s of 2
    assert w.backlogged("a", 0.25).tolist() == [True, False]


def test_isolation_of_a_named_victim(tmp_path: Path) -> None:
    # Victim TTFTs 0..100 ms when quiet, four times that in the flood: p99 is 99 ms and
    # 396 ms exactly (101 values: rank 99), so leakage = 1 - 99/396 = 0.75.
    records = [rec("v", scheduled=i * 0.1, ttft=i / 1000, phase="quiet") for i in range(101)]
    records += [rec("v", scheduled=20 + i * 0.1, ttft=4 * i / 1000, phase="flood")
                for i in range(101)]
    records += [rec("big", scheduled=20 + i * 0.01, ttft=1.0, phase="flood") for i in range(5)]
    run = load_run(write_run(tmp_path, records, phases=[("quiet", 0, 20), ("flood", 20, 40)],
                             options={"victim": "v"}, duration=40.0))
    iso = isolation(run.frame, run.info)
    assert iso is not None
    assert (iso.victim, iso.victim_from, iso.quiet_phase, iso.flood_phase) == (
        "v", "run.json options", "quiet", "flood")
    assert iso.quiet_ttft_p99_s == pytest.approx(0.099)
    assert iso.flood_ttft_p99_s == pytest.approx(0.396)
    assert iso.leakage == pytest.approx(0.75)
    assert leakage(0.5, 0.4) == 0.0


def test_isolation_finds_victim_and_phases_without_names(tmp_path: Path) -> None:
    records = [rec("v", scheduled=1, ttft=0.1, phase="p1"),
               rec("v", scheduled=11, ttft=0.2, phase="p2")]
    records += [rec("n", scheduled=10 + i * 0.1, ttft=0.1, phase="p2") for i in range(20)]
    records += [rec("n", scheduled=2, ttft=0.1, phase="p1")]
    run = load_run(write_run(tmp_path, records, phases=[("p1", 0, 10), ("p2", 10, 20)]))
    iso = isolation(run.frame, run.info)
    assert iso is not None
    assert (iso.victim, iso.victim_from, iso.flood_phase, iso.quiet_phase) == (
        "v", "fewest requests", "p2", "p1")
    assert iso.leakage == pytest.approx(0.5)


def test_littles_law_by_hand(tmp_path: Path) -> None:
    # T = 10: [0, 2] with 10 tokens, [1, 5] with 20, [8, 12] with 30 (straddles the end).
    records = [rec("a", scheduled=0, duration=2, prompt=5, output=5),
               rec("a", scheduled=1, duration=4, prompt=10, output=10),
               rec("a", scheduled=8, duration=4, prompt=15, output=15)]
    run = load_run(write_run(tmp_path, records, duration=10.0))
    ll = littles_law(run.frame, 10.0)
    assert ll.in_flight == pytest.approx(0.8)  # (2 + 4 + 2) / 10
    assert ll.arrival_rate == pytest.approx(0.3)
    assert ll.time_in_system_s == pytest.approx(10 / 3)
    assert ll.request_ratio == pytest.approx(0.8)  # L / (λ W) = 0.8 / 1.0
    assert ll.tokens_in_flight == pytest.approx(16.0)  # (10*2 + 20*4 + 30*2) / 10
    assert ll.token_arrival_rate == pytest.approx(6.0)
    assert ll.token_time_in_system_s == pytest.approx(220 / 60)
    assert ll.token_ratio == pytest.approx(16 / 22)


def test_offered_and_served_tokens(tmp_path: Path) -> None:
    # Two ok requests (30 and 50 tokens; prompts 10 and 30, outputs 20 each), one rejected:
    # its prompt is imputed as the mean 20, its output as the mean 20 capped at max_tokens 5.
    records = [rec("a", scheduled=0, ttft=1, duration=2, prompt=10, output=20),
               rec("a", scheduled=1, ttft=1, duration=2, prompt=30, output=20),
               rec("a", scheduled=2, ttft=None, duration=0, prompt=None, output=None,
                   status="rejected", max_tokens=5)]
    run = load_run(write_run(tmp_path, records, duration=10.0))
    assert offered_tokens(run.frame).tolist() == [30.0, 50.0, 25.0]
    s = stability(run.frame, 10.0)
    assert s.offered_tokens_per_s == pytest.approx(10.5)
    assert s.served_tokens_per_s == pytest.approx(8.0)
    assert s.ratio == pytest.approx(105 / 80)  # offered over served
    assert s.stable is False


def test_summary_has_the_contract_keys(tmp_path: Path) -> None:
    records = [rec(t, scheduled=i * 0.5, ttft=0.05, tier="interactive", phase=p)
               for i in range(40) for t, p in (("a", "quiet" if i < 20 else "flood"),
                                               ("b", "quiet" if i < 20 else "flood"))]
    run = load_run(write_run(tmp_path, records, tenants=[("a", "interactive", 1.0),
                                                         ("b", "interactive", 1.0)],
                             phases=[("quiet", 0, 10), ("flood", 10, 20)], duration=20.0))
    s = summary(analyse(run, window_s=5.0))
    assert set(s) >= {"run", "tenants", "tiers", "fairness", "isolation", "littles_law",
                      "stability"}
    assert set(s["tenants"]["a"]) >= {"tier", "requests", "ok", "rejected", "failed",
                                      "prompt_tokens", "output_tokens", "ttft_p50_s",
                                      "ttft_p99_s", "e2e_p99_s", "itl_p99_s", "decode_tps_p50"}
    assert set(s["tiers"]["interactive"]) >= {"requests", "ttft_p50_s", "ttft_p99_s",
                                              "slo_attainment", "goodput_tokens_per_s"}
    assert set(s["fairness"]) >= {"jain_index", "max_min_share_ratio", "max_service_difference"}
    assert set(s["littles_law"]["a"]) >= {"request_ratio", "token_ratio"}
    assert set(s["stability"]) >= {"offered_tokens_per_s", "served_tokens_per_s"}


def test_unfinished_run_reads_the_jsonl(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path, [rec("a"), rec("b")], finish=False))
    assert not (tmp_path / "requests.parquet").exists()
    assert run.records == 2 and sorted(map(str, run.frame["tenant"])) == ["a", "b"]
