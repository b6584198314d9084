"""The load generator's Prometheus exporter: what each tenant experiences, and the checks
(Little's Law, token share and Jain's index, offered load against served throughput) computed
live from the same events.

The generator tells the exporter three things, all on the exporter's clock (``clock``,
``time.monotonic`` by default):

* ``request_started(tenant, tier, tokens, now)`` with ``now`` the request's **scheduled**
  send time (the instant its record's ``scheduled_s`` denotes) and ``tokens`` its declared
  size, prompt tokens + max_tokens. Reporting the scheduled time, not the actual send,
  keeps the Little's Law occupancy on the same timeline as the records' times in system
  (which start at the scheduled time: no coordinated omission), and lets the exporter match
  the end to this start exactly;
* ``request_ended(record, now)`` once per request, with ``now`` the time it ended;
* ``schedule_lag(tenant, lag_s)`` each time a send happened later than scheduled;
* ``program_started(tenant, tier, program_id, now)`` when the first call of an agent
  program nobody forked is due (weighbridge.loadgen.programs): the program then ends with
  the record whose ``program_end`` says so, and its completion time runs from that start
  to that end (what the person who started it waited).

Every metric is computed at scrape time from one consistent snapshot under a lock, so the
exporter works from plain threads, asyncio callbacks and gevent greenlets alike (Locust
monkey-patches ``threading``; the HTTP server's threads then run as greenlets).
docs/metrics.md ("Load generator") lists the series.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from weighbridge.exporters.histogram import WeightedHistogram
from weighbridge.exporters.inflight import InFlightSet
from weighbridge.exporters.littles_law import LittlesLawReading, LittlesLawWindow
from weighbridge.exporters.share import TokenShareWindow
from weighbridge.exporters.stability import StabilityWindow
from weighbridge.records import PROGRAM_ENDS, STATUSES, RequestRecord
from weighbridge.vllm_metrics import ScrapeError, parse_vllm_metrics

__all__ = [
    "DECODE_TPS_BUCKETS",
    "ITL_BUCKETS",
    "LATENCY_BUCKETS",
    "PROGRAM_BUCKETS",
    "SCHEDULE_LAG_BUCKETS",
    "UNKNOWN_TIER",
    "LoadgenExporter",
]

# A cached prompt's TTFT is a few milliseconds; a flood's backlog pushes E2E to a minute.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                   0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0)
# Decode steps: ~1 ms for a tiny model on a GPU to seconds under heavy preemption.
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
# Around the sidecar's per-sequence decode floor (7 tok/s) and up to a fast GPU's speed.
DECODE_TPS_BUCKETS = (1.0, 2.0, 5.0, 7.0, 10.0, 15.0, 20.0, 30.0, 50.0, 75.0, 100.0, 150.0,
                      200.0, 300.0, 500.0, 1000.0)
# An agent program: a few seconds of calls and tool runs to half an hour of them.
PROGRAM_BUCKETS = (1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0,
                   300.0, 450.0, 600.0, 900.0, 1200.0, 1800.0)
# A healthy generator sends within a millisecond of schedule; seconds mean it is overloaded.
SCHEDULE_LAG_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                        0.5, 1.0, 2.5, 5.0, 10.0)
UNKNOWN_TIER = "unknown"  # schedule lag of a tenant whose tier was never seen


class LoadgenExporter:
    def __init__(self, *, weights: Mapping[str, float] | None = None,
                 tiers: Mapping[str, str] | None = None, window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic,
                 registry: CollectorRegistry | None = None,
                 backend_metrics_url: str | None = None,
                 scrape_interval_s: float = 2.0) -> None:
        if not scrape_interval_s > 0:
            raise ValueError(f"scrape_interval_s: must be positive, got {scrape_interval_s}")
        self.clock = clock
        self.window_s = window_s
        self.registry = registry if registry is not None else CollectorRegistry()
        self.backend_metrics_url = backend_metrics_url
        self.scrape_interval_s = scrape_interval_s
        self.weights: dict[str, float] = dict(weights or {})
        self._tier_of: dict[str, str] = dict(tiers or {})

        self._lock = threading.Lock()
        self._littles = LittlesLawWindow(window_s)
        # Programs in the system, from their start to their end: Little's Law of programs.
        self._program_littles = LittlesLawWindow(window_s)
        self._program_starts: dict[str, float] = {}  # programs in progress -> their start
        self._shares = TokenShareWindow(window_s, self.weights)
        self._stability = StabilityWindow(window_s, stale_after_s=max(3 * scrape_interval_s,
                                                                      5.0))
        self._in_flight = InFlightSet()
        self._keys: set[tuple[str, str]] = set()  # (tenant, tier) seen or configured
        self._scrape_errors = 0
        self._expired_at = -math.inf
        self._server: Any = None
        self._stop = threading.Event()
        self._scraper: threading.Thread | None = None

        labels = ["tenant", "tier"]
        r = self.registry
        self._ttft = Histogram("weighbridge_client_ttft_seconds",
                               "Time to first token from the scheduled send time, requests "
                               "that completed ok.", labels, registry=r, buckets=LATENCY_BUCKETS)
        self._e2e = Histogram("weighbridge_client_e2e_seconds",
                              "End-to-end latency from the scheduled send time, requests that "
                              "completed ok.", labels, registry=r, buckets=LATENCY_BUCKETS)
        self._decode = Histogram("weighbridge_client_decode_tokens_per_second",
                                 "Per-sequence decode speed: output tokens after the first over "
                                 "the time they took.", labels, registry=r,
                                 buckets=DECODE_TPS_BUCKETS)
        self._lag = Histogram("weighbridge_client_schedule_lag_seconds",
                              "How late the generator sent requests against their schedule.",
                              labels, registry=r, buckets=SCHEDULE_LAG_BUCKETS)
        self._requests = Counter("weighbridge_client_requests",
                                 "Requests that ended, by final status.", [*labels, "status"],
                                 registry=r)
        self._scheduled = Counter("weighbridge_client_requests_scheduled",
                                  "Requests that reached their scheduled send time.", labels,
                                  registry=r)
        self._prompt_tokens = Counter("weighbridge_client_prompt_tokens",
                                      "Prompt tokens of ended requests, from the server's usage.",
                                      labels, registry=r)
        # Of the requests whose server reported usage.prompt_tokens_details.cached_tokens.
        self._cached_prompt_tokens = Counter(
            "weighbridge_client_cached_prompt_tokens",
            "Prompt tokens the server's prefix cache supplied, of ended requests that "
            "reported them (usage.prompt_tokens_details.cached_tokens).", labels, registry=r)
        self._computed_prompt_tokens = Counter(
            "weighbridge_client_computed_prompt_tokens",
            "Prompt tokens the server computed (prompt less cached), of ended requests that "
            "reported cached tokens.", labels, registry=r)
        self._output_tokens = Counter("weighbridge_client_output_tokens",
                                      "Output tokens of ended requests, from the server's usage.",
                                      labels, registry=r)
        self._program = Histogram("weighbridge_client_program_seconds",
                                  "Completion time of agent programs that completed: from "
                                  "their first call's scheduled send to their last call's "
                                  "end.", labels, registry=r, buckets=PROGRAM_BUCKETS)
        self._programs = Counter("weighbridge_client_programs",
                                 "Agent programs that ended, by outcome (completed, failed).",
                                 [*labels, "outcome"], registry=r)
        self._programs_started = Counter("weighbridge_client_programs_started",
                                         "Agent programs whose first call came due.", labels,
                                         registry=r)
        self._itl = WeightedHistogram(
            "weighbridge_client_itl_seconds",
            "Inter-token (inter-chunk) latency of requests that completed ok: each request adds "
            "chunks-1 gaps at its mean gap.", labels, ITL_BUCKETS)
        r.register(_WindowCollector(self))

        for tenant, tier in self._tier_of.items():
            self._touch(tenant, tier)
        # A weighted tenant without a tier gets its share series now, the per-tier ones with
        # its first request.
        self._weighted_only = set(self.weights) - set(self._tier_of)

    # ------------------------------------------------------------------ events

    def request_started(self, tenant: str, tier: str, tokens: int, now: float) -> None:
        """A request reached its scheduled send time ``now`` declaring ``tokens`` (prompt +
        max_tokens)."""
        if tokens < 0:
            raise ValueError(f"tokens: must be >= 0, got {tokens}")
        with self._lock:
            self._touch(tenant, tier)
            self._tier_of[tenant] = tier
            self._in_flight.add((tenant, tier), now, tokens)
            self._littles.entered((tenant, tier), tokens, now)
            self._stability.scheduled(tokens, now)
        self._scheduled.labels(tenant, tier).inc()

    def request_ended(self, record: RequestRecord, now: float) -> None:
        """The request of ``record`` ended at ``now`` (any status; call exactly once)."""
        tenant, tier = record.tenant, record.tier
        prompt, output = record.prompt_tokens or 0, record.output_tokens or 0
        e2e = max(record.e2e_s, 0.0)
        with self._lock:
            self._touch(tenant, tier)
            key = (tenant, tier)
            entry = self._in_flight.pop_nearest(key, now - e2e)
            if entry is not None:
                declared = entry.tokens
                self._littles.left(key, declared, now)
            else:
                # Its start was never reported: count the completion only, so the check
                # shows it; weigh it as the generator would have declared it.
                declared = (record.prompt_tokens or 0) + (
                    record.max_tokens if record.max_tokens is not None else output)
            self._littles.completed(key, e2e, declared, now)
            self._shares.ended(tenant, prompt + output, now)
            self._stability.ended(prompt + output, record.status == "ok", now)
            if record.status == "ok" and record.chunks > 1 and record.first_token_s is not None \
                    and record.last_token_s is not None:
                gaps = record.chunks - 1
                mean_gap = max(record.last_token_s - record.first_token_s, 0.0) / gaps
                self._itl.observe(key, mean_gap, gaps)
            if record.program_end is not None:
                self._program_ended(record, now)
            self._expire_unread()
        self._requests.labels(tenant, tier, record.status).inc()
        self._prompt_tokens.labels(tenant, tier).inc(prompt)
        self._output_tokens.labels(tenant, tier).inc(output)
        if (computed := record.computed_prompt_tokens) is not None:
            self._computed_prompt_tokens.labels(tenant, tier).inc(max(computed, 0))
            self._cached_prompt_tokens.labels(tenant, tier).inc(record.cached_tokens or 0)
        if record.status == "ok":
            self._e2e.labels(tenant, tier).observe(e2e)
            if record.ttft_s is not None:
                self._ttft.labels(tenant, tier).observe(max(record.ttft_s, 0.0))
            if record.decode_tps is not None:
                self._decode.labels(tenant, tier).observe(record.decode_tps)

    def program_started(self, tenant: str, tier: str, program_id: str, now: float) -> None:
        """The first call of agent program ``program_id`` (one nobody forked) came due at
        ``now``."""
        with self._lock:
            self._touch(tenant, tier)
            self._tier_of[tenant] = tier
            self._program_starts[program_id] = now
            self._program_littles.entered((tenant, tier), 0, now)
        self._programs_started.labels(tenant, tier).inc()

    def _program_ended(self, record: RequestRecord, now: float) -> None:
        """``record`` ended its program (``record.program_end``); called under the lock."""
        outcome = record.program_end
        assert outcome is not None and record.program_id is not None
        start = self._program_starts.pop(record.program_id, None)
        key = (record.tenant, record.tier)
        if start is not None:
            self._program_littles.left(key, 0, now)
            self._program_littles.completed(key, max(now - start, 0.0), 0, now)
        self._programs.labels(record.tenant, record.tier, outcome).inc()
        if outcome == "completed" and start is not None:
            self._program.labels(record.tenant, record.tier).observe(max(now - start, 0.0))

    def _expire_unread(self) -> None:
        # Scrapes expire old events; without scrapes (no Prometheus yet) the windows would
        # grow for the whole run, so expire every quarter window.
        now = self.clock()
        if now - self._expired_at >= self.window_s / 4:
            self._expired_at = now
            self._littles.expire(now)
            self._program_littles.expire(now)
            self._shares.expire(now)
            self._stability.expire(now)

    def schedule_lag(self, tenant: str, lag_s: float) -> None:
        with self._lock:
            tier = self._tier_of.get(tenant, UNKNOWN_TIER)
        self._lag.labels(tenant, tier).observe(max(lag_s, 0.0))

    # ------------------------------------------------------------------ backend scrapes

    def scrape_backend(self) -> bool:
        """Read the backend's token counters once; False (and an error counted) on failure."""
        if self.backend_metrics_url is None:
            raise ValueError("backend_metrics_url: not configured")
        try:
            response = httpx.get(self.backend_metrics_url, timeout=self.scrape_interval_s)
            response.raise_for_status()
            sample = parse_vllm_metrics(response.text, self.clock())
        except (httpx.HTTPError, ScrapeError):
            with self._lock:
                self._scrape_errors += 1
            return False
        with self._lock:
            self._stability.backend_sample(  # a parsed scrape always has the counter
                sample.prompt_tokens_total + (sample.generation_tokens_total or 0.0),
                sample.at_s)
        return True

    def _scrape_loop(self) -> None:
        while not self._stop.is_set():
            self.scrape_backend()
            self._stop.wait(self.scrape_interval_s)

    # ------------------------------------------------------------------ serving

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        """Serve ``/metrics`` on ``addr:port`` from a daemon thread; with
        ``backend_metrics_url``, also start scraping it every ``scrape_interval_s``."""
        if self._server is not None:
            raise RuntimeError("serve: already serving")
        self._server, _ = start_http_server(port, addr, registry=self.registry)
        if self.backend_metrics_url is not None:
            self._stop.clear()
            self._scraper = threading.Thread(target=self._scrape_loop, daemon=True,
                                             name="weighbridge-backend-scrape")
            self._scraper.start()

    def close(self) -> None:
        """Stop serving and scraping (idempotent)."""
        self._stop.set()
        if self._scraper is not None:
            self._scraper.join(timeout=self.scrape_interval_s + 1)
            self._scraper = None
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # ------------------------------------------------------------------ internals

    def _touch(self, tenant: str, tier: str) -> None:
        """Create a tenant's series at zero the first time it is seen, so every documented
        series exists from the first scrape (absent series break rate() and dashboards)."""
        key = (tenant, tier)
        if key in self._keys:
            return
        self._keys.add(key)
        for metric in (self._ttft, self._e2e, self._decode, self._lag, self._scheduled,
                       self._prompt_tokens, self._output_tokens, self._cached_prompt_tokens,
                       self._computed_prompt_tokens, self._program, self._programs_started):
            metric.labels(tenant, tier)
        for status in sorted(STATUSES):
            self._requests.labels(tenant, tier, status)
        for outcome in PROGRAM_ENDS:
            self._programs.labels(tenant, tier, outcome)
        self._itl.touch(key)

    def _collect(self) -> list[Metric]:
        with self._lock:
            return list(self._families(self.clock()))

    def _families(self, now: float) -> Iterator[Metric]:
        labels = ["tenant", "tier"]
        keys = sorted(self._keys)
        in_flight_n = GaugeMetricFamily("weighbridge_client_in_flight_requests",
                                        "Requests past their scheduled send time and not "
                                        "yet ended.", labels=labels)
        in_flight_tok = GaugeMetricFamily("weighbridge_client_in_flight_tokens",
                                          "Declared tokens (prompt + max_tokens) of the "
                                          "requests in flight.", labels=labels)
        occ_n = CounterMetricFamily("weighbridge_client_in_flight_request_seconds",
                                    "Integral of in-flight requests over time; its rate() "
                                    "is L at the request level.", labels=labels)
        occ_tok = CounterMetricFamily("weighbridge_client_in_flight_token_seconds",
                                      "Integral of in-flight declared tokens over time; its "
                                      "rate() is L at the token level.", labels=labels)
        tis = CounterMetricFamily("weighbridge_client_time_in_system_seconds",
                                  "Time in system (scheduled send to end) of ended "
                                  "requests; its rate() is lambda*W.", labels=labels)
        tis_tok = CounterMetricFamily("weighbridge_client_time_in_system_token_seconds",
                                      "Declared tokens x time in system of ended requests; "
                                      "its rate() is lambda*W at the token level.",
                                      labels=labels)
        programs = GaugeMetricFamily("weighbridge_client_programs_in_progress",
                                     "Agent programs started and not yet ended.",
                                     labels=labels)
        occ_prog = CounterMetricFamily("weighbridge_client_program_in_progress_seconds",
                                       "Integral of the agent programs in progress over time; "
                                       "its rate() is L of programs.", labels=labels)
        tis_prog = CounterMetricFamily("weighbridge_client_program_time_in_system_seconds",
                                       "Time in system (start to end) of ended agent "
                                       "programs; its rate() is lambda*W of programs.",
                                       labels=labels)
        for tenant, tier in keys:
            n, tok = self._littles.in_flight((tenant, tier))
            totals = self._littles.totals((tenant, tier), now)
            values = [tenant, tier]
            in_flight_n.add_metric(values, n)
            in_flight_tok.add_metric(values, tok)
            occ_n.add_metric(values, totals.occupancy_request_seconds)
            occ_tok.add_metric(values, totals.occupancy_token_seconds)
            tis.add_metric(values, totals.time_in_system_seconds)
            tis_tok.add_metric(values, totals.time_in_system_token_seconds)
            started, _ = self._program_littles.in_flight((tenant, tier))
            program_totals = self._program_littles.totals((tenant, tier), now)
            programs.add_metric(values, started)
            occ_prog.add_metric(values, program_totals.occupancy_request_seconds)
            tis_prog.add_metric(values, program_totals.time_in_system_seconds)
        yield from (in_flight_n, in_flight_tok, occ_n, occ_tok, tis, tis_tok, programs,
                    occ_prog, tis_prog)
        yield self._itl.family()

        tenants = sorted({t for t, _ in keys} | self._weighted_only)
        yield from self._littles_families(tenants, keys, now)
        yield from self._share_families(tenants, keys, now)
        yield from self._stability_families(now)

    def _littles_families(self, tenants: list[str], keys: list[tuple[str, str]],
                          now: float) -> Iterator[Metric]:
        level = ["tenant", "level"]
        l_fam = GaugeMetricFamily("weighbridge_littles_law_l",
                                  "Time-average number in system over the window (requests, "
                                  "declared tokens, or agent programs).", labels=level)
        lw_fam = GaugeMetricFamily("weighbridge_littles_law_lambda_w",
                                   "Completion rate x mean time in system over the window.",
                                   labels=level)
        ratio_fam = GaugeMetricFamily("weighbridge_littles_law_ratio",
                                      "L / (lambda*W) over the window: 1 when every request "
                                      "that entered is accounted for.", labels=level)
        for tenant in tenants:
            own = [k for k in keys if k[0] == tenant]
            readings: list[tuple[str, LittlesLawReading]] = [
                *self._littles.reading(own, now).items(),
                # A program weighs 1, as a request does at the request level.
                ("program", self._program_littles.reading(own, now)["request"])]
            for lvl, reading in readings:
                l_fam.add_metric([tenant, lvl], reading.l)
                lw_fam.add_metric([tenant, lvl], reading.lambda_w)
                ratio_fam.add_metric([tenant, lvl], reading.ratio)
        yield from (l_fam, lw_fam, ratio_fam)

    def _share_families(self, tenants: list[str], keys: list[tuple[str, str]],
                        now: float) -> Iterator[Metric]:
        flying = {t for t, tier in keys if self._in_flight.count((t, tier)) > 0}
        reading = self._shares.reading(now, flying)
        share = GaugeMetricFamily("weighbridge_tenant_token_share",
                                  "Tenant's share of the tokens served in the window.",
                                  labels=["tenant"])
        entitled = GaugeMetricFamily("weighbridge_tenant_entitled_share",
                                     "Tenant's weight over the active tenants' weights.",
                                     labels=["tenant"])
        weight = GaugeMetricFamily("weighbridge_tenant_weight",
                                   "Tenant's configured weight (1 when not configured).",
                                   labels=["tenant"])
        for tenant in tenants:
            share.add_metric([tenant], reading.share.get(tenant, 0.0))
            entitled.add_metric([tenant], reading.entitled.get(tenant, 0.0))
            weight.add_metric([tenant], self.weights.get(tenant, 1.0))
        jain = GaugeMetricFamily("weighbridge_jain_index",
                                 "Jain's index of weight-normalised served tokens over the "
                                 "active tenants (NaN when nothing was served).")
        jain.add_metric([], _or_nan(reading.jain))
        tier_jain = GaugeMetricFamily("weighbridge_tier_jain_index",
                                      "Jain's index over the active tenants of one tier.",
                                      labels=["tier"])
        for tier in sorted({tier for _, tier in keys}):
            members = {t for t, k_tier in keys if k_tier == tier}
            tier_jain.add_metric([tier], _or_nan(reading.jain_among(members, self.weights)))
        yield from (share, entitled, weight, jain, tier_jain)

    def _stability_families(self, now: float) -> Iterator[Metric]:
        reading = self._stability.reading(now)
        offered = GaugeMetricFamily("weighbridge_offered_tokens_per_second",
                                    "Offered token load: requests scheduled per second x mean "
                                    "served tokens per ok request, over the window.")
        offered.add_metric([], reading.offered_tokens_per_s)
        served = GaugeMetricFamily("weighbridge_served_tokens_per_second",
                                   "Token throughput over the window: the backend's prompt + "
                                   "generation token rate, else tokens the generator saw served.",
                                   labels=["source"])
        served.add_metric([reading.source], reading.served_tokens_per_s)
        ratio = GaugeMetricFamily("weighbridge_offered_token_load_ratio",
                                  "Offered over served tokens per second; held above 1 the "
                                  "backlog grows.")
        ratio.add_metric([], reading.ratio)
        errors = CounterMetricFamily("weighbridge_client_backend_scrape_errors",
                                     "Failed reads of the backend's /metrics.")
        errors.add_metric([], self._scrape_errors)
        yield from (offered, served, ratio, errors)


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value


class _WindowCollector(Collector):
    """Computes the windowed series at scrape time."""

    def __init__(self, exporter: LoadgenExporter) -> None:
        self._exporter = exporter

    def describe(self) -> list[Metric]:
        return []  # collected on demand

    def collect(self) -> list[Metric]:
        return self._exporter._collect()
