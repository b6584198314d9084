"""The load generator's exporter: its exposition, parsed back, series by series."""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

import pytest
from prometheus_client import generate_latest

from tests.support.metrics import Scrape, parse
from weighbridge.exporters.loadgen import LoadgenExporter
from weighbridge.records import STATUSES, RequestRecord

RUN_START = 5000.0  # the run's t=0 on the exporter's clock


@dataclass
class FakeClock:
    now: float = RUN_START

    def __call__(self) -> float:
        return self.now


def scrape(exporter: LoadgenExporter) -> Scrape:
    whole = parse(generate_latest(exporter.registry).decode())
    # Without prometheus_client's creation-time companions of counters and histograms.
    types = {name: kind for name, kind in whole.types.items() if not name.endswith("_created")}
    return Scrape(whole.samples, types, whole.at_s, whole.families)


def record(tenant: str, tier: str, scheduled_s: float, end_s: float, *, status: str = "ok",
           prompt: int | None = 100, output: int | None = 50, max_tokens: int = 200,
           chunks: int | None = None, n: int = 0) -> RequestRecord:
    ok = status == "ok"
    first = scheduled_s + (end_s - scheduled_s) / 4 if ok else None
    return RequestRecord(
        run_id="r", scenario="s", phase="p", request_id=f"{tenant}-{n}", tenant=tenant,
        tier=tier, endpoint="/v1/completions", stream=True, max_tokens=max_tokens,
        scheduled_s=scheduled_s, sent_s=scheduled_s, first_token_s=first,
        last_token_s=end_s if ok else None, end_s=end_s,
        prompt_tokens=prompt if ok else None, output_tokens=output if ok else None,
        chunks=(chunks if chunks is not None else (output or 0)) if ok else 0,
        status=status, http_status=200 if ok else 429,
        reason=None if ok else "rate_limited")


@dataclass(frozen=True)
class Sent:
    record: RequestRecord
    declared: int | None  # None: the start is never reported
    end_reported: bool = True  # False: the generator forgets the request


def run_requests(exporter: LoadgenExporter, clock: FakeClock, requests: list[Sent]) -> None:
    """Replay requests in time order on the fake clock: each start at its scheduled time with
    its declared tokens, each end at its end time."""
    events: list[tuple[float, int, int]] = []
    for i, sent in enumerate(requests):
        events.append((sent.record.scheduled_s, 0, i))
        if sent.end_reported:
            events.append((sent.record.end_s, 1, i))
    for at, kind, i in sorted(events):
        sent = requests[i]
        clock.now = RUN_START + at
        if kind == 0 and sent.declared is not None:
            exporter.request_started(sent.record.tenant, sent.record.tier, sent.declared,
                                     clock.now)
        elif kind == 1:
            exporter.request_ended(sent.record, clock.now)


