"""The sidecar's ``/metrics``: its ledger, queues, deficits, backend view and stability check,
read at scrape time from the scheduling core (so every scrape is one consistent snapshot in
which arrivals = completed + rejected + cancelled + failed + in flight), plus the histograms
and token counters observed as requests pass. docs/metrics.md lists every series."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from weighbridge.sidecar.backends import BackendPool
from weighbridge.sidecar.core import CoreStats, SchedulingCore
from weighbridge.sidecar.ledger import Tally
from weighbridge.sidecar.stability import (
    StabilityMeter,
    current_pools,
)

# From a few milliseconds (queue-free TTFT) to a minute (a flood's backlog).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 7.5,
                   10.0, 15.0, 30.0, 60.0)
UNAUTHENTICATED = "unauthenticated"


def _tenant_label(tenant: str) -> str:
    return tenant or UNAUTHENTICATED


class CoreCollector(Collector):
    def __init__(self, core: SchedulingCore, pool: BackendPool | None,
                 stability: StabilityMeter, in_system: TimeInSystem,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.core = core
        self.pool = pool
        self.stability = stability
        self.in_system = in_system
        self.clock = clock

    def describe(self) -> list[Metric]:
        return []  # collected on demand; names are fixed in collect()

    def collect(self) -> Iterator[Metric]:
        core, now = self.core, self.clock()
        stats = core.stats(now)
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
        tallies = stats.tallies
        # Every configured tenant's series exists from the first scrape, at 0: rate() over
        # a series that appears with a value loses everything counted before its first
        # sample (the Prometheus convention: initialise the label sets you know).
        for t in stats.tenants:
            if (t.tenant, t.tier) not in tallies:
                values = [t.tenant, t.tier]
                for family in (arrived, completed, cancelled, failed, queued, dispatched):
                    family.add_metric(values, 0)
        for (tenant, tier), tally in tallies.items():
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
        yield from self._models(stats)
        seconds = CounterMetricFamily("weighbridge_requests_in_system_seconds",
                                      "Request-seconds spent queued or in flight (its rate "
                                      "is the average number in the sidecar).", labels=labels)
        totals = self.in_system.totals(now)
        for t in stats.tenants:
            totals.setdefault((t.tenant, t.tier), 0.0)
        for (tenant, tier), total in totals.items():
            seconds.add_metric([tenant, tier], total)
        yield seconds

        queued_tokens = GaugeMetricFamily("weighbridge_queued_tokens",
                                          "Tokens the engine is expected to compute "
                                          "(uncached prompt + expected output) waiting in "
                                          "a tenant's queues.",
                                          labels=["tenant"])
        deficit = GaugeMetricFamily("weighbridge_drr_deficit_quanta",
                                    "A tenant's deficit round robin credit in a tier, in "
                                    "quanta (negative: debt).", labels=labels)
        forfeited = CounterMetricFamily(
            "weighbridge_drr_quanta_forfeited",
            "Quanta a tenant did not receive for rounds in which admission passed it over "
            "(prefill pacing, decode floor, headroom, KV reserve) while others were served.",
            labels=labels)
        weight = GaugeMetricFamily("weighbridge_drr_weight",
                                   "A tenant's configured weight in its tier (its DRR share).",
                                   labels=labels)
        for t in stats.tenants:
            queued_tokens.add_metric([t.tenant], t.queued_tokens)
            deficit.add_metric([t.tenant, t.tier], t.deficit_quanta)
            forfeited.add_metric([t.tenant, t.tier], t.forfeited_quanta)
            weight.add_metric([t.tenant, t.tier], t.weight)
        yield from (queued_tokens, deficit, forfeited, weight)

        holds = CounterMetricFamily("weighbridge_admission_holds",
                                    "Dispatch attempts held by admission control, by reason.",
                                    labels=["backend", "reason"])
        for (backend, reason), count in stats.holds.items():
            holds.add_metric([backend or "none", reason], count)
        yield holds

        throughput = GaugeMetricFamily("weighbridge_predictor_tokens_per_second",
                                       "Measured computed-token throughput (uncached "
                                       "prompt + output) feeding the wait predictor.")
        throughput.add_metric([], stats.tokens_per_s or 0.0)
        yield throughput
        yield from self._stability(now, stats)

        yield from self._backends(now, stats)
        yield from self._prefix_cache(stats)

    @staticmethod
    def _prefix_cache(stats: CoreStats) -> Iterator[Metric]:
        """The prefix index's predictions against what the engines reported, its size, and
        the route's affinity choices; every tenant and backend of the config from 0."""
        tenants = [t.tenant for t in stats.tenants]
        backends = [b.backend for b in stats.backends]
        sources = (("predicted", stats.cached_predicted), ("reported", stats.cached_reported))
        by_tenant = CounterMetricFamily(
            "weighbridge_prefix_cached_tokens",
            "Prompt tokens found in a prefix cache, as the sidecar predicted at dispatch and as "
            "the engine reported (requests with both).", labels=["tenant", "source"])
        by_backend = CounterMetricFamily(
            "weighbridge_backend_prefix_cached_tokens",
            "Prompt tokens found in the backend's prefix cache: predicted and reported.",
            labels=["backend", "source"])
        for source, counts in sources:
            tenant_sum = dict.fromkeys(tenants, 0)
            backend_sum = dict.fromkeys(backends, 0)
            for (tenant, backend), n in counts.items():
                tenant_sum[tenant] = tenant_sum.get(tenant, 0) + n
                backend_sum[backend] = backend_sum.get(backend, 0) + n
            for tenant, n in tenant_sum.items():
                by_tenant.add_metric([tenant, source], n)
            for backend, n in backend_sum.items():
                by_backend.add_metric([backend, source], n)
        yield from (by_tenant, by_backend)
        blocks = GaugeMetricFamily("weighbridge_backend_prefix_index_blocks",
                                   "Blocks the sidecar's prefix index holds for the backend.",
                                   labels=["backend"])
        for b in stats.backends:
            blocks.add_metric([b.backend], b.prefix_index_blocks)
        yield blocks
        share = GaugeMetricFamily(
            "weighbridge_backend_prefix_cache_share",
            "Share of the backend's prefix cache the sidecar's prompts are taken to hold: its "
            "prompt tokens sent over the engine's prefix-cache queries, 0.05-1.",
            labels=["backend"])
        for b in stats.backends:
            share.add_metric([b.backend], b.prefix_cache_share)
        yield share
        decisions = CounterMetricFamily(
            "weighbridge_routing_decisions",
            "prefix_aware's choices of backend, by reason (affinity, load, bounded).",
            labels=["backend", "reason"])
        counts = stats.routing_decisions
        for backend in backends:
            for reason in ("affinity", "load", "bounded"):
                decisions.add_metric([backend, reason], counts.get((backend, reason), 0))
        yield decisions

    @staticmethod
    def _models(stats: CoreStats) -> Iterator[Metric]:
        """Requests by the model they were served as, and which backend serves which model
        (sidecar.catalog): several models share a fleet, and a model's pool is its own."""
        arrived = CounterMetricFamily("weighbridge_model_requests_arrived",
                                      "Requests that reached the sidecar, by model.",
                                      labels=["model"])
        ended = CounterMetricFamily("weighbridge_model_requests_ended",
                                    "Requests that ended, by model and outcome.",
                                    labels=["model", "outcome"])
        in_flight = GaugeMetricFamily("weighbridge_model_requests_in_flight",
                                      "Requests queued in the sidecar or dispatched, by model.",
                                      labels=["model", "state"])
        tallies = dict(stats.models)
        for models in stats.served.values():
            for model in models:
                tallies.setdefault(model, Tally())  # every served model's series, from 0
        for model, tally in tallies.items():
            arrived.add_metric([model], tally.arrivals)
            for outcome, count in (("completed", tally.completed),
                                   ("rejected", sum(tally.rejected.values())),
                                   ("cancelled", tally.cancelled), ("failed", tally.failed)):
                ended.add_metric([model, outcome], count)
            in_flight.add_metric([model, "queued"], tally.queued)
            in_flight.add_metric([model, "dispatched"], tally.dispatched)
        served = GaugeMetricFamily("weighbridge_backend_model_info",
                                   "1 for each model (base or adapter) a backend serves, as "
                                   "its /v1/models lists it or the config declares it.",
                                   labels=["backend", "model"])
        for backend, models in stats.served.items():
            for model in models:
                served.add_metric([backend, model], 1)
        yield from (arrived, ended, in_flight, served)

    def _stability(self, now: float, stats: CoreStats) -> Iterator[Metric]:
        reading = self.stability.read(now, stats.healthy_backends, stats.tokens_per_s)
        offered = GaugeMetricFamily("weighbridge_stability_offered_tokens_per_second",
                                    "Tokens (prompt + expected output) of arriving requests "
                                    "per second, over the stability window.")
        capacity = GaugeMetricFamily("weighbridge_stability_capacity_tokens_per_second",
                                     "Prompt + generation tokens per second the healthy "
                                     "backends processed, over the stability window.",
                                     labels=["source"])
        ratio = GaugeMetricFamily("weighbridge_stability_ratio",
                                  "Offered token load over serving capacity (above 1: the "
                                  "backlog grows).")
        if reading.offered_tokens_per_s is not None:
            offered.add_metric([], reading.offered_tokens_per_s)
        if reading.capacity_tokens_per_s is not None:
            capacity.add_metric([reading.capacity_source], reading.capacity_tokens_per_s)
        if (value := reading.ratio) is not None:
            ratio.add_metric([], value)
        yield from (offered, capacity, ratio)
        yield from self._utilisation(now, stats)

    def _utilisation(self, now: float, stats: CoreStats) -> Iterator[Metric]:
        """rho per backend and per pool (weighbridge.sidecar.stability); a pool is labelled by
        its backends, so there are at most as many as distinct sets of served models."""
        budget = stats.step_budget
        learned = {b.backend: b.learned_step_s for b in stats.backends}
        reading = self.stability.utilisation(now, learned, set(stats.healthy_backends),
                                             stats.pools, budget)
        by_backend = GaugeMetricFamily(
            "weighbridge_backend_utilisation_ratio",
            "Utilisation rho: tokens routed to the backend per second (computed prompt + "
            "expected output) x its full-step time / the step budget; absent while its step "
            "time is unknown.", labels=["backend"])
        by_pool = GaugeMetricFamily(
            "weighbridge_pool_utilisation_ratio",
            "Utilisation rho: tokens arriving for the pool per second (prompt + expected "
            "output) over the sum of its healthy backends' step budget / full-step time; "
            "absent while none has a step time.", labels=["pool"])
        step = GaugeMetricFamily(
            "weighbridge_backend_step_seconds",
            "The backend's full-step time (a step of step_budget_tokens) over the stability "
            "window, the t_step of rho; absent while unknown.", labels=["backend"])
        for backend, value in reading.backends.items():
            by_backend.add_metric([backend], value)
        for pool, value in reading.pools.items():
            by_pool.add_metric([pool], value)
        for backend, learned_s in learned.items():
            if (seconds := self.stability.step_s(backend, now, learned_s, budget)) is not None:
                step.add_metric([backend], seconds)
        budget_gauge = GaugeMetricFamily("weighbridge_step_budget_tokens",
                                         "B: the engines' step budget rho is counted in "
                                         "(admission.step_budget_tokens, else 2048).")
        budget_gauge.add_metric([], budget)
        yield from (by_backend, by_pool, step, budget_gauge)

    def _backends(self, now: float, stats: CoreStats) -> Iterator[Metric]:
        b = ["backend"]
        healthy = GaugeMetricFamily("weighbridge_backend_healthy",
                                    "1 when the backend is routed to.", labels=b)
        inflight = GaugeMetricFamily("weighbridge_backend_inflight_requests",
                                     "Requests the sidecar has in flight there.", labels=b)
        outstanding = GaugeMetricFamily("weighbridge_backend_outstanding_tokens",
                                        "Prompt plus expected remaining output in flight.",
                                        labels=b)
        prefilling = GaugeMetricFamily("weighbridge_backend_prefill_tokens",
                                       "Prompt tokens dispatched there with no first token yet.",
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
        processed = GaugeMetricFamily("weighbridge_backend_processed_tokens_per_second",
                                      "Prompt + generation tokens/s the backend processed, "
                                      "over the stability window.", labels=b)
        age = GaugeMetricFamily("weighbridge_backend_metrics_age_seconds",
                                "Age of the last successful scrape.", labels=b)
        # The backend's own counters as last scraped: rate() over them handles a backend's
        # restart like any counter reset.
        prompt = CounterMetricFamily("weighbridge_backend_prompt_tokens",
                                     "vllm:prompt_tokens_total at the last scrape.", labels=b)
        generation = CounterMetricFamily("weighbridge_backend_generation_tokens",
                                         "vllm:generation_tokens_total at the last scrape.",
                                         labels=b)
        preemptions = CounterMetricFamily("weighbridge_backend_preemptions",
                                          "vllm:num_preemptions_total at the last scrape.",
                                          labels=b)
        errors = CounterMetricFamily("weighbridge_backend_scrape_errors",
                                     "Failed scrapes of the backend's /metrics.", labels=b)
        for backend in stats.backends:
            name = backend.backend
            healthy.add_metric([name], 1.0 if backend.healthy else 0.0)
            inflight.add_metric([name], backend.inflight)
            outstanding.add_metric([name], backend.outstanding_tokens)
            prefilling.add_metric([name], backend.prefill_tokens)
            cap.add_metric([name], backend.cap)
            per_seq = backend.decode_tokens_per_s_per_seq
            if per_seq is not None:
                speed.add_metric([name], per_seq)
            rate = self.stability.backend_rate(name, now)
            if rate is not None:
                processed.add_metric([name], rate)
            state = self.pool.states.get(name) if self.pool else None
            if state is None:
                continue
            errors.add_metric([name], state.scrape_errors)
            sample = state.last_sample
            if sample is not None:
                waiting.add_metric([name], sample.waiting)
                running.add_metric([name], sample.running)
                if sample.kv_cache_usage is not None:
                    kv.add_metric([name], sample.kv_cache_usage)
                age.add_metric([name], now - sample.at_s)
                prompt.add_metric([name], sample.prompt_tokens_total)
                if sample.generation_tokens_total is not None:
                    generation.add_metric([name], sample.generation_tokens_total)
                preemptions.add_metric([name], sample.preemptions_total)
        yield from (healthy, inflight, outstanding, prefilling, cap, waiting, running, kv, speed,
                    processed, age, prompt, generation, preemptions, errors)


@dataclass(slots=True)
class _Residents:
    count: int = 0
    arrivals_sum_s: float = 0.0  # sum of the arrival times of those in the system
    left_s: float = 0.0  # time in system of those that left


class TimeInSystem:
    """∫ L dt, per (tenant, tier): the request-seconds spent in the sidecar so far, by
    requests that left (their whole stay) and by those inside (until now). Its rate over a
    window is the time-average number in the system, L, over the same window as the
    duration histogram's rate (λ·W), so Little's Law compares like with like even on a
    window that is only partly filled with data. O(1) per event: sum(now - a) = n*now - sum(a)."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[str, str], _Residents] = {}

    def enter(self, tenant: str, tier: str, arrival_s: float) -> None:
        r = self._by_key.get((tenant, tier))
        if r is None:
            r = self._by_key[(tenant, tier)] = _Residents()
        r.count += 1
        r.arrivals_sum_s += arrival_s

    def leave(self, tenant: str, tier: str, arrival_s: float, now: float) -> None:
        r = self._by_key[(tenant, tier)]
        r.count -= 1
        r.arrivals_sum_s -= arrival_s
        r.left_s += now - arrival_s
        if r.count == 0:
            r.arrivals_sum_s = 0.0  # no rounding residue carried into the next busy period

    def totals(self, now: float) -> dict[tuple[str, str], float]:
        return {key: r.left_s + max(0.0, r.count * now - r.arrivals_sum_s)
                for key, r in self._by_key.items()}


class RequestSeries:
    """One (tenant, tier)'s children of the per-request histograms and counters, looked up
    once: ``labels()`` builds a key and takes a lock on every call, several times a request
    (docs/sidecar-performance.md)."""

    __slots__ = ("duration", "offered", "output", "prompt", "queue_wait", "streamed_output",
                 "streamed_prompt", "ttft")

    def __init__(self, metrics: SidecarMetrics, tenant: str, tier: str) -> None:
        self.queue_wait = metrics.queue_wait.labels(tenant, tier)
        self.ttft = metrics.ttft.labels(tenant, tier)
        self.duration = metrics.duration.labels(tenant, tier)
        self.offered = metrics.offered_tokens.labels(tenant, tier)
        self.prompt = metrics.tokens.labels(tenant, tier, "prompt")
        self.output = metrics.tokens.labels(tenant, tier, "output")
        self.streamed_prompt = metrics.tokens_streamed.labels(tenant, tier, "prompt")
        self.streamed_output = metrics.tokens_streamed.labels(tenant, tier, "output")


class StreamedTokens:
    """One request's tokens counted into ``weighbridge_tokens_streamed_total`` as they pass:
    its prompt when the first token shows the prefill done, the output tokens each content
    chunk surely carries (``session.tokens_in_chunks``: one each unless the engine streams
    several per chunk), then topped up to the backend's ``usage`` at the end (a counter
    cannot be lowered, so an over-estimated text prompt stays).

    Output tokens are added to a plain count and folded into the counter whenever the
    registry is collected (``_FoldStreamed``) and at :meth:`close`: a Prometheus ``inc`` per
    chunk (a lock and five calls) was 3.5 % of the sidecar's instructions per streamed
    request, and nothing reads the counter but a collection."""

    __slots__ = ("_live", "_output", "_pending", "_prompt", "_prompt_estimate",
                 "output_counted", "prompt_counted")

    def __init__(self, series: RequestSeries, prompt_tokens: int,
                 live: set[StreamedTokens]) -> None:
        self._prompt = series.streamed_prompt
        self._output = series.streamed_output
        self._prompt_estimate = prompt_tokens
        self._live = live
        self._pending = 0
        self.prompt_counted = 0
        self.output_counted = 0

    def tokens(self, tokens: int = 1) -> None:
        """Output tokens relayed (what the content chunks surely carried; the usage settles
        the rest)."""
        if not self.output_counted:
            if not self.prompt_counted and self._prompt_estimate:
                self._prompt.inc(self._prompt_estimate)
                self.prompt_counted = self._prompt_estimate
            self._live.add(self)
        self._pending += tokens
        self.output_counted += tokens

    def fold(self) -> None:
        """Put the tokens counted since the last fold into the counter."""
        if self._pending:
            self._output.inc(self._pending)
            self._pending = 0

    def settle(self, prompt_tokens: int, output_tokens: int) -> None:
        self.fold()
        if prompt_tokens > self.prompt_counted:
            self._prompt.inc(prompt_tokens - self.prompt_counted)
            self.prompt_counted = prompt_tokens
        if output_tokens > self.output_counted:
            self._output.inc(output_tokens - self.output_counted)
            self.output_counted = output_tokens

    def close(self) -> None:
        """The request is over (every way out): fold what is left, stop being collected."""
        self.fold()
        self._live.discard(self)


class _FoldStreamed(Collector):
    """Registered before the counters, so every collection (``/metrics``, a test's
    ``get_sample_value``) sees the streams' chunks folded in first; exposes nothing."""

    def __init__(self, live: set[StreamedTokens]) -> None:
        self.live = live

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        for streamed in list(self.live):
            streamed.fold()
        return []


