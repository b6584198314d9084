"""One process's share of a workload, run on gevent: the schedule made real.

Each open-loop tenant gets a scheduler greenlet that sleeps until each request's due time and
spawns a greenlet for it, so a request is sent on time whether or not earlier ones have
finished; its latencies start at the due time. Closed-loop users are a greenlet each. A
conversation (a multi-turn session, an agent program, a replayed trace's session:
weighbridge.loadgen.conversations) starts at its open-loop time, and each of its
requests is a greenlet that, once its answer has ended, spawns those the conversation plans
next (a program's subagents run side by side; their parent's next call follows the last of
them). A trace replaces the tenants' schedules with its own plans and sessions, sent at
their times. When the run stops, whatever has not finished is recorded as ``cancelled``
(with ``sent_s`` unset if it never left), so every scheduled request ends in exactly one
record.

The driver knows nothing about Locust: the glue passes callbacks for the finished records
(records file, Locust statistics, exporter) and for starts and schedule lag (exporter).
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import gevent
from gevent.pool import Group

from weighbridge.loadgen.arrivals import Closed
from weighbridge.loadgen.bodies import ChatFraming, build_body
from weighbridge.loadgen.client import HttpTarget
from weighbridge.loadgen.conversations import Conversation, conversations_of
from weighbridge.loadgen.identity import request_headers
from weighbridge.loadgen.measure import StreamMeter
from weighbridge.loadgen.plan import (
    RequestPlan,
    closed_request_id,
    closed_users,
    open_loop_schedule,
    open_request_id,
    plan_request,
    share,
)
from weighbridge.loadgen.scenario import Workload
from weighbridge.loadgen.tenants import ENDPOINT_PATHS, TenantSpec
from weighbridge.loadgen.trace import TraceReplay
from weighbridge.records import RequestRecord

__all__ = ["DriverStats", "RequestCancelled", "TrafficDriver"]


_SEND_PRIORITY = 2  # libev's highest watcher priority
_SPAWN_AHEAD_S = 0.25


class RequestCancelled(Exception):
    """Raised into a request's greenlet when the run ends before the request did."""


class _ClientTimeout(Exception):
    pass


@dataclass(slots=True)
class DriverStats:
    lags: list[float] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    prompt_mismatches: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    output_mismatches: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # Completions turns whose answer came without token ids (sent back as stand-in ids).
    answers_without_ids: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def to_dict(self) -> dict[str, object]:
        return {"statuses": dict(self.statuses),
                "prompt_mismatches": dict(self.prompt_mismatches),
                "output_mismatches": dict(self.output_mismatches),
                "answers_without_ids": dict(self.answers_without_ids)}


RecordHook = Callable[[RequestRecord], None]
StartHook = Callable[[RequestPlan], None]
LagHook = Callable[[str, float], None]


