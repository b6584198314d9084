"""The discrete-event loop: the sidecar's SchedulingCore in front of StepModel engines, in
virtual time, with the clients of a load-generator run.

Everything that decides is the live system's own code: ``weighbridge.sidecar.core.SchedulingCore``
(rate limits, early rejection, queues, tiers, DRR, admission gates, routing, accounting),
``weighbridge.emulator.engine.StepModel`` (vLLM's scheduler and KV cache) and
``weighbridge.loadgen.measure.StreamMeter`` (what a client records). This module only replaces
the sockets and the wall clock with a heap of timed events, calling each class where its HTTP
shell would:

* a client sends: the sidecar's ingress (``weighbridge.sidecar.session``: the key, the
  headers, the body's fields, then ``core.arrive``; a rejection is answered at once), then a
  dispatch pass;
* a dispatch: the request becomes the engine's sequences by the emulator's own rule
  (``weighbridge.emulator.intake.engine_sequences``: one per generation, one pooling
  sequence per embeddings input); the engine's API front end delays each
  (``weighbridge.emulator.frontend``), then each joins the engine's waiting queue; an idle
  engine starts a step at once;
* a step ends: the engine schedules its next step before anything else runs (as the
  emulator's loop does), then every emitted token reaches the sidecar
  (``core.on_tokens_streamed``, one per chunk) and the client; finished requests are
  completed (the request's session, with the usage; an embeddings request once every input
  is pooled, with the emulator's answer) and a dispatch pass follows;
* every ``admission.metrics_poll_ms`` each engine is scraped (``core.on_backend_metrics``
  with the engine's state at that instant, stamped with the send time as the poller does)
  and the periodic dispatch tick runs, so the gates see metrics exactly as stale as live;
* the stability meter (``weighbridge.sidecar.stability``) is told what arrives for each pool
  and what is routed to each backend, as the sidecar's shell tells it, and sampled at each
  poll; with ``utilisation_every_s`` the first poll of each such period also records rho
  beside the backlog (``UtilisationSample``), what /metrics would show at that instant;
* a client's ``timeout_s`` or the run's end cut a request off: a queued one leaves the queue
  (``core.cancel``), one in flight is aborted at its engine and ended with what streamed
  (``core.on_client_gone``), both through the request's session as live;
* with ``replicas`` above one, each replica is a core of its own, the requests go to them in
  turn (a front's round robin), each scrapes the engines on its own (spread over a poll
  period), and every ``state.sync_ms`` they exchange their load and service as through
  Redis (``weighbridge.app.simulation.exchange``); the stability meter is the first one's.

Coasting: while nothing is queued, a run of plain decode steps (every running sequence
decodes, none finishes, nothing waits) changes nothing but its engine and the chunk times of
its flights, so the steps of every engine up to the next other event are taken at once
(``_coast_steps``, ``StepModel.coast``): the same records, step for step, as one event per
step (``Simulation(coast=False)``; tests/unit/simulation/test_coast.py).

What live runs have and this does not: network and CPU time (the sidecar adds ~2 ms at
p50), chunk coalescing for slow readers, and engine faults.
"""

from __future__ import annotations

import bisect
import heapq
import math
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from weighbridge.app.simulation.clients import ClientRequest, Clients
from weighbridge.app.simulation.engines import SimEngine, output_token_id
from weighbridge.app.simulation.exchange import ReplicaExchange
from weighbridge.emulator.api import EmbeddingRequest, GenerationRequest, embeddings_response
from weighbridge.emulator.engine import Sequence
from weighbridge.emulator.intake import ApiRequest
from weighbridge.loadgen.bodies import message_token_ids, prompt_fields, request_fields
from weighbridge.loadgen.measure import StreamMeter
from weighbridge.loadgen.plan import RequestPlan
from weighbridge.records import RequestRecord
from weighbridge.sidecar import Replica
from weighbridge.sidecar.config import EMBEDDINGS, Config
from weighbridge.sidecar.core import SchedulingCore
from weighbridge.sidecar.prefix import PromptPrefix
from weighbridge.sidecar.request import QueuedRequest
from weighbridge.sidecar.session import (
    ApiError,
    Caller,
    Ingress,
    Prompt,
    RelayOutcome,
    RequestSession,
    Usage,
)
from weighbridge.sidecar.stability import (
    StabilityMeter,
    current_pools,
    learned_step_s,
    step_budget,
)

