"""The sidecar's ``/metrics``: its ledger, queues, deficits and backend view, read at scrape
time from the scheduling core (so every scrape is one consistent snapshot in which
arrivals = completed + rejected + cancelled + failed + in flight), plus the latency
histograms observed as requests pass."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sidecar.backends import BackendPool
from sidecar.core import SchedulingCore

# From a few milliseconds (queue-free TTFT) to a minute (a flood's backlog).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 7.5,
                   10.0, 15.0, 30.0, 60.0)
UNAUTHENTICATED = "unauthenticated"


def _tenant_label(tenant: str) -> str:
    return tenant or UNAUTHENTICATED


class CoreCollector(Collector):
    def __init__(self, core: SchedulingCore, pool: BackendPool | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.core = core
        self.pool = pool
        self.clock = clock

    def describe(self) -> list[Metric]:
        return []  # collected on demand; names are fixed in collect()

    def collect(self) -> Iterator[Metric]:
        core, now = self.core, self.clock()
        labels = ["tenant", "tier"]
        arrived = CounterMetricFamily("weighbridge_requests_arrived",
                                      "Requests that reached the sidecar.", labels=labels)
        completed = CounterMetricFamily("weighbridge_requests_completed",
                                        "Requests served to the end.", labels=labels)
        rejected = CounterMetricFamily("weighbridge_requests_rejected",
                                       "Requests turned away, by reason.",
                                       labels=[*labels, "reason"])
        cancelled = CounterMetricFamily("weighbridge_requests_cancelled",
                                        "Requests whose client went away.", labels=labels)
        failed = CounterMetricFamily("weighbridge_requests_failed",
                                     "Requests a backend failed.", labels=labels)
        queued = GaugeMetricFamily("weighbridge_requests_queued",
                                   "Requests waiting in the sidecar's queues.", labels=labels)
        dispatched = GaugeMetricFamily("weighbridge_requests_dispatched",
                                       "Requests in flight at a backend.", labels=labels)
        for (tenant, tier), tally in core.ledger.tallies().items():
            values = [_tenant_label(tenant), tier]
            arrived.add_metric(values, tally.arrivals)
            completed.add_metric(values, tally.completed)
            cancelled.add_metric(values, tally.cancelled)
            failed.add_metric(values, tally.failed)
            queued.add_metric(values, tally.queued)
            dispatched.add_metric(values, tally.dispatched)
            for reason, count in tally.rejected.items():
                rejected.add_metric([*values, reason], count)
        yield from (arrived, completed, rejected, cancelled, failed, queued, dispatched)

        queued_tokens = GaugeMetricFamily("weighbridge_queued_tokens",
                                          "Estimated tokens waiting in a tenant's queues.",
                                          labels=["tenant"])
        deficit = GaugeMetricFamily("weighbridge_drr_deficit_quanta",
                                    "A tenant's deficit round robin credit in a tier, in "
                                    "quanta (negative: debt).", labels=labels)
        scheduler = core.scheduler
        for tenant, spec in core.config.tenants.items():
            queued_tokens.add_metric([tenant], scheduler.tenant_queued(tenant)[1])
            deficit.add_metric([tenant, spec.tier], scheduler.deficit(spec.tier, tenant))
        yield queued_tokens
        yield deficit

        holds = CounterMetricFamily("weighbridge_admission_holds",
                                    "Dispatch attempts held by admission control, by reason.",
                                    labels=["backend", "reason"])
        for (backend, reason), count in core.holds.items():
            holds.add_metric([backend or "none", reason], count)
        yield holds

        throughput = GaugeMetricFamily("weighbridge_served_tokens_per_second",
                                       "Measured token throughput feeding the wait predictor.")
        throughput.add_metric([], core.meter.tokens_per_s or 0.0)
        yield throughput

        b = ["backend"]
        healthy = GaugeMetricFamily("weighbridge_backend_healthy",
                                    "1 when the backend is routed to.", labels=b)
        inflight = GaugeMetricFamily("weighbridge_backend_inflight_requests",
                                     "Requests the sidecar has in flight there.", labels=b)
        outstanding = GaugeMetricFamily("weighbridge_backend_outstanding_tokens",
                                        "Prompt plus expected remaining output in flight.",
                                        labels=b)
        cap = GaugeMetricFamily("weighbridge_backend_inflight_cap",
                                "The admission cap in force.", labels=b)
        waiting = GaugeMetricFamily("weighbridge_backend_waiting_requests",
                                    "vllm:num_requests_waiting at the last scrape.", labels=b)
        running = GaugeMetricFamily("weighbridge_backend_running_requests",
                                    "vllm:num_requests_running at the last scrape.", labels=b)
        kv = GaugeMetricFamily("weighbridge_backend_kv_cache_usage_ratio",
                               "vllm:kv_cache_usage_perc at the last scrape (0-1).", labels=b)
        speed = GaugeMetricFamily("weighbridge_backend_decode_tokens_per_second_per_sequence",
                                  "Generation tokens/s over running sequences, between scrapes.",
                                  labels=b)
        age = GaugeMetricFamily("weighbridge_backend_metrics_age_seconds",
                                "Age of the last successful scrape.", labels=b)
        for name, gate in core.gates.items():
            healthy.add_metric([name], 1.0 if core.router.is_healthy(name) else 0.0)
            inflight.add_metric([name], gate.inflight)
            outstanding.add_metric([name], core.router.outstanding_tokens(name))
            cap.add_metric([name], gate.cap(now))
            per_seq = gate.decode_tokens_per_s_per_seq
            if per_seq is not None:
                speed.add_metric([name], per_seq)
            sample = self.pool.states[name].last_sample if self.pool else None
            if sample is not None:
                waiting.add_metric([name], sample.waiting)
                running.add_metric([name], sample.running)
                kv.add_metric([name], sample.kv_cache_usage)
                age.add_metric([name], now - sample.at_s)
        yield from (healthy, inflight, outstanding, cap, waiting, running, kv, speed, age)


class SidecarMetrics:
    def __init__(self, core: SchedulingCore, pool: BackendPool | None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(CoreCollector(core, pool))
        r = self.registry
        self.queue_wait = Histogram("weighbridge_queue_wait_seconds",
                                    "Time from arrival to dispatch.", ["tier"],
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("weighbridge_time_to_first_token_seconds",
                              "Arrival at the sidecar to the first content chunk relayed.",
                              ["tenant", "tier"], buckets=LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("weighbridge_tokens_served",
                              "Tokens served: the usage of completed requests, and what "
                              "cut-off streams delivered.",
                              ["tenant", "tier", "kind"], registry=r)