DOCUMENTED_FAMILIES = {
    # name: (type, labels beyond the metric's own le/quantile)
    "weighbridge_client_ttft_seconds": ("histogram", {"tenant", "tier"}),
    "weighbridge_client_e2e_seconds": ("histogram", {"tenant", "tier"}),
    "weighbridge_client_itl_seconds": ("histogram", {"tenant", "tier"}),
    "weighbridge_client_decode_tokens_per_second": ("histogram", {"tenant", "tier"}),
    "weighbridge_client_schedule_lag_seconds": ("histogram", {"tenant", "tier"}),
    "weighbridge_client_requests": ("counter", {"tenant", "tier", "status"}),
    "weighbridge_client_requests_scheduled": ("counter", {"tenant", "tier"}),
    "weighbridge_client_prompt_tokens": ("counter", {"tenant", "tier"}),
    "weighbridge_client_output_tokens": ("counter", {"tenant", "tier"}),
    "weighbridge_client_cached_prompt_tokens": ("counter", {"tenant", "tier"}),
    "weighbridge_client_computed_prompt_tokens": ("counter", {"tenant", "tier"}),
    "weighbridge_client_in_flight_requests": ("gauge", {"tenant", "tier"}),
    "weighbridge_client_in_flight_tokens": ("gauge", {"tenant", "tier"}),
    "weighbridge_client_in_flight_request_seconds": ("counter", {"tenant", "tier"}),
    "weighbridge_client_in_flight_token_seconds": ("counter", {"tenant", "tier"}),
    "weighbridge_client_time_in_system_seconds": ("counter", {"tenant", "tier"}),
    "weighbridge_client_time_in_system_token_seconds": ("counter", {"tenant", "tier"}),
    "weighbridge_client_backend_scrape_errors": ("counter", set()),
    "weighbridge_client_program_seconds": ("histogram", {"tenant", "tier"}),
    "weighbridge_client_programs": ("counter", {"tenant", "tier", "outcome"}),
    "weighbridge_client_programs_started": ("counter", {"tenant", "tier"}),
    "weighbridge_client_programs_in_progress": ("gauge", {"tenant", "tier"}),
    "weighbridge_client_program_in_progress_seconds": ("counter", {"tenant", "tier"}),
    "weighbridge_client_program_time_in_system_seconds": ("counter", {"tenant", "tier"}),
    "weighbridge_littles_law_l": ("gauge", {"tenant", "level"}),
    "weighbridge_littles_law_lambda_w": ("gauge", {"tenant", "level"}),
    "weighbridge_littles_law_ratio": ("gauge", {"tenant", "level"}),
    "weighbridge_tenant_token_share": ("gauge", {"tenant"}),
    "weighbridge_tenant_entitled_share": ("gauge", {"tenant"}),
    "weighbridge_tenant_weight": ("gauge", {"tenant"}),
    "weighbridge_jain_index": ("gauge", set()),
    "weighbridge_tier_jain_index": ("gauge", {"tier"}),
    "weighbridge_offered_tokens_per_second": ("gauge", set()),
    "weighbridge_served_tokens_per_second": ("gauge", {"source"}),
    "weighbridge_offered_token_load_ratio": ("gauge", set()),
}


def test_every_series_exists_from_the_first_scrape_for_configured_tenants() -> None:
    exporter = LoadgenExporter(weights={"a": 2.0, "b": 1.0},
                               tiers={"a": "interactive", "b": "batch"}, clock=FakeClock())
    s = scrape(exporter)
    assert set(s.types) == set(DOCUMENTED_FAMILIES)
    for name, (kind, labels) in DOCUMENTED_FAMILIES.items():
        assert s.types[name] == kind, name
        label_sets = s.label_sets(name)
        assert label_sets, f"{name}: no series"
        for label_set in label_sets:
            assert {k for k, _ in label_set} - {"le"} == labels, (name, label_set)
    for tenant, tier in (("a", "interactive"), ("b", "batch")):
        for status in STATUSES:
            assert s.value("weighbridge_client_requests_total", tenant=tenant, tier=tier,
                           status=status) == 0.0
        assert s.value("weighbridge_client_ttft_seconds_count", tenant=tenant, tier=tier) == 0
        assert s.value("weighbridge_tenant_weight", tenant=tenant) == {"a": 2, "b": 1}[tenant]
        for level in ("request", "token", "program"):
            assert math.isnan(s.value("weighbridge_littles_law_ratio", tenant=tenant,
                                      level=level))
    assert math.isnan(s.value("weighbridge_jain_index"))


