"""The sidecar's HTTP face: an OpenAI-compatible proxy that wires requests into the
scheduling core and relays backend answers. The rules of a request's ingress and of its end
are ``sidecar/session.py``'s (which the simulator drives too); this module does the I/O
around them: reading the body, waiting for the dispatch, the relay, metrics and traces.

Ownership: the aiohttp application owns one client to the backends (sidecar.upstream: the
relay, scrapes, probes and model lists), the :class:`BackendPool` (its poller and prober
tasks) and a periodic dispatch tick; all end on shutdown. Each request
handler owns its request from arrival to its single end in the ledger; the dispatcher only
resolves handlers' futures. Everything runs on one event loop, so the core needs no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import multiprocessing
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, disable_created_metrics, generate_latest

from weighbridge.endpoints import EndpointKind
from weighbridge.redaction import redact_url
from weighbridge.sidecar.backends import BackendPool
from weighbridge.sidecar.config import EMBEDDINGS, Config, ConfigError
from weighbridge.sidecar.core import Dispatch, SchedulingCore
from weighbridge.sidecar.engine_policy import (
    EnginePolicies,
    EnginePolicyCollector,
    policy_of_server_info,
)
from weighbridge.sidecar.listener import ClientSite, ensure_descriptors, refuse_over_capacity
from weighbridge.sidecar.metrics import SidecarMetrics, StreamedTokens
from weighbridge.sidecar.openapi import description_json
from weighbridge.sidecar.proxy import BackendFailed, BackendUnavailable, relay
from weighbridge.sidecar.quotas import DurableQuotas, QuotaFileCollector
from weighbridge.sidecar.rejection import TENANT_REMOVED, Reject
from weighbridge.sidecar.reload import (
    ConfigCollector,
    ConfigHolder,
    ReloadPlan,
    ReloadRefused,
    read_config,
)
from weighbridge.sidecar.reload import plan as reload_plan
from weighbridge.sidecar.request import QueuedRequest
from weighbridge.sidecar.session import (
    MAX_DISPATCH_ATTEMPTS,
    ApiError,
    End,
    Ingress,
    RelayOutcome,
    RequestSession,
    bearer,
    body_too_large,
    rejection,
)
from weighbridge.sidecar.shared import SharedState, SharedStateCollector
from weighbridge.sidecar.stability import StabilityMeter
from weighbridge.sidecar.tokenizer import PromptTokenizers, TokenizerCollector
from weighbridge.sidecar.tracing import NO_TRACE, RequestTracing, Trace
from weighbridge.sidecar.upstream import Upstream, UpstreamConnectError, UpstreamError
from weighbridge.vllm_metrics import BackendSample

log = logging.getLogger("weighbridge.sidecar")

# Idle upstream connections are dropped before the backend drops them: vLLM's uvicorn closes
# keep-alive connections after 5 s, and a request written on a connection the server is
# closing fails as if the backend had died.
UPSTREAM_KEEPALIVE_S = 4.0
# A backend's /v1/models answered to a client's listing: longer than a probe, as the client
# waits for the whole fleet's list anyway.
MODELS_TIMEOUT_S = 10.0
# Reads of an engine's /server_info at start-up while it does not answer (1 + 2 + ... s).
POLICY_READS = 6
# A config file at least this large is read in a process of its own on reload: from about
# 100 tenants on, its pure-Python YAML costs more CPU than a new interpreter does
# (benchmarks/RESULTS.md, reload_ttft).
PROCESS_READ_BYTES = 32 * 1024


def _quota_file(config: Config, config_path: str | None) -> Path | None:
    """Where the day and month limits' levels are kept (``state.quota_file``): None with
    shared state (Redis keeps them), without a configuration file, or when disabled."""
    name = config.state.quota_file
    if config.state.backend != "local" or name is None or config_path is None:
        return None
    return Path(config_path).parent / name  # an absolute name stays as it is


def _priority_flags(config: Config) -> dict[str, bool]:
    return {b.name: b.priority_scheduling for b in config.backends}


def _file_bytes(path: str) -> int:
    """The file's size; 0 when unreadable (the read reports why)."""
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _answer(error: ApiError) -> web.Response:
    """``error`` as the HTTP answer."""
    response = web.Response(body=error.body(), status=error.status,
                            content_type="application/json", headers=error.response_headers())
    if error.close:
        response.force_close()
    return response