class SidecarMetrics:
    def __init__(self, core: SchedulingCore, pool: BackendPool | None,
                 stability: StabilityMeter | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._core = core
        self.stability = stability or StabilityMeter()
        self.in_system = TimeInSystem()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(CoreCollector(core, pool, self.stability, self.in_system, clock))
        self._streaming: set[StreamedTokens] = set()  # the streams with chunks to fold
        self.registry.register(_FoldStreamed(self._streaming))  # before the counters
        r = self.registry
        labels = ["tenant", "tier"]
        self.queue_wait = Histogram("weighbridge_queue_wait_seconds",
                                    "Time from arrival to dispatch.", labels,
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("weighbridge_time_to_first_token_seconds",
                              "Arrival at the sidecar to the first content chunk relayed.",
                              labels, buckets=LATENCY_BUCKETS, registry=r)
        self.duration = Histogram("weighbridge_request_duration_seconds",
                                  "Arrival to the end of requests that entered a queue "
                                  "(completed, cancelled or failed).",
                                  labels, buckets=LATENCY_BUCKETS, registry=r)
        self.tokens = Counter("weighbridge_tokens_served",
                              "Tokens served: the usage of completed requests, and what "
                              "cut-off streams delivered.",
                              [*labels, "kind"], registry=r)
        self.tokens_streamed = Counter("weighbridge_tokens_streamed",
                                       "Tokens as they pass: prompts at the first token, "
                                       "output per chunk, settled to usage at the end.",
                                       [*labels, "kind"], registry=r)
        self.offered_tokens = Counter("weighbridge_offered_tokens",
                                      "Prompt + expected output tokens of requests that "
                                      "reached the ingress checks.", labels, registry=r)
        self._series: dict[tuple[str, str], RequestSeries] = {}
        # Initialised at 0 for each tenant's own tier (see CoreCollector.collect).
        for tenant, spec in core.config.tenants.items():
            self.offered_tokens.labels(tenant, spec.tier)
            for kind in ("prompt", "output"):
                self.tokens.labels(tenant, spec.tier, kind)
                self.tokens_streamed.labels(tenant, spec.tier, kind)

    def series(self, tenant: str, tier: str) -> RequestSeries:
        """The (tenant, tier)'s series, made on first use (both are configured names)."""
        series = self._series.get((tenant, tier))
        if series is None:
            series = self._series[(tenant, tier)] = RequestSeries(self, tenant, tier)
        return series

    def offer(self, tenant: str, tier: str, tokens: int,
              pool: frozenset[str] | None = None) -> None:
        """A request of ``tokens`` reached the checks, for ``pool`` (its model's backends).
        A front that does not name the pool sends to the fleet's only pool when there is
        one; with several, its request counts for no pool's utilisation."""
        self.series(tenant, tier).offered.inc(tokens)
        if pool is None:
            pools = current_pools(self._core.catalog)
            pool = next(iter(pools)) if len(pools) == 1 else None
        self.stability.offer(tokens, pool)

    def routed(self, backend: str, tokens: int) -> None:
        """A request of ``tokens`` (computed prompt + expected output) went to ``backend``."""
        self.stability.route(backend, tokens)

    def streamed(self, tenant: str, tier: str, prompt_tokens: int) -> StreamedTokens:
        return StreamedTokens(self.series(tenant, tier), prompt_tokens, self._streaming)