def test_hand_computed_exposition() -> None:
    clock = FakeClock()
    exporter = LoadgenExporter(weights={"a": 3.0}, tiers={"a": "standard", "b": "batch"},
                               window_s=10.0, clock=clock)
    run_requests(exporter, clock, [
        Sent(record("a", "standard", 1.0, 3.0, prompt=100, output=50, chunks=11, n=1), 300),
        Sent(record("b", "batch", 2.0, 6.0, prompt=40, output=60, chunks=5, n=2), 260),
        Sent(record("b", "batch", 2.5, 2.6, status="rejected", n=3), 240),
        Sent(record("a", "standard", 7.0, 10.0, n=4), 250, end_reported=False),  # in flight
    ])
    exporter.schedule_lag("a", 0.003)
    exporter.schedule_lag("newcomer", 0.2)
    clock.now = RUN_START + 9.0
    s = scrape(exporter)
    a, b = {"tenant": "a", "tier": "standard"}, {"tenant": "b", "tier": "batch"}

    assert s.value("weighbridge_client_requests_total", **a, status="ok") == 1
    assert s.value("weighbridge_client_requests_total", **b, status="ok") == 1
    assert s.value("weighbridge_client_requests_total", **b, status="rejected") == 1
    assert s.value("weighbridge_client_requests_scheduled_total", **a) == 2
    assert s.value("weighbridge_client_prompt_tokens_total", **b) == 40
    assert s.value("weighbridge_client_output_tokens_total", **a) == 50
    assert s.value("weighbridge_client_in_flight_requests", **a) == 1
    assert s.value("weighbridge_client_in_flight_tokens", **a) == 250
    assert s.value("weighbridge_client_in_flight_requests", **b) == 0
    assert s.value("weighbridge_client_in_flight_tokens", **b) == 0

    # Latencies of ok requests only: E2E 2 s (a) and 4 s (b); TTFT a quarter of that.
    assert s.value("weighbridge_client_e2e_seconds_count", **b) == 1
    assert s.value("weighbridge_client_e2e_seconds_sum", **b) == pytest.approx(4.0)
    assert s.value("weighbridge_client_ttft_seconds_sum", **a) == pytest.approx(0.5)
    assert s.value("weighbridge_client_e2e_seconds_bucket", **a, le="2.0") == 1
    assert s.value("weighbridge_client_e2e_seconds_bucket", **a, le="1.5") == 0
    # Decode: 49 tokens over 1.5 s; ITL: 10 gaps of 0.15 s, sum exact.
    assert s.value("weighbridge_client_decode_tokens_per_second_sum", **a) == pytest.approx(
        49 / 1.5)
    assert s.value("weighbridge_client_itl_seconds_count", **a) == 10
    assert s.value("weighbridge_client_itl_seconds_sum", **a) == pytest.approx(1.5)
    assert s.value("weighbridge_client_itl_seconds_bucket", **a, le="0.15") == 10
    assert s.value("weighbridge_client_itl_seconds_bucket", **a, le="0.1") == 0
    assert s.value("weighbridge_client_schedule_lag_seconds_count", **a) == 1
    assert s.value("weighbridge_client_schedule_lag_seconds_count", tenant="newcomer",
                   tier="unknown") == 1

    # Little's Law raw series at t=9: a in system 1..3 and 7..9; b 2..6 and 2.5..2.6.
    assert s.value("weighbridge_client_in_flight_request_seconds_total", **a) == pytest.approx(4)
    assert s.value("weighbridge_client_in_flight_token_seconds_total", **a) == pytest.approx(
        2 * 300 + 2 * 250)
    assert s.value("weighbridge_client_time_in_system_seconds_total", **b) == pytest.approx(4.1)
    assert s.value("weighbridge_client_time_in_system_token_seconds_total",
                   **b) == pytest.approx(4 * 260 + 0.1 * 240)
    # The window covers 0..9 (9 s since the first event at 1 s -> span 8 s).
    span = 8.0
    assert s.value("weighbridge_littles_law_l", tenant="a", level="request") == pytest.approx(
        4 / span)
    assert s.value("weighbridge_littles_law_lambda_w", tenant="a",
                   level="request") == pytest.approx(2 / span)
    assert s.value("weighbridge_littles_law_ratio", tenant="b", level="request") == (
        pytest.approx(1.0))
    assert s.value("weighbridge_littles_law_ratio", tenant="b", level="token") == (
        pytest.approx(1.0))

    # Shares: a served 150 tokens, b 100; both active; a weighs 3, b 1.
    assert s.value("weighbridge_tenant_token_share", tenant="a") == pytest.approx(0.6)
    assert s.value("weighbridge_tenant_entitled_share", tenant="a") == pytest.approx(0.75)
    x = [150 / 3, 100 / 1]
    assert s.value("weighbridge_jain_index") == pytest.approx(sum(x) ** 2 / (2 * (
        x[0] ** 2 + x[1] ** 2)))
    assert s.value("weighbridge_tier_jain_index", tier="batch") == pytest.approx(1.0)

    # Offered: 4 scheduled in 8 s x mean ok size 125; served by the client's view 250 / 8.
    assert s.value("weighbridge_offered_tokens_per_second") == pytest.approx(4 / span * 125)
    assert s.value("weighbridge_served_tokens_per_second", source="client") == pytest.approx(
        250 / span)
    assert s.value("weighbridge_offered_token_load_ratio") == pytest.approx(2.0)