class TrafficDriver:
    def __init__(
        self,
        workload: Workload,
        target: HttpTarget,
        *,
        run_id: str,
        t0: float,  # the run's t = 0 on the monotonic clock
        seed: int = 0,
        model: str | None = None,  # for tenants that name no model of their own
        index: int = 0,
        count: int = 1,
        until_s: float = math.inf,
        chat_overhead: int | None = None,  # the chat template's framing, if measured
        trace: TraceReplay | None = None,  # replaces the tenants' schedules
        on_record: RecordHook,
        on_start: StartHook | None = None,
        on_lag: LagHook | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.workload = workload
        self.target = target
        self.run_id = run_id
        self.t0 = t0
        self.seed = seed
        self.model = model
        self.index = index
        self.count = count
        self.until_s = min(until_s, workload.end_s)
        self.on_record = on_record
        self.on_start = on_start
        self.on_lag = on_lag
        self.clock = clock
        self.trace = trace
        self.stats = DriverStats()
        self._tenants = {t.name: t for t in workload.tenants}
        self._framing = {t.name: ChatFraming(chat_overhead or 0) for t in workload.tenants}
        self._schedulers = Group()
        self._requests = Group()
        self._pending: dict[str, StreamMeter] = {}
        self._announced: set[str] = set()
        self._stopped = False

    def now(self) -> float:
        return self.clock() - self.t0

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        if self.trace is not None:
            self._schedulers.spawn(self._guarded, self._replay, self.trace.plans)
            self._schedulers.spawn(self._guarded, self._conversations, self.trace.sessions)
            return
        for tenant in self.workload.tenants:
            conversations = conversations_of(tenant, self.workload, self.seed, self.until_s,
                                             self.model)
            if conversations is not None:
                self._schedulers.spawn(self._guarded, self._conversations, conversations)
                continue
            self._schedulers.spawn(self._guarded, self._open_loop, tenant)
            for phase, start, end, user, process in closed_users(
                    tenant, self.workload, self.index, self.count):
                self._schedulers.spawn(self._guarded, self._closed_user, tenant, phase, start,
                                       end, user, process)

    def drained(self) -> bool:
        """Every scheduled request has been sent and has ended."""
        return not self._schedulers and not self._requests and not self._pending

    def join(self, timeout: float | None = None) -> bool:
        """Wait until every scheduled request has ended; True if they all did."""
        self._schedulers.join(timeout=timeout)
        return self._requests.join(timeout=timeout) and not self._pending

    def stop(self, reason: str = "run_ended") -> None:
        """Stop sending; record what is still in flight as cancelled."""
        if self._stopped:
            return
        self._stopped = True
        gevent.killall(list(self._schedulers), exception=RequestCancelled, block=True,
                       timeout=10)
        gevent.killall(list(self._requests), exception=RequestCancelled, block=True,
                       timeout=10)
        now = self.now()
        for meter in list(self._pending.values()):
            if meter.plan.scheduled_s <= now:  # due, and not ended: cut off by the stop
                meter.cancelled(now, reason)
                self._emit(meter)
        self._pending.clear()  # the rest were not due yet: they were never requests

    # -- greenlets ---------------------------------------------------------------------------

    @staticmethod
    def _guarded(fn: Callable[..., None], *args: object) -> None:
        with contextlib.suppress(RequestCancelled):
            fn(*args)

    def _sleep_until(self, t: float) -> None:
        """Sleep until run time ``t`` on a top-priority timer: when a step of the server
        makes hundreds of streams readable at once, an expired send timer runs before their
        reads instead of after all of them (which would show as schedule lag)."""
        delay = self.t0 + t - self.clock()
        if delay <= 0:
            return
        hub = gevent.get_hub()
        timer = hub.loop.timer(delay, priority=_SEND_PRIORITY)
        try:
            hub.wait(timer)
        finally:
            timer.close()

    def _open_loop(self, tenant: TenantSpec) -> None:
        schedule = open_loop_schedule(tenant, self.workload, self.seed, self.until_s)
        for due in share(schedule, self.index, self.count):
            # Each request's greenlet starts a little ahead and sleeps to its own due time,
            # so the send is one timer away, not a timer and a spawn; its plan and body are
            # made before the due time, off the critical path.
            self._sleep_until(due.t - _SPAWN_AHEAD_S)
            plan = plan_request(tenant, open_request_id(tenant.name, due.seq), due.phase,
                                due.t, self.seed, self.model)
            request = self._prepare(tenant, plan)
            meter = self._meter(plan)
            self._requests.spawn(self._send_when_due, tenant, meter, *request)

    def _replay(self, plans: Sequence[RequestPlan]) -> None:
        """A trace's plans at their times; plan ``i`` belongs to process ``i % count``."""
        for i, plan in enumerate(plans):
            if i % self.count != self.index or plan.scheduled_s >= self.until_s:
                continue
            self._sleep_until(plan.scheduled_s - _SPAWN_AHEAD_S)
            tenant = self._tenants[plan.tenant]
            request = self._prepare(tenant, plan)
            self._requests.spawn(self._send_when_due, tenant, self._meter(plan), *request)

    def _conversations(self, conversations: Iterable[Conversation]) -> None:
        """Conversations in the order they start; conversation ``i`` belongs to process
        ``i % count`` (a session's or a program's sequence number among its tenant's)."""
        for i, conversation in enumerate(conversations):
            if i % self.count != self.index:
                continue
            plan = conversation.first()
            if plan.scheduled_s >= self.until_s:
                return
            self._sleep_until(plan.scheduled_s - _SPAWN_AHEAD_S)
            self._requests.spawn(self._guarded, self._turn, conversation, plan)

    def _turn(self, conversation: Conversation, plan: RequestPlan) -> None:
        """One request of a conversation; when it has ended, those that follow it."""
        tenant = self._tenants[plan.tenant]
        request = self._prepare(tenant, plan)
        meter = self._meter(plan)
        self._sleep_until(plan.scheduled_s)  # cancelled here: stop() records it if due
        self._perform(tenant, meter, *request)
        answer = meter.answer()
        if answer is not None and answer.token_ids is None \
                and plan.endpoint == ENDPOINT_PATHS["completions"]:
            self.stats.answers_without_ids[tenant.name] += 1
        assert meter.end_s is not None
        for follow in conversation.ended(plan, answer, meter.end_s):
            if not self._stopped and follow.scheduled_s < self.until_s:
                self._requests.spawn(self._guarded, self._turn, conversation, follow)

    def _send_when_due(self, tenant: TenantSpec, meter: StreamMeter, body: bytes,
                       headers: dict[str, str], words: int | None) -> None:
        try:
            self._sleep_until(meter.plan.scheduled_s)
        except RequestCancelled:
            return  # stopped before it was due: stop() decides whether it gets a record
        self._perform(tenant, meter, body, headers, words)

    def _closed_user(self, tenant: TenantSpec, phase: str, start: float, end: float,
                     user: int, process: Closed) -> None:
        rng = random.Random(f"{self.seed}/{tenant.name}/{phase}/u{user}/think")
        end = min(end, self.until_s)
        t, n = start, 0
        while t < end:
            plan = plan_request(tenant, closed_request_id(tenant.name, phase, user, n), phase,
                                t, self.seed, self.model)
            request = self._prepare(tenant, plan)
            self._sleep_until(t)
            self._perform(tenant, self._meter(plan), *request)
            t = max(self.now(), t) + process.think_time(rng)
            n += 1

    def _prepare(self, tenant: TenantSpec, plan: RequestPlan
                 ) -> tuple[bytes, dict[str, str], int | None]:
        """The body and headers of a request, and its chat words (None for completions)."""
        words = None
        if tenant.endpoint == "chat" and plan.messages is None:
            words = self._framing[tenant.name].words_for(plan.prompt_tokens)
        headers = request_headers(plan, tenant)
        if tenant.api_key:
            headers["authorization"] = f"Bearer {tenant.api_key}"
        return build_body(plan, tenant, chat_words=words), headers, words

    def _meter(self, plan: RequestPlan) -> StreamMeter:
        meter = StreamMeter(plan, self.run_id, self.workload.scenario)
        self._pending[plan.request_id] = meter
        return meter

    def _perform(self, tenant: TenantSpec, meter: StreamMeter, body: bytes,
                 headers: dict[str, str], words: int | None) -> None:
        plan = meter.plan
        self._announce(plan)
        try:
            with gevent.Timeout(tenant.timeout_s, _ClientTimeout):
                self.target.exchange(plan.endpoint, body, headers, meter, self.t0)
        except _ClientTimeout:
            meter.timed_out(self.now())
        except RequestCancelled:
            meter.cancelled(self.now())
        except Exception as exc:
            meter.failed(self.now(), f"{type(exc).__name__}: {exc}"[:200])
        if words is not None and meter.prompt_tokens is not None:
            self._framing[tenant.name].observe(words, meter.prompt_tokens)
        self._emit(meter)

    def _announce(self, plan: RequestPlan) -> None:
        """Tell the start hook once, by the time the request is due or ends."""
        if self.on_start is not None and plan.request_id not in self._announced:
            self._announced.add(plan.request_id)
            self.on_start(plan)

    def _emit(self, meter: StreamMeter) -> None:
        if self._pending.pop(meter.plan.request_id, None) is None:
            return  # already recorded
        self._announce(meter.plan)  # a due request cut off before it went out
        self._announced.discard(meter.plan.request_id)
        record = meter.record()
        stats = self.stats
        stats.statuses[record.status] += 1
        if record.sent_s is not None:
            lag = record.sent_s - record.scheduled_s
            stats.lags.append(lag)
            if self.on_lag is not None:
                self.on_lag(record.tenant, lag)
        if record.status == "ok":
            plan = meter.plan
            # A chat prompt of several messages carries the template's framing on top.
            exact = plan.messages is None or plan.endpoint != "/v1/chat/completions"
            if exact and record.prompt_tokens is not None \
                    and record.prompt_tokens != plan.prompt_tokens:
                stats.prompt_mismatches[record.tenant] += 1
            if self._tenants[record.tenant].ignore_eos and record.output_tokens != plan.max_tokens:
                stats.output_mismatches[record.tenant] += 1
        self.on_record(record)