class Sidecar:
    def __init__(self, config: Config, clock: Callable[[], float] = time.monotonic, *,
                 tracing: RequestTracing | None = None, config_path: str | None = None) -> None:
        """``tracing``: overrides the one ``config.telemetry`` describes (tests pass an
        in-memory exporter's); None and no OTLP endpoint configured: no tracing.
        ``config_path``: the file ``config`` was read from, which a reload reads again."""
        # The configuration in force, swapped by a reload (sidecar.reload): read it through
        # ``self.config`` at each use, never keep a part of it.
        self.holder = ConfigHolder(config, config_path)
        self._reloading = asyncio.Lock()
        self._background: set[asyncio.Task[None]] = set()
        self.clock = clock
        self.core = SchedulingCore(config)
        self.ingress = Ingress(config, self.core)  # every request's checks (sidecar.session)
        self.pool: BackendPool | None = None
        # Every request to a backend: relay, scrapes, probes, model lists (sidecar.upstream).
        self.upstream: Upstream | None = None
        self.stability = StabilityMeter()
        # State shared with other replicas (sidecar.shared); None: this process alone.
        self.shared = (SharedState(config.state, self.core, clock=clock)
                       if config.state.backend == "redis" else None)
        # The day and month limits' levels in a file, where this process runs alone.
        quota_file = _quota_file(config, config_path)
        self.quotas = (None if quota_file is None else DurableQuotas(
            quota_file, self.core, clock, config.state.quota_reserve_ahead))
        # Whether each engine runs the policy its priority_scheduling says (sidecar.engine_policy).
        self.engine_policies = EnginePolicies(_priority_flags(config))
        # Text prompts counted by the served model's tokenizer, where a model names one.
        self.tokenizers = PromptTokenizers(lambda: self.config)
        self.metrics = self._metrics(None)
        self.tracing = tracing or RequestTracing.from_config(config.telemetry)
        self._waiters: dict[str, tuple[asyncio.Future[Dispatch], RequestSession]] = {}
        # Request ids: this process's random prefix and a counter.
        self._id_prefix = uuid.uuid4().hex[:16]
        self._ids = itertools.count()
        self._dispatch_scheduled = False
        self.app = web.Application(client_max_size=config.max_body_bytes,
                                   middlewares=[self._errors])
        r = self.app.router
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_post(EMBEDDINGS, self.embeddings)
        for kind in (EndpointKind.POOLING, EndpointKind.CLASSIFY, EndpointKind.SCORE,
                     EndpointKind.RERANK):
            for path in kind.paths:  # each proxied as its kind (sidecar.session)
                r.add_post(path, functools.partial(self._proxy, kind.value))
        r.add_get("/v1/models", self.models)
        r.add_get("/metrics", self.metrics_endpoint)
        r.add_get("/healthz", self.healthz)
        r.add_get("/readyz", self.readyz)
        r.add_get("/admin/state", self.admin_state)
        r.add_post("/admin/reload", self.admin_reload)
        r.add_get("/openapi.json", self.openapi)
        self._openapi = description_json(config.tiers)
        self.app.cleanup_ctx.append(self._lifecycle)

    @property
    def config(self) -> Config:
        return self.holder.config

    # -- reload ---------------------------------------------------------------------------------

    async def reload(self) -> ReloadPlan:
        """Read the config file again and put it in force, between two dispatch passes
        (sidecar.reload); raises ``ConfigError`` and changes nothing if it is invalid or
        changes what only a restart can. A large file is read and validated in a process of
        its own (its YAML is seconds of pure Python: on the loop or in a thread it stalls
        every stream), a small one in a thread (a new interpreter costs more than it);
        either is compared with the configuration in force in a thread and swapped in on
        the loop, in one step; reloads take turns."""
        async with self._reloading:
            started = time.perf_counter()
            read = None
            if self.holder.path is not None and _file_bytes(self.holder.path) >= \
                    PROCESS_READ_BYTES:
                # A fresh interpreter each time (spawn: no fork of a process with threads
                # and an event loop), gone once it answers: no process idles between reloads.
                reader = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
                try:
                    read = await asyncio.get_running_loop().run_in_executor(
                        reader, read_config, self.holder.path)
                finally:
                    reader.shutdown(wait=False)
            new, plan = await asyncio.to_thread(self.holder.check,
                                                frozenset(self.core.draining), read)
            return self._put_in_force(new, plan, time.perf_counter() - started)

    def _put_in_force(self, new: Config, plan: ReloadPlan, checked_s: float) -> ReloadPlan:
        started = time.perf_counter()
        evicted = self.core.reconfigure(new, self.clock())
        self.holder.adopt(new, plan.version)
        if self.pool is not None:
            self.pool.reconfigure(new)
        self.engine_policies.reconfigure(_priority_flags(new))
        if self.upstream is not None:
            self._in_background(self._read_policies())  # an added backend's, or a flag's
        self.ingress.config = new
        removed = Reject(TENANT_REMOVED, None, "a configuration reload removed this request's "
                         "tenant")
        for request in evicted:  # ended in the core; their handlers answer
            waiting = self._waiters.pop(request.id, None)
            if waiting is not None and not waiting[0].done():
                waiting[0].set_exception(rejection(removed))
        log.info("config %s reloaded (version %s; read and checked in %.1f ms, applied in "
                 "%.1f ms): %s", self.holder.path, self.holder.version,
                 checked_s * 1e3, (time.perf_counter() - started) * 1e3, plan.summary())
        self.wake()
        return plan

    async def put_in_force(self, new: Config, source: str) -> ReloadPlan:
        """``new``, made in code rather than read from the file (the picker's discovered
        backends: sidecar.discovery), put in force as a reload puts the file's, in turn with
        reloads; raises ``ReloadRefused`` as a reload does, changing nothing."""
        async with self._reloading:
            started = time.perf_counter()
            checked = await asyncio.to_thread(reload_plan, self.config, new,
                                              frozenset(self.core.draining), source)
            return self._put_in_force(new, checked, time.perf_counter() - started)

    def reload_on_signal(self) -> None:
        """SIGHUP: a reload whose refusal is logged (there is nobody else to tell)."""
        self._in_background(self._reload_logged())

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)  # held until done: the loop keeps only a weak reference
        task.add_done_callback(self._background.discard)

    async def _read_policies(self) -> None:
        """Each engine's scheduling policy from its /server_info, where it serves one (vLLM
        with VLLM_SERVER_DEV_MODE=1), against its priority_scheduling."""
        assert self.pool is not None and self.upstream is not None
        pool, upstream = self.pool, self.upstream

        async def read(name: str) -> None:
            if self.engine_policies.backends[name].source == "server_info":
                return  # read already
            for attempt in range(POLICY_READS):
                try:
                    status, body = await upstream.get(
                        pool.url(name, "/server_info?config_format=json"), MODELS_TIMEOUT_S)
                    break
                except (TimeoutError, UpstreamError, UpstreamConnectError, OSError):
                    await asyncio.sleep(2.0 ** attempt)  # an engine still starting
                except KeyError:
                    return  # reloaded away
            else:
                return  # never reached: the first refusal, if any, tells
            policy = policy_of_server_info(body) if status == 200 else None
            if policy is not None:
                self._policy_seen(self.engine_policies.learned(name, policy, "server_info"))

        await asyncio.gather(*(read(name) for name in list(self.engine_policies.backends)))

    def quota_admission(self, tenant: str, endpoint: str, tier: str, model: str | None,
                        tokens: int) -> contextlib.AbstractAsyncContextManager[None]:
        """Admit (``ingress.arrive``) inside this, every front alike: the day and month levels
        the request needs are in the quota file first (sidecar.quotas); without one, nothing."""
        if self.quotas is None or not self.core.serves(model):
            return contextlib.nullcontext()
        return self.quotas.admission(tenant, endpoint, tier, model, tokens)

    def _policy_seen(self, warning: str | None) -> None:
        if warning is not None:
            log.warning("%s", warning)

    async def _reload_logged(self) -> None:
        try:
            await self.reload()
        except ConfigError as e:
            log.error("config reload refused, the configuration in force stays:\n%s", e)

    async def admin_reload(self, request: web.Request) -> web.Response:
        self._admin(request, "this key may not reload the configuration")
        try:
            plan = await self.reload()
        except ConfigError as e:
            log.error("config reload refused, the configuration in force stays:\n%s", e)
            if isinstance(e, ReloadRefused):
                raise ApiError(409, "restart_required", str(e), "invalid_request_error") from None
            raise ApiError(422, "invalid_config", str(e), "invalid_request_error") from None
        return web.Response(body=orjson.dumps({**self.holder.snapshot(),
                                               "changes": plan.as_dict()}),
                            content_type="application/json")

    # -- lifecycle ------------------------------------------------------------------------------

    async def _lifecycle(self, _app: web.Application) -> AsyncIterator[None]:
        self.upstream = Upstream(keepalive_s=UPSTREAM_KEEPALIVE_S)
        self.pool = BackendPool(self.config, self.core, self.upstream, self.wake, self.clock,
                                on_sample=self._on_sample)
        self.metrics = self._metrics(self.pool)
        await self.pool.start()
        self.tokenizers.start()
        if self.shared is not None:
            await self.shared.start()
        if self.quotas is not None:
            await self.quotas.start()
        self._in_background(self._read_policies())
        tick = asyncio.create_task(self._tick(), name="dispatch-tick")
        try:
            yield
        finally:
            tick.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await tick
            if self.shared is not None:
                await self.shared.stop()
            if self.quotas is not None:
                await self.quotas.stop()
            await self.pool.stop()
            self.tokenizers.stop()
            await self.upstream.close()
            if self.tracing is not None:
                # Flushes buffered spans over HTTP: blocking, so off the loop.
                await asyncio.to_thread(self.tracing.shutdown)

    def _metrics(self, pool: BackendPool | None) -> SidecarMetrics:
        metrics = SidecarMetrics(self.core, pool, self.stability, self.clock)
        metrics.registry.register(SharedStateCollector(self.shared))
        metrics.registry.register(QuotaFileCollector(self.quotas))
        metrics.registry.register(EnginePolicyCollector(self.engine_policies))
        metrics.registry.register(ConfigCollector(self.holder))
        metrics.registry.register(TokenizerCollector(self.tokenizers))
        return metrics

    def _on_sample(self, backend: str, sample: BackendSample) -> None:
        generated = sample.generation_tokens_total or 0.0  # a parsed scrape always has it
        self.stability.observe_backend(backend, sample.at_s,
                                       sample.prompt_tokens_total + generated, generated,
                                       sample.running)

    async def _tick(self) -> None:
        # Gates reopen with time alone (metrics go stale, the fallback cap applies). Every
        # queued request has a waiter: with none, there is nothing a pass could dispatch.
        while True:
            await asyncio.sleep(self.core.poll_period_s())
            self.stability.sample(self.clock())
            if self._waiters:
                self.wake()

    # -- the dispatcher ---------------------------------------------------------------------------

    def wake(self) -> None:
        """Ask for a dispatch pass soon; many events in one loop turn cost one pass."""
        if not self._dispatch_scheduled:
            self._dispatch_scheduled = True
            asyncio.get_running_loop().call_soon(self._dispatch_pass)

    def _dispatch_pass(self) -> None:
        self._dispatch_scheduled = False
        now = self.clock()
        for dispatch in self.core.dispatch_ready(now):
            waiting = self._waiters.pop(dispatch.request.id, None)
            if waiting is None:
                # Its handler is gone without cancelling (cannot happen when handlers cancel
                # on the way out); end it so the ledger stays exact.
                self.core.on_client_gone(dispatch.request, 0, 0, now)
                continue
            waiter, session = waiting
            if waiter.done():
                session.client_gone(now)  # as above: it never reached a backend
                continue
            self.metrics.routed(dispatch.backend, dispatch.request.computed_tokens)
            waiter.set_result(dispatch)

    # -- middleware and small endpoints ---------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        refused = refuse_over_capacity(request)
        if refused is not None:
            return refused
        try:
            return await handler(request)
        except ApiError as e:
            return _answer(e)
        except web.HTTPRequestEntityTooLarge:
            return _answer(body_too_large(self.config.max_body_bytes))
        except web.HTTPException as e:
            if e.status < 400:
                raise
            reason = {404: "not_found", 405: "method_not_allowed"}.get(e.status, "bad_request")
            # A 405 says which methods the resource has (RFC 9110, 15.5.6): aiohttp's
            # exception carries the Allow header.
            allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
            return _answer(ApiError(e.status, reason, e.reason, "invalid_request_error", allow))
        except ConnectionError:
            raise  # the client went away; nobody to answer
        except Exception:
            # A bug, not a client error: logged (without the body), answered in the API's
            # error shape unless the response has started (then aiohttp drops the
            # connection). The handler's own accounting ran on the way out.
            log.exception("internal error handling %s %s", request.method, request.path)
            if request.writer.output_size > 0:
                raise
            return _answer(ApiError(500, "internal_error", "internal error", "server_error"))

    async def healthz(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def openapi(self, _request: web.Request) -> web.Response:
        return web.Response(body=self._openapi, content_type="application/json")

    async def readyz(self, _request: web.Request) -> web.Response:
        ready = self.pool is not None and self.pool.any_healthy()
        return web.json_response({"ready": ready}, status=200 if ready else 503)

    async def metrics_endpoint(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _admin(self, request: web.Request, forbidden: str) -> None:
        """401 without a known key, 403 with a tenant's."""
        key = bearer(request.headers.get("authorization"))
        if key is None or (self.config.tenant_for_key(key) is None and not \
                self.config.is_admin_key(key)):
            raise ApiError(401, "unauthorized", "a valid admin API key is required",
                           "authentication_error")
        if not self.config.is_admin_key(key):
            raise ApiError(403, "forbidden", forbidden, "permission_error")

    async def admin_state(self, request: web.Request) -> web.Response:
        self._admin(request, "this key may not read the admin state")
        now = self.clock()
        state: dict[str, Any] = self.core.snapshot(now)
        state["config"] = self.holder.snapshot()
        state["state"] = ({"backend": "local"} if self.shared is None
                          else self.shared.snapshot())
        if self.quotas is not None:
            state["state"]["quota_file"] = self.quotas.snapshot()
        if self.pool is not None:
            for name, backend in self.pool.states.items():
                if name not in state["backends"]:
                    continue  # drained, leaving the pool at its next probe
                sample = backend.last_sample
                state["backends"][name].update({
                    "url": redact_url(backend.config.url),
                    "scheduling_policy": self.engine_policies.backends[name].snapshot()
                    if name in self.engine_policies.backends else None,
                    "healthy": backend.healthy,
                    "scrape_errors": backend.scrape_errors,
                    "last_scrape": None if sample is None else {
                        "age_s": now - sample.at_s, "waiting": sample.waiting,
                        "running": sample.running, "kv_cache_usage": sample.kv_cache_usage},
                })
        return web.Response(body=orjson.dumps(state, default=str),
                            content_type="application/json")

    async def models(self, request: web.Request) -> web.Response:
        """Every model the healthy backends serve (base models and adapters), each listed
        once, in backend order: the fleet as one vLLM server would list it."""
        self.ingress.authenticate(request.headers, counted=False)
        assert self.pool is not None
        pool = self.pool

        async def listing(name: str) -> list[Any] | None:
            try:
                return await pool.models_of(name, MODELS_TIMEOUT_S)
            except (TimeoutError, UpstreamError, UpstreamConnectError, OSError) as e:
                pool.mark_failed(name, f"/v1/models: {e}")
            except (ValueError, KeyError, TypeError):
                pass  # not 200, or not a model list: that backend adds nothing
            return None

        healthy = [name for name, state in pool.states.items() if state.healthy]
        listings = await asyncio.gather(*(listing(name) for name in healthy))
        if all(found is None for found in listings):
            raise ApiError(503, "no_backend", "no healthy backend", "server_error")
        cards: dict[str, Any] = {}
        for found in listings:
            for card in found or ():
                if isinstance(card, dict) and isinstance(card.get("id"), str):
                    cards.setdefault(card["id"], card)
        return web.Response(body=orjson.dumps({"object": "list", "data": list(cards.values())}),
                            content_type="application/json")

    # -- the proxied endpoints --------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy("/v1/completions", request)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy("/v1/chat/completions", request)

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(EMBEDDINGS, request)

    async def _proxy(self, endpoint: str, request: web.Request) -> web.StreamResponse:
        trace = NO_TRACE if self.tracing is None else self.tracing.start(endpoint,
                                                                          request.headers)
        try:
            response = await self._handle(endpoint, request, trace)
        except ApiError as e:
            trace.end(e.outcome, e.status, e.reason)
            raise
        except (asyncio.CancelledError, ConnectionError):
            trace.end("cancelled")
            raise
        except BaseException:
            trace.end("failed", 500, "internal_error")
            raise
        trace.end("completed", response.status)  # unless _finish ended it otherwise
        return response

    async def _handle(self, endpoint: str, request: web.Request,
                      trace: Trace) -> web.StreamResponse:
        ingress = self.ingress
        caller = ingress.authenticate(request.headers)
        try:
            if request.content.is_eof():  # the whole body came with the head: no wait
                raw = await request.read()
            else:
                # A client dribbling its body must not hold a handler and a connection
                # forever.
                async with asyncio.timeout(self.config.client_body_timeout_ms / 1000):
                    raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ingress.refused(caller, body_too_large(self.config.max_body_bytes)) from None
        except TimeoutError:
            raise ingress.body_timeout(caller) from None
        arrival = ingress.read(caller, endpoint, request.headers, raw)
        # Off the loop, and before the request takes any budget: its count is the engine's.
        ids = await self.tokenizers.tokenize(
            self.core.request_model(arrival.model) or self.core.catalog.default_model(),
            caller.tenant, endpoint, arrival.body)
        if ids is not None:
            arrival.tokenized(ids)
        tenant, tier, model = caller.tenant, arrival.tier, arrival.model
        prompt, max_tokens, sequences = (arrival.prompt_tokens, arrival.max_tokens,
                                         arrival.sequences)
        request_id = self.request_id()
        # Offered load counts every request that reaches the checks, admitted or not: an
        # overload that bounded queues turn away is still an overload.
        offered = self.core.estimated_tokens(tenant, endpoint, prompt, max_tokens, sequences, model)
        self.metrics.offer(tenant, tier, offered,
                           self.core.catalog.backends_for(self.core.request_model(model)))
        trace.identify(tenant=tenant, tier=tier, model=model, max_tokens=max_tokens,
                       stream=bool(arrival.body.get("stream", False)))
        checks_ns = time.time_ns()
        admitted = None
        if self.shared is not None and self.core.serves(model):
            # The limits every replica shares: one round trip (None while Redis is out of
            # reach: this replica's share of the limits decides, in the core).
            admitted = await self.shared.admit(tenant, endpoint, tier, model, offered)
        try:
            # The arrival is stamped after the checks that wait (Redis, the quota file).
            async with self.quota_admission(tenant, endpoint, tier, model, offered):
                session = ingress.arrive(arrival, request_id, self.clock(), admitted)
        except ApiError as e:
            trace.admission(checks_ns, time.time_ns(), e.reason, offered)
            raise
        trace.admission(checks_ns, time.time_ns(), "queued", offered)
        req = session.request
        in_system = self.metrics.in_system
        in_system.enter(req.tenant, req.tier, req.arrival_s)
        try:
            return await self._serve(session, request, trace)
        finally:
            # _serve ends the request (the ledger's single end) on every way out.
            end = self.clock()
            in_system.leave(req.tenant, req.tier, req.arrival_s, end)
            self.metrics.series(req.tenant, req.tier).duration.observe(end - req.arrival_s)

    async def _serve(self, session: RequestSession, request: web.Request,
                     trace: Trace) -> web.StreamResponse:
        req = session.request
        streamed = self.metrics.streamed(req.tenant, req.tier, req.prompt_tokens)
        series = self.metrics.series(req.tenant, req.tier)
        try:
            for attempt in range(MAX_DISPATCH_ATTEMPTS):
                trace.queued(attempt + 1)
                dispatch = await self._await_dispatch(session)
                now = self.clock()
                series.queue_wait.observe(now - req.arrival_s)
                trace.dispatched(dispatch.backend, dispatch.vllm_priority, dispatch.over_share)
                assert self.pool is not None and self.upstream is not None
                forward = session.dispatched(
                    dispatch, now, self.pool.states[dispatch.backend].config.stream_interval)
                first = True
                url = self.pool.url(dispatch.backend, session.arrival.endpoint)
                upstream_headers: dict[str, str] = {}
                trace.backend_call(dispatch.backend, url, upstream_headers)

                def on_content(n: int) -> None:
                    nonlocal first
                    t = self.clock()
                    if first:
                        first = False
                        series.ttft.observe(t - req.arrival_s)
                        trace.first_token()
                    streamed.tokens(session.chunks(n, t))

                try:
                    response, outcome = await relay(
                        self.upstream, url, orjson.dumps(forward.body), request, forward.headers,
                        stream=session.stream, strip_usage_chunk=not session.client_wants_usage,
                        on_content=on_content, clock=self.clock, upstream_headers=upstream_headers)
                except BackendUnavailable as e:
                    # The request never reached the backend: back to its place in the queue.
                    trace.backend_done(None, str(e))
                    self.pool.mark_failed(dispatch.backend, str(e))
                    session.unreachable(self.clock())
                    self.wake()
                    continue
                except BackendFailed as e:
                    trace.backend_done(None, str(e))
                    self.pool.mark_failed(dispatch.backend, str(e))
                    error = session.backend_failed(str(e), forward.headers, self.clock())
                    self.wake()
                    raise error from None
                except (asyncio.CancelledError, ConnectionError):
                    # The client went away mid-stream; leaving the relay closed the upstream
                    # connection, which aborts the request at the backend.
                    self._count(req, session.client_gone(self.clock()), trace)
                    self.wake()
                    raise
                except BaseException:
                    session.crashed(self.clock())
                    self.wake()
                    raise
                if dispatch.vllm_priority and isinstance(response, web.Response) and \
                        isinstance(response.body, bytes):
                    # An engine that refuses priorities shows it runs fcfs (engine_policy).
                    self._policy_seen(self.engine_policies.answered(
                        dispatch.backend, outcome.status, response.body))
                self._finish(session, dispatch, outcome, streamed, trace)
                return response
            error = session.given_up(self.clock())
            self.wake()
            raise error
        finally:
            streamed.close()  # every way out: its last chunks folded into the counter

    def request_id(self) -> str:
        """A new request's id: unique, without a uuid4 each."""
        return f"{self._id_prefix}{next(self._ids):x}"

    async def await_dispatch(self, session: RequestSession) -> Dispatch:
        """The dispatch of ``session``'s queued request (another front's wait too: the EPP,
        sidecar/epp.py); cancelled, the request leaves the queue or ends unsent."""
        return await self._await_dispatch(session)

    async def _await_dispatch(self, session: RequestSession) -> Dispatch:
        waiter: asyncio.Future[Dispatch] = asyncio.get_running_loop().create_future()
        request_id = session.request.id
        self._waiters[request_id] = (waiter, session)
        self.wake()
        try:
            return await waiter
        except asyncio.CancelledError:
            self._waiters.pop(request_id, None)
            # Out of the queue, or, dispatched in the same instant, ended unsent.
            session.client_gone(self.clock())
            self.wake()
            raise

    def _finish(self, session: RequestSession, dispatch: Dispatch, outcome: RelayOutcome,
                streamed: StreamedTokens, trace: Trace) -> None:
        now = self.clock()
        trace.backend_done(outcome.status, outcome.error)
        end = session.relayed(outcome, now)
        if end.backend_fault is not None:
            assert self.pool is not None
            self.pool.mark_failed(dispatch.backend, end.backend_fault)
        if end.unreported:
            log.warning("backend %s answers without usage.prompt_tokens_details."
                        "cached_tokens (run vLLM with --enable-prompt-tokens-details): "
                        "its prompts are charged and routed as if nothing were cached",
                        dispatch.backend)
        self._count(session.request, end, trace)
        if end.outcome == "completed":
            assert end.tokens is not None
            streamed.settle(*end.tokens)
        else:
            trace.end(end.outcome, end.status, end.reason)
        self.wake()

    def _count(self, req: QueuedRequest, end: End, trace: Trace) -> None:
        """The tokens the client got, into the tenant's counters and the trace."""
        self.count_tokens(req, end)
        if end.tokens is not None:
            trace.usage(*end.tokens)

    def count_tokens(self, req: QueuedRequest, end: End) -> None:
        """The tokens the client got, into the tenant's counters (every front alike)."""
        if end.tokens is None:
            return
        prompt, output = end.tokens
        series = self.metrics.series(req.tenant, req.tier)
        if prompt:
            series.prompt.inc(prompt)
        if output:
            series.output.inc(output)


def run_sidecar(config: Config, host: str, port: int, config_path: str | None = None) -> None:
    """Serve until SIGINT or SIGTERM; SIGHUP reloads ``config_path`` (sidecar.reload)."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    for warning in config.warnings:
        log.warning("config: %s", warning)
    # No `<name>_created` series beside every counter and histogram: they double the
    # exposition and Prometheus stores them as gauges of their own.
    disable_created_metrics()
    sidecar = Sidecar(config, config_path=config_path)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    loop.add_signal_handler(signal.SIGHUP, sidecar.reload_on_signal)
    main = loop.create_task(_serve(sidecar, host, port))
    # As aiohttp's run_app: SIGINT and SIGTERM end the serving task (GracefulExit), which
    # closes the listener, lets answers in flight finish and runs the app's cleanup.
    try:
        loop.run_until_complete(main)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        if not main.done():
            main.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                loop.run_until_complete(main)
        close_loop(loop)


def close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel and await every task left on a serving front's loop, then close it."""
    rest = asyncio.all_tasks(loop)
    for task in rest:
        task.cancel()
    loop.run_until_complete(asyncio.gather(*rest, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


async def _serve(sidecar: Sidecar, host: str, port: int) -> None:
    config = sidecar.config
    keepalive_s = config.client_timeout_ms / 1000
    ensure_descriptors(config.max_client_connections)
    # handler_cancellation: a client that disconnects cancels its handler, which takes a
    # queued request out of the queue at once or aborts its backend request. keepalive_timeout
    # also bounds how long a new connection may take to send its headers: a connection still
    # waiting for a complete request is closed at that time.
    runner = web.AppRunner(sidecar.app, handle_signals=True, access_log=None,
                           handler_cancellation=True, keepalive_timeout=keepalive_s)
    await runner.setup()
    try:
        await ClientSite(runner, host, port, max_connections=config.max_client_connections,
                         keepalive_timeout=keepalive_s).start()
        while True:
            await asyncio.sleep(3600)
    finally:
        await runner.cleanup()