def steady_two_tenants(rng: random.Random, horizon: float, drop_every: int = 0) -> list[Sent]:
    """Poisson arrivals of two tenants; time in system grows with the output length. With
    ``drop_every``, every n-th request's end is never reported."""
    requests: list[Sent] = []
    for tenant, rate in (("a", 6.0), ("b", 3.0)):
        t, n = 0.0, 0
        while (t := t + rng.expovariate(rate)) < horizon:
            n += 1
            prompt, output = rng.randint(20, 400), rng.randint(2, 200)
            end = t + 0.05 + output * 0.004 + rng.random() * 0.2
            if end >= horizon:
                continue
            rec = record(tenant, "standard", t, end, prompt=prompt, output=output,
                         max_tokens=256, n=n)
            requests.append(Sent(rec, prompt + 256,
                                 end_reported=not (drop_every and n % drop_every == 0)))
    return requests


@pytest.mark.parametrize("drop_every", [0, 5])
def test_littles_law_through_the_exporter(drop_every: int) -> None:
    """A steady two-tenant run closes at both levels; losing every 5th request does not."""
    clock = FakeClock()
    exporter = LoadgenExporter(window_s=60.0, clock=clock)
    horizon = 200.0
    run_requests(exporter, clock, steady_two_tenants(random.Random(5), horizon, drop_every))
    clock.now = RUN_START + horizon
    s = scrape(exporter)
    for tenant in ("a", "b"):
        for level in ("request", "token"):
            ratio = s.value("weighbridge_littles_law_ratio", tenant=tenant, level=level)
            if drop_every:
                assert ratio > 1.5, (tenant, level, ratio)
            else:
                assert 0.95 <= ratio <= 1.05, (tenant, level, ratio)