__all__ = ["Simulation", "SimulationResult", "UtilisationSample", "engine_request", "prompt_ids"]

# Event kinds; at equal times events run in the order they were scheduled.
_ARRIVE, _ENTER, _STEP, _POLL, _TIMEOUT, _SYNC = range(6)


def prompt_ids(plan: RequestPlan) -> tuple[int, ...] | None:
    """The token ids the load generator sends for a prompt with prefix structure (a chat
    prompt's too: the engine model has no chat template); None for a prefix-free one,
    whose content no other prompt shares."""
    if plan.messages is None:
        return None
    return tuple(i for m in plan.messages for i in message_token_ids(m))


def engine_request(client: ClientRequest, served_model: str, priority: int | None,
                   ids: tuple[int, ...] | None, fields: Mapping[str, Any] | None = None
                   ) -> ApiRequest:
    """What the emulator parses of the body the load generator sends for ``client``'s plan,
    with the ``priority`` the sidecar forwards: ``fields``, its body but the prompt
    (``loadgen.bodies.request_fields``, made here when not given). An embeddings input is
    the prompt's token ids, as sent (``loadgen.bodies.prompt_fields``); a generation's
    prompt ids are ``ids`` (None: a prefix-free prompt, whose content no other prompt
    shares)."""
    plan = client.plan
    model = plan.model or served_model
    if plan.endpoint == EMBEDDINGS:
        tokens = tuple(prompt_fields(plan)["input"])
        return EmbeddingRequest(model=model, inputs=(tokens,), input_ids=(tokens,),
                                prompt_tokens=(len(tokens),), encoding_format="float",
                                priority=priority or 0, user=plan.user)
    if fields is None:
        fields = request_fields(plan, client.options)
    options = fields.get("stream_options") or {}
    return GenerationRequest(
        endpoint="chat" if plan.endpoint == "/v1/chat/completions" else "completions",
        model=model, prompt_tokens=plan.prompt_tokens, max_tokens=plan.max_tokens,
        ignore_eos=bool(fields.get("ignore_eos")), priority=priority or 0, stream=plan.stream,
        include_usage=bool(options.get("include_usage")),
        continuous_usage=bool(options.get("continuous_usage_stats")), user=plan.user,
        prompt_ids=ids or (), return_token_ids=bool(fields.get("return_token_ids")))


@dataclass(slots=True, eq=False)
class _Flight:
    """One request from its send to its record."""

    client: ClientRequest
    meter: StreamMeter
    session: RequestSession
    core: SchedulingCore  # the replica that took it
    # The session's request: told of its tokens directly on the loop's hot path (the call
    # RequestSession.streamed makes).
    request: QueuedRequest
    engine: SimEngine | None = None
    # What its engine runs: one sequence, or one pooling sequence per embeddings input.
    seqs: list[Sequence] = field(default_factory=list)
    parsed: ApiRequest | None = None  # what the emulator parsed of it (for its answer)
    ended: bool = False
    stream: bool = True
    times: list[float] = field(default_factory=list)  # when each content chunk arrived
    reported: int = 0  # of those, how many the core has been told of (see _flush)
    dispatch_no: int = 0  # the order it went to its engine in (see _flush)
    ids: tuple[int, ...] | None = None  # the prompt's token ids (prompt_ids)
    # Its body but the prompt, as the load generator sends it (loadgen.bodies.request_fields).
    fields: dict[str, Any] = field(default_factory=dict)


def _dispatch_order(flight: _Flight) -> int:
    return flight.dispatch_no


@dataclass(frozen=True, slots=True)
class UtilisationSample:
    """rho at one poll (``StabilityMeter.utilisation``: absent names are unknown) and the
    backlog it is meant to warn of."""

    at_s: float
    backends: dict[str, float]  # backend -> rho
    pools: dict[str, float]  # pool label -> rho
    step_s: dict[str, float]  # backend -> its full-step time, where the window decoded
    queued_requests: int  # in the sidecar's queues, every pool
    engine_waiting: int  # in the engines' waiting queues, summed