def test_programs_end_with_the_record_that_ends_them() -> None:
    """Program a-p0 starts at 0 and its last planned call ends ok at 10 (its subagent's
    failure ends nothing); a-p1 starts at 2 and fails at 3; a-p2 starts at 4 and is in
    progress at the scrape, at 12."""
    clock = FakeClock()
    exporter = LoadgenExporter(tiers={"a": "standard"}, window_s=60.0, clock=clock)
    a = {"tenant": "a", "tier": "standard"}

    def call(program: str, turn: int, calls: int, end: float, *, parent: str | None = None,
             status: str = "ok") -> RequestRecord:
        return dataclasses.replace(record("a", "standard", end - 1, end, status=status),
                                   program_id=program, parent_program_id=parent,
                                   program_calls=calls, turn=turn)

    events = [
        (0.0, lambda: exporter.program_started("a", "standard", "a-p0", clock.now)),
        (1.0, lambda: exporter.request_ended(call("a-p0", 0, 2, 1.0), clock.now)),
        (2.0, lambda: exporter.program_started("a", "standard", "a-p1", clock.now)),
        (3.0, lambda: exporter.request_ended(call("a-p1", 0, 3, 3.0, status="rejected"),
                                             clock.now)),
        (4.0, lambda: exporter.program_started("a", "standard", "a-p2", clock.now)),
        (5.0, lambda: exporter.request_ended(call("a-p0-c0.0", 0, 1, 5.0, parent="a-p0",
                                                  status="error"), clock.now)),
        (10.0, lambda: exporter.request_ended(call("a-p0", 1, 2, 10.0), clock.now)),
    ]
    for at, event in events:
        clock.now = RUN_START + at
        event()
    clock.now = RUN_START + 12.0
    s = scrape(exporter)
    assert s.value("weighbridge_client_programs_started_total", **a) == 3
    assert s.value("weighbridge_client_programs_total", **a, outcome="completed") == 1
    assert s.value("weighbridge_client_programs_total", **a, outcome="failed") == 1
    assert s.value("weighbridge_client_program_seconds_count", **a) == 1
    assert s.value("weighbridge_client_program_seconds_sum", **a) == pytest.approx(10.0)
    assert s.value("weighbridge_client_program_seconds_bucket", **a, le="10.0") == 1
    assert s.value("weighbridge_client_program_seconds_bucket", **a, le="5.0") == 0
    assert s.value("weighbridge_client_programs_in_progress", **a) == 1
    # In the system 0..10, 2..3 and 4..12; ended: 10 s and 1 s.
    assert s.value("weighbridge_client_program_in_progress_seconds_total",
                   **a) == pytest.approx(19.0)
    assert s.value("weighbridge_client_program_time_in_system_seconds_total",
                   **a) == pytest.approx(11.0)
    span = 12.0
    assert s.value("weighbridge_littles_law_l", tenant="a", level="program") == (
        pytest.approx(19 / span))
    assert s.value("weighbridge_littles_law_lambda_w", tenant="a", level="program") == (
        pytest.approx(11 / span))


def test_docs_list_exactly_the_exported_series() -> None:
    """docs/metrics.md's load generator section has a row per exported family, with its
    type and labels."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "docs" / "metrics.md").read_text()
    section = re.search(r"^## Load generator.*?$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, "docs/metrics.md has no load generator section"
    doc = section.group(1)
    rows: dict[str, tuple[str, set[str]]] = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0].startswith("`weighbridge_") and cells[1] in (
                "counter", "gauge", "histogram"):
            name = cells[0].strip("`").removesuffix("_total")
            labels = {x.strip() for x in cells[2].split(",") if x.strip() not in ("", "\u2013")}
            rows[name] = (cells[1], labels)
    assert rows == {name: (kind, labels) for name, (kind, labels)
                    in DOCUMENTED_FAMILIES.items()}


def test_unscraped_exporter_keeps_about_one_window_of_events() -> None:
    """Without scrapes the windows still forget old events (a run before Prometheus is up)."""
    clock = FakeClock()
    exporter = LoadgenExporter(window_s=10.0, clock=clock)
    requests = [Sent(record("a", "standard", i * 0.1, i * 0.1 + 0.05, n=i), 300)
                for i in range(5000)]  # 500 s at 10/s
    run_requests(exporter, clock, requests)
    # White-box: the event heaps hold at most 1.25 windows (expiry every quarter window).
    state = exporter._littles._keys[("a", "standard")]
    assert len(state.pending) <= 2 * 125 * 1.25
    assert len(state.completions) <= 125 * 1.25
    assert len(exporter._shares._ended) <= 125 * 1.25
    s = scrape(exporter)
    assert s.value("weighbridge_client_requests_total", tenant="a", tier="standard",
                   status="ok") == 5000
    assert s.value("weighbridge_littles_law_ratio", tenant="a", level="request") == (
        pytest.approx(1.0, abs=0.01))