@dataclass
class SimulationResult:
    records: list[RequestRecord]
    end_s: float  # the run's end in virtual time
    engine_steps: int
    events: int
    wall_s: float  # CPU-bound wall time the loop took
    holds: dict[str, int] = field(default_factory=dict)  # dispatch holds by backend/reason
    ledger: dict[str, Any] = field(default_factory=dict)
    utilisation: list[UtilisationSample] = field(default_factory=list)  # utilisation_every_s


class Simulation:
    def __init__(self, config: Config, engines: list[SimEngine], clients: Clients, *,
                 run_id: str, scenario: str, until_s: float, drain: bool = False,
                 coast: bool = True, utilisation_every_s: float | None = None,
                 replicas: int = 1) -> None:
        """``drain``: end as soon as every request has ended (a trace replay), not at
        ``until_s`` (a scenario runs to its end, as a live run does). ``coast``: take runs
        of plain decode steps at once (``_step_end``); False: every step is an event of its
        own, the reference the coasting is tested against. ``utilisation_every_s``: record
        rho and the backlog this often, at a poll (``SimulationResult.utilisation``);
        None: never. ``replicas``: sidecar replicas in front of the engines, each its own
        core, sharing their state as through Redis (``ReplicaExchange``), every request
        sent to the next one in turn (a front's round robin)."""
        names = [b.name for b in config.backends]
        if names != [e.name for e in engines]:
            raise ValueError(f"engines {[e.name for e in engines]} do not match the config's "
                             f"backends {names}")
        if not math.isfinite(until_s):
            raise ValueError("a simulation needs a finite end (--duration)")
        if replicas < 1:
            raise ValueError("replicas must be at least 1")
        self.config = config
        self.cores = [SchedulingCore(config) for _ in range(replicas)]
        self.core = self.cores[0]
        self.ingresses = [Ingress(config, core) for core in self.cores]
        self.ingress = self.ingresses[0]
        self._next_replica = 0  # who takes the next request
        # The others' load and service, exchanged every sync_ms (None: one replica).
        self.exchange = None if replicas == 1 else ReplicaExchange(
            [Replica(core) for core in self.cores], config.state.sync_ms / 1000)
        self._callers: dict[str, Caller] = {}  # Authorization header -> its caller
        self._scheduler = self.core.scheduler
        self.engines = engines
        self._by_name = {e.name: e for e in engines}
        self.clients = clients
        self.run_id = run_id
        self.scenario = scenario
        self.until_s = until_s
        self.drain = drain
        self._coast = coast
        self.poll_s = self.core.poll_period_s()  # derived from the engines unless configured
        self.stability = StabilityMeter()
        self._watch_every = utilisation_every_s
        self._next_watch = 0.0
        self._utilisation: list[UtilisationSample] = []
        self.records: list[RequestRecord] = []
        self._flights: dict[str, _Flight] = {}  # sent, not ended
        self._dispatched: dict[str, _Flight] = {}  # of those, the ones sent to an engine
        # The embeddings flights in the engines, by their pooling sequences' ids.
        self._pooled: dict[str, _Flight] = {}
        # Flights whose tokens were held back from the core since the last _flush: only
        # these are visited then, not every flight in the engines (thousands in a flood).
        self._held: set[_Flight] = set()
        self._dispatches = 0
        self._heap: list[tuple[float, int, int, Any]] = []
        # The engines' step ends, beside the other events (one pending per busy engine): the
        # order numbers are shared, so at equal times events still run in the order they
        # were scheduled.
        self._steps: list[tuple[float, int, SimEngine]] = []
        self._order = 0
        self._events = 0

    # ------------------------------------------------------------------ the loop

    def _push(self, t: float, kind: int, obj: Any) -> None:
        self._order += 1
        heapq.heappush(self._heap, (t, self._order, kind, obj))

    def run(self) -> SimulationResult:
        started = time.perf_counter()
        until = self.until_s
        # The clients' own schedule is a sorted list beside the heap, so the heap holds only
        # the few events in flight (steps, polls, timeouts, closed-loop follow-ups). At equal
        # times a scheduled arrival goes first.
        arrivals = sorted((c for c in self.clients.initial() if c.plan.scheduled_s < until),
                          key=lambda c: (c.plan.scheduled_s, c.plan.request_id))
        times = [c.plan.scheduled_s for c in arrivals]
        k, n = 0, len(arrivals)
        # Each replica scrapes on its own; the first at 0, the others spread over a period.
        for i in range(len(self.cores)):
            self._push(i * self.poll_s / len(self.cores), _POLL, i)
        if self.exchange is not None:
            self._push(self.exchange.sync_s, _SYNC, None)
        heap, steps = self._heap, self._steps
        pop = heapq.heappop
        step_end, arrive = self._step_end, self._arrive
        events = 0
        while True:
            # The next event: a scheduled arrival (first at equal times), or the earlier of
            # the next step end and the next other event.
            step = steps[0] if steps and (not heap or steps[0][:2] < heap[0][:2]) else None
            if k < n and times[k] <= (step[0] if step is not None
                                      else heap[0][0] if heap else math.inf):
                t = times[k]
                if t >= until:
                    break
                arrive(arrivals[k], t)
                k += 1
            elif step is not None:
                t = step[0]
                if t >= until:
                    break
                pop(steps)
                # Nothing but steps happens before the next other event (or arrival): until
                # then plain decode steps can be taken at once (_step_end).
                horizon = heap[0][0] if heap else until
                if k < n and times[k] < horizon:
                    horizon = times[k]
                events += step_end(step[2], t, step[1], horizon if horizon < until else until)
            elif heap:
                t, _, kind, obj = pop(heap)
                if t >= until:
                    break
                if kind == _ARRIVE:
                    arrive(obj, t)
                elif kind == _POLL:
                    self._poll(t, obj)
                elif kind == _SYNC:
                    self._sync(t)
                elif kind == _ENTER:
                    self._enter(obj, t)
                else:
                    self._timeout(obj, t)
            else:
                break
            events += 1
            if self.drain and k == n and not self._flights and not any(
                    e[2] == _ARRIVE for e in heap):
                until = t  # every request has ended
                break
        self._events = events
        self._end_run(until)
        self.until_s = until
        held: Counter[tuple[str, str]] = Counter()
        for core in self.cores:
            held.update(core.holds)
        holds = {f"{backend or '-'}/{reason}": n for (backend, reason), n in sorted(held.items())}
        ledgers = [core.ledger.snapshot() for core in self.cores]
        return SimulationResult(
            records=self.records, end_s=until,
            engine_steps=sum(e.steps for e in self.engines), events=self._events,
            wall_s=time.perf_counter() - started, holds=holds,
            ledger=ledgers[0] if len(ledgers) == 1 else {"replicas": ledgers},
            utilisation=self._utilisation)

    # ------------------------------------------------------------------ clients

    def _arrive(self, client: ClientRequest, now: float) -> None:
        plan = client.plan
        meter = StreamMeter(plan, self.run_id, self.scenario)
        meter.sent(now)
        replica = self._next_replica
        self._next_replica = (replica + 1) % len(self.cores)
        ingress = self.ingresses[replica]
        headers = {k.lower(): v for k, v in client.headers.items()}
        if client.api_key is not None:
            headers.setdefault("authorization", f"Bearer {client.api_key}")
        ids = prompt_ids(plan)
        fields = request_fields(plan, client.options)
        try:
            caller = self._caller(client, headers)
            if client.body is not None:  # a body of its own: read as live reads it
                arrival = ingress.read(caller, plan.endpoint, headers, client.body)
            else:
                # The body the load generator sends, its prompt counted from the plan; the
                # sidecar normalises its own copy.
                arrival = ingress.read(
                    caller, plan.endpoint, headers, dict(fields),
                    Prompt(plan.prompt_tokens, None if ids is None else PromptPrefix(ids)))
            self._flush()
            core = ingress.core
            # Offered load counts every request that reaches the checks, as the shell does.
            self.stability.offer(
                core.estimated_tokens(caller.tenant, arrival.endpoint, arrival.prompt_tokens,
                                      arrival.max_tokens, arrival.sequences, arrival.model),
                core.catalog.backends_for(core.request_model(arrival.model)))
            session = ingress.arrive(arrival, plan.request_id, now)
        except ApiError as e:
            self._answer(client, meter, now, e)
            return
        flight = _Flight(client, meter, session, core, session.request,
                         stream=session.stream, ids=ids, fields=fields)
        self._flights[plan.request_id] = flight
        deadline = now + client.timeout_s
        if deadline < self.until_s:
            self._push(deadline, _TIMEOUT, flight)
        self._dispatch(now)

    def _caller(self, client: ClientRequest, headers: dict[str, str]) -> Caller:
        """Who sends: a replayed trace names its tenant; a client's key is authenticated
        once (the config's key -> tenant map does not change during a run)."""
        if client.tenant is not None:
            return self.ingress.named(client.tenant)
        authorization = headers.get("authorization")
        caller = None if authorization is None else self._callers.get(authorization)
        if caller is None:
            caller = self.ingress.authenticate(headers)  # a refusal is answered, not kept
            if authorization is not None:
                self._callers[authorization] = caller
        return caller

    def _answer(self, client: ClientRequest, meter: StreamMeter, now: float,
                error: ApiError) -> None:
        """The sidecar's error answer."""
        meter.response(now, error.status, error.response_headers())
        meter.body(error.body(), now)
        meter.finish(now)
        self._record(client, meter, now)

    def _record(self, client: ClientRequest, meter: StreamMeter, now: float) -> None:
        self.records.append(meter.record())
        for follow in self.clients.after(client, now, meter.answer()):
            if follow.plan.scheduled_s < self.until_s:
                self._push(follow.plan.scheduled_s, _ARRIVE, follow)

    def _timeout(self, flight: _Flight, now: float) -> None:
        if flight.ended:
            return
        self._client_gone(flight, now)
        flight.meter.timed_out(now)
        self._record(flight.client, flight.meter, now)
        self._dispatch(now)

    def _client_gone(self, flight: _Flight, now: float) -> None:
        """The client went away: as the sidecar's handler reacts to its cancellation."""
        self._flush_one(flight)
        if flight.stream:
            flight.meter.contents(flight.times)
        flight.ended = True
        del self._flights[flight.client.plan.request_id]
        self._dispatched.pop(flight.client.plan.request_id, None)
        if flight.engine is not None:
            for seq in flight.seqs:
                flight.engine.model.abort(seq.request_id, now)
                if seq.pooling:
                    self._pooled.pop(seq.request_id, None)
        flight.session.client_gone(now)

    def _end_run(self, now: float) -> None:
        """The load generator stops: whatever is still in flight is cut off."""
        for flight in list(self._flights.values()):
            self._client_gone(flight, now)
            flight.meter.cancelled(now)
            self.records.append(flight.meter.record())

    # ------------------------------------------------------------------ sidecar -> engines

    def _dispatch(self, now: float) -> None:
        kicked: list[SimEngine] = []
        for d in (d for core in self.cores for d in core.dispatch_ready(now)):
            flight = self._flights[d.request.id]
            engine = self._by_name[d.backend]
            client = flight.client
            plan = client.plan
            parsed = engine_request(client, engine.served_model, d.vllm_priority, flight.ids,
                                    flight.fields)
            seqs = engine.sequences(parsed, plan.request_id, now)
            headers = flight.session.dispatched(d, now).headers
            try:
                for seq in seqs:
                    engine.model.check(seq)
            except ValueError as e:
                # The emulator answers 400; the sidecar relays it and ends the request failed.
                flight.meter.response(now, 400, headers)
                flight.meter.body(orjson.dumps({"error": {"message": str(e), "code": 400}}),
                                  now)
                flight.meter.finish(now)
                flight.ended = True
                del self._flights[plan.request_id]
                flight.session.relayed(RelayOutcome(400, None), now)
                self._record(client, flight.meter, now)
                continue
            flight.meter.response(now, 200, headers)
            self.stability.route(d.backend, d.request.computed_tokens)
            flight.engine, flight.seqs, flight.parsed = engine, seqs, parsed
            self._dispatches += 1
            flight.dispatch_no = self._dispatches
            self._dispatched[plan.request_id] = flight
            if isinstance(parsed, EmbeddingRequest):
                self._pooled.update((seq.request_id, flight) for seq in seqs)
            if engine.front_end.instant:
                for seq in seqs:
                    engine.model.add(seq)
                if not engine.busy:
                    kicked.append(engine)
            else:
                # The emulator's handler submits each sequence in turn (one API server
                # admission each).
                for seq in seqs:
                    self._push(engine.front_end.ready_at(now, engine.model.has_work),
                               _ENTER, (flight, seq))
        for engine in kicked:
            if not engine.busy:
                self._start(engine, now)

    def _enter(self, entry: tuple[_Flight, Sequence], now: float) -> None:
        flight, seq = entry
        if flight.ended:
            return  # aborted while the API server was still on it
        engine = flight.engine
        assert engine is not None
        engine.model.add(seq)
        if not engine.busy:
            self._start(engine, now)

    def _start(self, engine: SimEngine, now: float) -> None:
        end = engine.start_step(now)
        if end is not None:
            self._push_step(end, engine)

    def _push_step(self, t: float, engine: SimEngine) -> None:
        self._order += 1
        heapq.heappush(self._steps, (t, self._order, engine))

    def _poll(self, now: float, replica: int) -> None:
        """``replica``'s scrape of every engine (the stability meter is the first one's)."""
        core = self.cores[replica]
        self._flush()  # the gates count first tokens against each scrape
        stability = self.stability
        for engine in self.engines:
            sample = engine.sample(now)
            core.on_backend_metrics(engine.name, sample)
            if replica == 0:
                generated = sample.generation_tokens_total or 0.0  # the engine's: always there
                stability.observe_backend(engine.name, now,
                                          sample.prompt_tokens_total + generated,
                                          generated, sample.running)
        if replica == 0:
            stability.sample(now)
            if self._watch_every is not None and now >= self._next_watch:
                self._next_watch = now + self._watch_every
                self._watch_utilisation(now)
        self._dispatch(now)
        poll_s = core.poll_period_s()  # learned step times may change it
        if replica == 0:
            self.poll_s = poll_s
        self._push(now + poll_s, _POLL, replica)

    def _sync(self, now: float) -> None:
        """The replicas' exchange (load, and service every SERVICE_SYNC_S), then a dispatch
        pass, as a replica's shell runs one after adopting the others' load."""
        assert self.exchange is not None
        self._flush()  # the load each publishes counts what streamed so far
        self.exchange.tick()
        self._dispatch(now)
        self._push(now + self.exchange.sync_s, _SYNC, None)

    def _watch_utilisation(self, now: float) -> None:
        """Read what /metrics would (not through ``core.stats``: an entry of the core folds
        the held tokens, so watching would change the run it watches)."""
        core, stability = self.core, self.stability
        learned = {b.name: learned_step_s(b.gate) for b in core.fleet}
        budget = step_budget(core.config.admission)
        reading = stability.utilisation(
            now, learned, {b.name for b in core.fleet if b.takes_work},
            current_pools(core.catalog), budget)
        steps = {name: step for name in learned
                 if (step := stability.step_s(name, now, None, budget)) is not None}
        self._utilisation.append(UtilisationSample(
            now, reading.backends, reading.pools, steps,
            sum(tally.queued for c in self.cores for tally in c.ledger.tallies().values()),
            sum(engine.model.num_waiting for engine in self.engines)))

    # ------------------------------------------------------------------ engines -> clients

    def _flush_one(self, flight: _Flight) -> None:
        n = len(flight.times) - flight.reported
        if n and flight.stream:
            flight.reported += n
            flight.core.on_tokens_streamed(flight.request, n, flight.times[-1])

    def _flush(self) -> None:
        """Tell the core of every token streamed so far.

        Live, the sidecar reports each chunk as it passes (``core.on_tokens_streamed(req,
        1, t)``). While nothing is queued no dispatch decision reads what those calls
        change (DRR deficits, the router's outstanding tokens, the gates' first tokens,
        the throughput meter, which only measures while requests wait), so the simulation
        holds them until the core is next consulted (an arrival, a scrape, a request's
        end) and reports each request's tokens in one call: the same sums, a fraction of
        the calls. While requests are queued, tokens are reported step by step as live.
        """
        held = self._held
        if not held:
            return
        self._held = set()
        # In the order they were dispatched, as the core was told before tokens were held
        # per flight (one pass over every flight in the engines).
        for flight in sorted(held, key=_dispatch_order):
            if not flight.ended and len(flight.times) > flight.reported:
                self._flush_one(flight)

    def _queued(self) -> bool:
        """Whether any replica has requests queued (tokens are then reported step by
        step, and nothing coasts)."""
        if len(self.cores) == 1:
            return bool(self._scheduler.queued_requests)
        return any(core.scheduler.queued_requests for core in self.cores)

    def _step_end(self, engine: SimEngine, now: float, order: int, horizon: float) -> int:
        """A step of ``engine`` (its event's order number ``order``) ends at ``now``; no
        event but the engines' steps comes before ``horizon``. Returns how many more steps
        were taken with it (each counts as an event)."""
        if self._coast and not self._queued():
            more = self._coast_steps(engine, now, order, horizon)
            if more is not None:
                return more
        result, following = engine.advance(now)
        if following is not None:
            self._push_step(following, engine)
        flights = self._flights
        if self._queued():
            self._flush()
            for seq in result.emitted:
                flight = flights.get(seq.request_id)
                if flight is not None:
                    flight.times.append(now)
                    if flight.stream:
                        flight.reported += 1
                        flight.core.on_tokens_streamed(flight.request, 1, now)
        elif result.emitted:
            held = self._held
            for seq in result.emitted:
                flight = flights.get(seq.request_id)
                if flight is not None:
                    flight.times.append(now)
                    held.add(flight)
        if result.finished:
            self._finished(result.finished, now)
        return 0

    def _coast_steps(self, engine: SimEngine, now: float, order: int, horizon: float
                     ) -> int | None:
        """Coasting: while tokens are held (nothing queued), a step in which every running
        sequence decodes and none finishes (a plain decode step, ``StepModel.coast_plan``)
        changes nothing but its engine and its flights' chunk times. So the plain steps of
        every engine that end before the first event that is not one (``horizon``, or an
        engine's first step that is not plain) are taken at once, in one
        ``SimEngine.coast`` each: the same states, times and records as one event each
        (tests/unit/simulation/test_coast.py). Each engine's step left in flight is then
        pushed with the order number it would have had. None: ``engine``'s step ending at
        ``now`` is not plain, nothing done."""
        plan = engine.coast_plan(now, horizon)
        if plan is None:
            return None
        # How far everyone may go: not past an engine's first step that is not plain.
        stop = plan.next_end(len(plan.ends))
        limit = min(plan.ends[-1] if stop is None else stop, horizon)
        pending = self._steps
        if not pending or pending[0][0] >= limit:
            # No other engine steps before then (the common case): this one coasts alone.
            n_steps = bisect.bisect_left(plan.ends, limit)
            if n_steps == 0:
                return None
            ends, following = engine.coast(plan, n_steps)
            flights, held = self._flights, self._held
            for seq in plan.running:
                flight = flights.get(seq.request_id)
                if flight is not None:
                    flight.times.extend(ends)
                    held.add(flight)
            self._order += n_steps
            heapq.heappush(pending, (following, self._order, engine))
            return n_steps - 1
        plans = [(now, order, engine, plan)]
        for t, other_order, other in self._steps:
            if t >= limit:
                continue
            other_plan = other.coast_plan(t, limit)
            if other_plan is None:
                limit = t
                continue
            stop = other_plan.next_end(len(other_plan.ends))
            limit = min(limit, other_plan.ends[-1] if stop is None else stop)
            plans.append((t, other_order, other, other_plan))
        coasting = [(t, o, e, p, bisect.bisect_left(p.ends, limit, hi=len(p.ends)))
                    for t, o, e, p in plans]
        if coasting[0][4] == 0:
            return None  # the step at `now` itself is not before the limit
        coasting = [c for c in coasting if c[4]]
        flights, held = self._flights, self._held
        taken = 0
        finals: dict[SimEngine, float] = {}
        for _t, _o, coaster, coaster_plan, n_steps in coasting:
            ends, following = coaster.coast(coaster_plan, n_steps)
            finals[coaster] = following
            taken += n_steps
            for seq in coaster_plan.running:
                flight = flights.get(seq.request_id)
                if flight is not None:
                    flight.times.extend(ends)
                    held.add(flight)
        # The order numbers: each step taken would have pushed the next as it ran, the
        # engines' steps taken in the order of their ends (and order numbers at equal ends).
        moved = {c[2] for c in coasting}
        pending = [s for s in self._steps if s[2] not in moved]
        if len(coasting) == 1:
            self._order += taken
            pending.append((finals[engine], self._order, engine))
        else:
            merge = [(t, o, i, 0) for i, (t, o, _e, _p, _n) in enumerate(coasting)]
            heapq.heapify(merge)
            while merge:
                _t, _o, i, j = heapq.heappop(merge)
                self._order += 1
                _t0, _o0, coaster, coaster_plan, n_steps = coasting[i]
                if j + 1 < n_steps:
                    heapq.heappush(merge, (coaster_plan.ends[j + 1], self._order, i, j + 1))
                else:
                    pending.append((finals[coaster], self._order, coaster))
        heapq.heapify(pending)
        self._steps[:] = pending
        return taken - 1

    def _finished(self, finished: list[Sequence], now: float) -> None:
        for seq in finished:
            if seq.pooling:
                self._pooled_finished(seq, now)
                continue
            flight = self._flights.pop(seq.request_id, None)
            if flight is None:
                continue
            del self._dispatched[seq.request_id]
            self._flush_one(flight)
            flight.ended = True
            meter = flight.meter
            usage: dict[str, Any] = {"prompt_tokens": seq.prompt_tokens,
                                     "completion_tokens": seq.output_tokens}
            cached: int | None = None  # as the sidecar reads usage: None if not reported
            if flight.engine is not None and flight.engine.reports_cached_tokens:
                cached = seq.num_cached_tokens
                usage["prompt_tokens_details"] = {"cached_tokens": cached}
            if flight.client.conversation is not None:
                # A turn's answer, as vLLM returns it: the next turn sends these ids back.
                meter.feed(b'data: {"choices":[{"index":0,"text":"","token_ids":'
                           + orjson.dumps([output_token_id(i) for i in range(seq.output_tokens)])
                           + b"}]}\n\n", now)
            if flight.stream:
                meter.contents(flight.times)
                meter.feed(b'data: {"choices":[],"usage":' + orjson.dumps(usage)
                           + b"}\n\ndata: [DONE]\n\n", now)
            else:
                meter.body(orjson.dumps({"choices": [{"text": "x"}], "usage": usage}), now)
            meter.finish(now)
            # A whole answer's tokens are counted with its usage.
            flight.session.relayed(RelayOutcome(
                200, Usage(seq.prompt_tokens, seq.output_tokens, cached)), now)
            self._record(flight.client, meter, now)
        self._dispatch(now)

    def _pooled_finished(self, seq: Sequence, now: float) -> None:
        """An embeddings input was pooled: the emulator answers when every input of the
        request has been (its handler waits for all of them)."""
        flight = self._pooled.pop(seq.request_id, None)
        if flight is None or not all(s.is_finished for s in flight.seqs):
            return
        request_id = flight.client.plan.request_id
        del self._flights[request_id]
        del self._dispatched[request_id]
        flight.ended = True
        parsed = flight.parsed
        assert isinstance(parsed, EmbeddingRequest)
        # The emulator's answer; the vectors are left empty, as no measurement reads them.
        answer = embeddings_response(parsed, request_id, [[] for _ in flight.seqs])
        flight.meter.body(orjson.dumps(answer), now)
        flight.meter.finish(now)
        usage = answer["usage"]
        flight.session.relayed(RelayOutcome(
            200, Usage(usage["prompt_tokens"], usage["completion_tokens"])), now)
        self._record(flight.client, flight.meter, now)
