"""The sidecar's HTTP face: an OpenAI-compatible proxy that wires requests into the
scheduling core and relays backend answers.

Ownership: the aiohttp application owns one client session, the :class:`BackendPool` (its
poller and prober tasks) and a periodic dispatch tick; all end on shutdown. Each request
handler owns its request from arrival to its single end in the ledger; the dispatcher only
resolves handlers' futures. Everything runs on one event loop, so the core needs no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, disable_created_metrics, generate_latest

from weighbridge import headers as headers_
from weighbridge import output_budget
from weighbridge.config import EMBEDDINGS, Config
from weighbridge.keys import key_digest
from weighbridge.sidecar.backends import BackendPool
from weighbridge.sidecar.core import Dispatch, SchedulingCore
from weighbridge.sidecar.listener import ClientSite, ensure_descriptors, refuse_over_capacity
from weighbridge.sidecar.metrics import SidecarMetrics, StreamedTokens
from weighbridge.sidecar.openapi import DEADLINE_MS, description_json
from weighbridge.sidecar.prefix import PromptPrefix
from weighbridge.sidecar.prompt import PromptError, json_integer, prompt_tokens
from weighbridge.sidecar.proxy import (
    BACKEND_FAILED,
    BackendFailed,
    BackendUnavailable,
    RelayOutcome,
    relay,
    tokens_in_chunks,
)
from weighbridge.sidecar.rejection import MODEL_NOT_FOUND, Reject
from weighbridge.sidecar.request import QueuedRequest
from weighbridge.sidecar.shared import SharedState, SharedStateCollector
from weighbridge.sidecar.stability import StabilityMeter
from weighbridge.sidecar.tracing import NO_TRACE, RequestTracing, Trace
from weighbridge.sidecar.upstream import Upstream
from weighbridge.vllm_metrics import BackendSample

log = logging.getLogger("weighbridge.sidecar")

# The body's integer fields the sidecar reads, as vLLM types them (int64); vLLM's embeddings
# take no stream_interval (nor read it).
_INTEGER_FIELDS = ("max_tokens", "max_completion_tokens", "priority")
_GENERATION_INTEGER_FIELDS = (*_INTEGER_FIELDS, "stream_interval", "n")

# The deepest body the sidecar can forward: orjson writes no deeper.
MAX_BODY_DEPTH = 255
# vLLM's request models bound their integers to int64 (priority explicitly; the others by
# the engine): so does the sidecar, for the fields it reads.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# A request whose backend refuses the connection goes back to the queue this many times.
MAX_DISPATCH_ATTEMPTS = 3
# Idle upstream connections are dropped before the backend drops them: vLLM's uvicorn closes
# keep-alive connections after 5 s, and a request written on a connection the server is
# closing fails as if the backend had died.
UPSTREAM_KEEPALIVE_S = 4.0
# Errors that end a request as failed (a backend's fault), not rejected.
_FAILURES = frozenset({BACKEND_FAILED, "backend_unavailable"})


class ApiError(Exception):
    """An OpenAI-style error answer; ``reason`` also goes in the reject-reason header."""

    def __init__(self, status: int, reason: str, message: str, type_: str,
                 headers: dict[str, str] | None = None, *, close: bool = False,
                 vllm_body: bool = False, param: str | None = None) -> None:
        """``vllm_body``: answer with vLLM's own error body (``param``, and the status as
        ``code``), for the errors a client would have had from vLLM itself."""
        super().__init__(message)
        self.status, self.reason, self.message, self.type = status, reason, message, type_
        self.headers = headers or {}
        self.close = close  # end the connection after answering (its input is unread)
        self.vllm_body, self.param = vllm_body, param

    def response(self) -> web.Response:
        error: dict[str, Any] = {"message": self.message, "type": self.type, "code": self.reason}
        if self.vllm_body:
            error.update(param=self.param, code=self.status)
        body = {"error": error}
        response = web.Response(body=orjson.dumps(body), status=self.status,
                                content_type="application/json",
                                headers={headers_.REJECT_REASON: self.reason, **self.headers})
        if self.close:
            response.force_close()
        return response


def _bad_request(reason: str, message: str) -> ApiError:
    return ApiError(400, reason, message, "invalid_request_error")


def _bearer(request: web.Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        return None
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:  # bytes that are not UTF-8 (kept as surrogates): no key of ours
        return None
    return key


class Sidecar:
    def __init__(self, config: Config, clock: Callable[[], float] = time.monotonic, *,
                 tracing: RequestTracing | None = None) -> None:
        """``tracing``: overrides the one ``config.telemetry`` describes (tests pass an
        in-memory exporter's); None and no OTLP endpoint configured: no tracing."""
        self.config = config
        self.clock = clock
        self.core = SchedulingCore(config)
        self.pool: BackendPool | None = None
        self.session: aiohttp.ClientSession | None = None  # scrapes, probes, model lists
        self.upstream: Upstream | None = None  # the relayed requests (sidecar.upstream)
        self.stability = StabilityMeter()
        # State shared with other replicas (sidecar.shared); None: this process alone.
        self.shared = (SharedState(config.state, self.core, clock=clock)
                       if config.state.backend == "redis" else None)
        self.metrics = self._metrics(None)
        self.tracing = tracing or RequestTracing.from_config(config.telemetry)
        self._waiters: dict[str, asyncio.Future[Dispatch]] = {}
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
        r.add_get("/v1/models", self.models)
        r.add_get("/metrics", self.metrics_endpoint)
        r.add_get("/healthz", self.healthz)
        r.add_get("/readyz", self.readyz)
        r.add_get("/admin/state", self.admin_state)
        r.add_get("/openapi.json", self.openapi)
        self._openapi = description_json(config.tiers)
        self.app.cleanup_ctx.append(self._lifecycle)

    # -- lifecycle ------------------------------------------------------------------------------

    async def _lifecycle(self, _app: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=300,
                                         keepalive_timeout=UPSTREAM_KEEPALIVE_S)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        self.upstream = Upstream(keepalive_s=UPSTREAM_KEEPALIVE_S)
        self.pool = BackendPool(self.config, self.core, self.session, self.upstream, self.wake,
                                self.clock, on_sample=self._on_sample)
        self.metrics = self._metrics(self.pool)
        await self.pool.start()
        if self.shared is not None:
            await self.shared.start()
        tick = asyncio.create_task(self._tick(), name="dispatch-tick")
        try:
            yield
        finally:
            tick.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await tick
            if self.shared is not None:
                await self.shared.stop()
            await self.pool.stop()
            await self.session.close()
            await self.upstream.close()
            if self.tracing is not None:
                # Flushes buffered spans over HTTP: blocking, so off the loop.
                await asyncio.to_thread(self.tracing.shutdown)

    def _metrics(self, pool: BackendPool | None) -> SidecarMetrics:
        metrics = SidecarMetrics(self.core, pool, self.stability, self.clock)
        metrics.registry.register(SharedStateCollector(self.shared))
        return metrics

    def _on_sample(self, backend: str, sample: BackendSample) -> None:
        self.stability.observe_backend(backend, sample.at_s,
                                       sample.prompt_tokens_total + sample.generation_tokens_total)

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
            waiter = self._waiters.pop(dispatch.request.id, None)
            if waiter is None or waiter.done():
                # Its handler is gone without cancelling (cannot happen when handlers cancel
                # on the way out); end it so the ledger stays exact.
                self.core.on_client_gone(dispatch.request, 0, 0, now)
                continue
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
            return e.response()
        except web.HTTPRequestEntityTooLarge:
            return ApiError(413, "body_too_large",
                            f"request body exceeds {self.config.max_body_bytes} bytes",
                            "invalid_request_error").response()
        except web.HTTPException as e:
            if e.status < 400:
                raise
            reason = {404: "not_found", 405: "method_not_allowed"}.get(e.status, "bad_request")
            # A 405 says which methods the resource has (RFC 9110, 15.5.6): aiohttp's
            # exception carries the Allow header.
            allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
            return ApiError(e.status, reason, e.reason, "invalid_request_error",
                            allow).response()
        except ConnectionError:
            raise  # the client went away; nobody to answer
        except Exception:
            # A bug, not a client error: logged (without the body), answered in the API's
            # error shape unless the response has started (then aiohttp drops the
            # connection). The handler's own accounting ran on the way out.
            log.exception("internal error handling %s %s", request.method, request.path)
            if request.writer.output_size > 0:
                raise
            return ApiError(500, "internal_error", "internal error", "server_error").response()

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

    async def admin_state(self, request: web.Request) -> web.Response:
        key = _bearer(request)
        if key is None or (self.config.tenant_for_key(key) is None and not \
                self.config.is_admin_key(key)):
            raise ApiError(401, "unauthorized", "a valid admin API key is required",
                           "authentication_error")
        if not self.config.is_admin_key(key):
            raise ApiError(403, "forbidden", "this key may not read the admin state",
                           "permission_error")
        now = self.clock()
        state: dict[str, Any] = self.core.snapshot(now)
        state["state"] = ({"backend": "local"} if self.shared is None
                          else self.shared.snapshot())
        if self.pool is not None:
            for name, backend in self.pool.states.items():
                sample = backend.last_sample
                state["backends"][name].update({
                    "url": backend.config.url,
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
        self._authenticate(request, count=False)
        assert self.pool is not None and self.session is not None
        pool, session = self.pool, self.session

        async def listing(name: str) -> list[Any] | None:
            try:
                async with session.get(pool.url(name, "/v1/models"),
                                       timeout=aiohttp.ClientTimeout(total=10)) as r:
                    if r.status != 200:
                        return None
                    data = (await r.json(content_type=None))["data"]
                    return data if isinstance(data, list) else None
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                pool.mark_failed(name, f"/v1/models: {e}")
            except (ValueError, KeyError, TypeError):
                pass  # not a model list: that backend adds nothing
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

    def _authenticate(self, request: web.Request, count: bool = True) -> tuple[str, str]:
        """The tenant owning the bearer key and the key's digest (the caller's identity, which
        the client cannot choose, unlike the body's ``user``), or a 401. ``count``: the
        request is one the ledger counts (a generation request), so its rejection is an
        arrival too."""
        key = _bearer(request)
        digest = None if key is None else key_digest(key)
        tenant = None if digest is None else self.config.tenant_for_digest(digest)
        if tenant is None or digest is None:
            if count:
                self.core.rejected_on_arrival("unauthorized")
            raise ApiError(401, "unauthorized", "missing or invalid API key",
                           "authentication_error")
        return tenant, digest

    def _parse(self, endpoint: str, tenant: str, raw: bytes,
               request: web.Request) -> tuple[dict[str, Any], str, float | None, int, int | None]:
        """Validate everything the sidecar relies on; the backend validates the rest."""
        own_tier = self.config.tenants[tenant].tier

        def bad(reason: str, message: str) -> ApiError:
            self.core.rejected_on_arrival(reason, tenant, own_tier)
            return _bad_request(reason, message)

        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise bad("invalid_json", f"malformed JSON body: {e}") from None
        if not isinstance(body, dict):
            raise bad("invalid_body", "the request body must be a JSON object")
        tier = own_tier
        asked = request.headers.get(headers_.TIER)
        if asked is not None:
            asked = asked.strip(" \t")  # HTTP's optional whitespace only
            if asked not in self.config.tiers:
                raise bad("unknown_tier", f"unknown tier {asked!r} in {headers_.TIER}")
            if not self.config.tier_allowed(tenant, asked):
                self.core.rejected_on_arrival("tier_not_allowed", tenant, own_tier)
                raise ApiError(403, "tier_not_allowed",
                               f"tenant may not use tier {asked!r}; its highest is {own_tier!r}",
                               "permission_error")
            tier = asked
        deadline_ms: float | None = None
        raw_deadline = request.headers.get(headers_.DEADLINE_MS)
        if raw_deadline is not None:
            if DEADLINE_MS.fullmatch(raw_deadline) is None:
                raise bad("invalid_deadline",
                          f"{headers_.DEADLINE_MS} must be a positive decimal number of ms")
            deadline_ms = float(raw_deadline)
        for field in _INTEGER_FIELDS if endpoint == EMBEDDINGS else _GENERATION_INTEGER_FIELDS:
            value = body.get(field)
            if value is None:
                continue
            number = json_integer(value)
            # An integer beyond 64 bits reaches us as the parser's float, rounded: -2**63 - 1
            # arrives as -2.0**63, inside the range. No float that large is an exact int64.
            if isinstance(value, float) and abs(value) >= 2.0**63:
                number = None
            if number is None or not INT64_MIN <= number <= INT64_MAX:
                raise bad("invalid_" + field, f"{field} must be a 64-bit integer")
            body[field] = number  # 16.0 is forwarded as 16
        max_tokens = self._output_budget(endpoint, body, bad)
        if endpoint != EMBEDDINGS and body.get("n") is not None and body["n"] < 1:
            raise bad("invalid_n", "n must be at least 1")
        if endpoint != EMBEDDINGS and body.get("stream_interval") is not None \
                and body["stream_interval"] < 1:
            # Live charging counts a streamed chunk's tokens by it (vLLM refuses it too).
            raise bad("invalid_stream_interval", "stream_interval must be at least 1")
        if body.get("stream") is not None and not isinstance(body["stream"], bool):
            raise bad("invalid_stream", "stream must be a boolean")
        user = body.get("user")
        if user is not None and not isinstance(user, str):
            raise bad("invalid_user", "user must be a string")
        # Optional, as in vLLM (a request without it gets the served model); per-model limits
        # key on it, so it must be a string when present.
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise bad("invalid_model", "model must be a string")
        try:
            prompt = prompt_tokens(endpoint, body)
        except PromptError as e:
            raise bad("invalid_prompt", str(e)) from None
        try:
            # What is forwarded must serialise, known before the request takes any budget:
            # orjson reads 1,024 levels of nesting but writes 255.
            orjson.dumps(body)
        except orjson.JSONEncodeError:
            raise bad("invalid_body", f"the request body nests deeper than {MAX_BODY_DEPTH} "
                      "levels") from None
        return body, tier, deadline_ms, prompt, max_tokens

    def _output_budget(self, endpoint: str, body: dict[str, Any],
                       bad: Callable[[str, str], ApiError]) -> int | None:
        """The output tokens a sequence may generate, as vLLM reads the body (None:
        unbounded but by the context); ``max_tokens_limit`` refuses a larger one asked for,
        and is forwarded as the budget of a request that asked for none."""
        if endpoint == EMBEDDINGS:
            return 0  # an embeddings request generates nothing
        chat = endpoint.endswith("/chat/completions")
        field = output_budget.budget_field(chat, body)
        asked = body.get(field)
        if asked is not None and asked < 1:
            raise bad("invalid_max_tokens", f"{field} must be at least 1")
        budget = (asked if asked is not None or chat
                  else output_budget.COMPLETIONS_DEFAULT_MAX_TOKENS)
        limit = self.config.max_tokens_limit
        if limit is None:
            return budget
        if asked is not None and asked > limit:
            raise bad("max_tokens_too_large", f"{field} may be at most {limit}")
        if budget is None or budget > limit:
            # The limit is a cap, not advice: the engine gets it as the request's budget.
            budget = body["max_completion_tokens" if chat else "max_tokens"] = limit
        return budget

    async def _proxy(self, endpoint: str, request: web.Request) -> web.StreamResponse:
        trace = NO_TRACE if self.tracing is None else self.tracing.start(endpoint,
                                                                          request.headers)
        try:
            response = await self._handle(endpoint, request, trace)
        except ApiError as e:
            trace.end("failed" if e.reason in _FAILURES else "rejected", e.status, e.reason)
            raise
        except web.HTTPRequestEntityTooLarge:
            trace.end("rejected", 413, "body_too_large")
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
        tenant, identity = self._authenticate(request)
        try:
            if request.content.is_eof():  # the whole body came with the head: no wait
                raw = await request.read()
            else:
                # A client dribbling its body must not hold a handler and a connection
                # forever.
                async with asyncio.timeout(self.config.client_body_timeout_ms / 1000):
                    raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            self.core.rejected_on_arrival("body_too_large", tenant,
                                          self.config.tenants[tenant].tier)
            raise
        except TimeoutError:
            self.core.rejected_on_arrival("request_timeout", tenant,
                                          self.config.tenants[tenant].tier)
            raise ApiError(408, "request_timeout",
                           f"the request body took longer than {self.config.client_body_timeout_ms}"
                           " ms to arrive", "invalid_request_error", close=True) from None
        body, tier, deadline_ms, prompt, max_tokens = self._parse(endpoint, tenant, raw, request)
        sequences = output_budget.sequences(body)
        prefix = PromptPrefix.of(endpoint, body)
        now = self.clock()
        request_id = f"{self._id_prefix}{next(self._ids):x}"  # unique, without a uuid4 each
        # Offered load counts every request that reaches the checks, admitted or not: an
        # overload that bounded queues turn away is still an overload.
        offered = self.core.offered_tokens(tenant, endpoint, prompt, max_tokens, sequences)
        self.metrics.offer(tenant, tier, offered)
        trace.identify(tenant=tenant, tier=tier, model=body.get("model"),
                       max_tokens=max_tokens, stream=bool(body.get("stream", False)))
        checks_ns = time.time_ns()
        admitted = None
        if self.shared is not None and self.core.serves(body.get("model")):
            # The limits every replica shares: one round trip (None while Redis is out of
            # reach: this replica's share of the limits decides, in the core).
            admitted = await self.shared.admit(
                tenant, endpoint, tier, body.get("model"),
                self.core.shared_estimate(tenant, endpoint, prompt, max_tokens, sequences))
            now = self.clock()
        result = self.core.arrive(
            request_id=request_id, tenant=tenant, tier=tier, endpoint=endpoint,
            prompt_tokens=prompt, max_tokens=max_tokens, sequences=sequences, now=now,
            # Repeat demotion counts by the key, never by the body's `user`, which the client
            # can vary per request to escape it.
            user=identity,
            priority=body.get("priority") or 0,
            deadline_s=self.core.deadline_for(tier, now, deadline_ms),
            model=body.get("model"),
            admitted=admitted,
            prefix=prefix,
        )
        trace.admission(checks_ns, time.time_ns(),
                        result.reason if isinstance(result, Reject) else "queued", offered)
        if isinstance(result, Reject):
            raise self._rejection(result)
        in_system = self.metrics.in_system
        in_system.enter(result.tenant, result.tier, result.arrival_s)
        try:
            return await self._serve(result, body, endpoint, request, trace)
        finally:
            # _serve ends the request (the ledger's single end) on every way out.
            end = self.clock()
            in_system.leave(result.tenant, result.tier, result.arrival_s, end)
            self.metrics.series(result.tenant, result.tier).duration.observe(
                end - result.arrival_s)

    def _rejection(self, reject: Reject) -> ApiError:
        headers = {}
        # None: waiting cannot help; infinite: the predicted wait is unbounded (no throughput
        # measured while requests waited). Neither has a Retry-After.
        if reject.retry_after_s is not None and math.isfinite(reject.retry_after_s):
            headers["Retry-After"] = str(max(1, math.ceil(reject.retry_after_s)))
        if reject.reason == MODEL_NOT_FOUND:
            # As vLLM answers it, so a client sees the same error through the sidecar.
            return ApiError(404, reject.reason, reject.detail, "NotFoundError", headers,
                            vllm_body=True, param="model")
        message = reject.reason.replace("_", " ")
        if reject.detail:
            message = f"{message}: {reject.detail}"
        status = reject.http_status
        type_ = "rate_limit_error" if status == 429 else "server_error"
        return ApiError(status, reject.reason, message, type_, headers)

    async def _serve(self, req: QueuedRequest, body: dict[str, Any], endpoint: str,
                     request: web.Request, trace: Trace) -> web.StreamResponse:
        # Embeddings never stream (vLLM ignores the field there).
        stream = endpoint != EMBEDDINGS and bool(body.get("stream", False))
        options = body.get("stream_options")
        client_wants_usage = (isinstance(options, dict)
                              and bool(options.get("include_usage")))
        streamed = self.metrics.streamed(req.tenant, req.tier, req.prompt_tokens)
        series = self.metrics.series(req.tenant, req.tier)
        tier_interval = self.config.tiers[req.tier].stream_interval or 1
        try:
            for attempt in range(MAX_DISPATCH_ATTEMPTS):
                trace.queued(attempt + 1)
                dispatch = await self._await_dispatch(req)
                now = self.clock()
                series.queue_wait.observe(now - req.arrival_s)
                trace.dispatched(dispatch.backend, dispatch.vllm_priority, dispatch.over_share)
                forwarded = dict(body)
                if dispatch.vllm_priority is None:
                    forwarded.pop("priority", None)
                else:
                    forwarded["priority"] = dispatch.vllm_priority
                assert self.pool is not None and self.upstream is not None
                interval = 1  # a whole answer: its usage is counted at once
                if stream:
                    # Always ask for usage: it settles rate limits and deficits with real counts.
                    forwarded["stream_options"] = {**(options if isinstance(options, dict)
                                                      else {}), "include_usage": True}
                    if tier_interval > (body.get("stream_interval") or 1):
                        forwarded["stream_interval"] = tier_interval
                    # What each chunk carries, as the engine will send them (it takes the
                    # larger of the request's and its own).
                    interval = max(forwarded.get("stream_interval") or 1,
                                   self.pool.states[dispatch.backend].config.stream_interval)
                headers = {
                    headers_.TENANT: req.tenant,
                    headers_.QUEUE_MS: f"{(now - req.arrival_s) * 1000:.1f}",
                    headers_.BACKEND: dispatch.backend,
                }
                first = True
                url = self.pool.url(dispatch.backend, endpoint)
                upstream_headers: dict[str, str] = {}
                trace.backend_call(dispatch.backend, url, upstream_headers)

                chunks = 0

                def on_content(n: int, req: QueuedRequest = req, interval: int = interval) -> None:
                    nonlocal first, chunks
                    t = self.clock()
                    if first:
                        first = False
                        series.ttft.observe(t - req.arrival_s)
                        trace.first_token()
                    tokens = (tokens_in_chunks(chunks + n, interval)
                              - tokens_in_chunks(chunks, interval))
                    chunks += n
                    streamed.tokens(tokens)
                    self.core.on_tokens_streamed(req, tokens, t)

                try:
                    response, outcome = await relay(
                        self.upstream, url, orjson.dumps(forwarded), request, headers,
                        stream=stream, strip_usage_chunk=not client_wants_usage,
                        on_content=on_content, clock=self.clock, upstream_headers=upstream_headers)
                except BackendUnavailable as e:
                    # The request never reached the backend: back to its place in the queue.
                    trace.backend_done(None, str(e))
                    self.pool.mark_failed(dispatch.backend, str(e))
                    self.core.dispatch_failed(req, self.clock())
                    self.wake()
                    continue
                except BackendFailed as e:
                    trace.backend_done(None, str(e))
                    self.pool.mark_failed(dispatch.backend, str(e))
                    self.core.on_failed(req, 0, 0, self.clock())
                    self.wake()
                    raise ApiError(502, BACKEND_FAILED, f"the backend failed before answering: {e}",
                                   "server_error", headers) from None
                except (asyncio.CancelledError, ConnectionError):
                    # The client went away mid-stream; leaving the relay closed the upstream
                    # connection, which aborts the request at the backend.
                    self.core.on_client_gone(req, req.prompt_tokens, req.streamed_output_tokens,
                                             self.clock())
                    self._count_partial(req, trace)
                    self.wake()
                    raise
                except BaseException:
                    self.core.on_failed(req, req.prompt_tokens, req.streamed_output_tokens,
                                        self.clock())
                    self.wake()
                    raise
                self._finish(req, dispatch, outcome, stream, streamed, trace)
                return response
            self.core.on_failed(req, 0, 0, self.clock())
            self.wake()
            raise ApiError(502, "backend_unavailable",
                           f"no backend could be reached in {MAX_DISPATCH_ATTEMPTS} attempts",
                           "server_error", {headers_.TENANT: req.tenant})
        finally:
            streamed.close()  # every way out: its last chunks folded into the counter

    async def _await_dispatch(self, req: QueuedRequest) -> Dispatch:
        waiter: asyncio.Future[Dispatch] = asyncio.get_running_loop().create_future()
        self._waiters[req.id] = waiter
        self.wake()
        try:
            return await waiter
        except asyncio.CancelledError:
            self._waiters.pop(req.id, None)
            now = self.clock()
            if waiter.done() and not waiter.cancelled():
                # Dispatched in the same instant the client left: it never reached a backend.
                self.core.on_client_gone(req, 0, 0, now)
            else:
                self.core.cancel(req.id, now)
            self.wake()
            raise

    def _finish(self, req: QueuedRequest, dispatch: Dispatch, outcome: RelayOutcome,
                stream: bool, streamed: StreamedTokens, trace: Trace) -> None:
        now = self.clock()
        usage = outcome.usage
        trace.backend_done(outcome.status, outcome.error)
        if outcome.client_gone:
            self.core.on_client_gone(req, req.prompt_tokens, req.streamed_output_tokens, now)
            self._count_partial(req, trace)
            trace.end("cancelled", outcome.status)
        elif outcome.status == 200 and not outcome.broken:
            prompt = usage.prompt_tokens if usage else req.prompt_tokens
            output = usage.completion_tokens if usage else req.streamed_output_tokens
            if not stream and usage is not None:
                self.core.on_tokens_streamed(req, output, now)
            reporting = dispatch.backend not in self.core.unreported
            self.core.on_completed(req, prompt, output, now,
                                   usage.cached_tokens if usage else None)
            if reporting and dispatch.backend in self.core.unreported:
                log.warning("backend %s answers without usage.prompt_tokens_details."
                            "cached_tokens (run vLLM with --enable-prompt-tokens-details): "
                            "its prompts are charged and routed as if nothing were cached",
                            dispatch.backend)
            self._count_tokens(req, prompt, output)
            streamed.settle(prompt, output)
            trace.usage(prompt, output)
        else:
            if outcome.broken:
                assert self.pool is not None
                self.pool.mark_failed(dispatch.backend, outcome.error or "stream broke")
                self._count_partial(req, trace)
            self.core.on_failed(req, req.prompt_tokens if outcome.broken else 0,
                                req.streamed_output_tokens, now)
            # A backend's own error answer (4xx/5xx) passes through: the request failed.
            trace.end("failed", outcome.status,
                      BACKEND_FAILED if outcome.broken else f"backend_{outcome.status}")
        self.wake()

    def _count_tokens(self, req: QueuedRequest, prompt: int, output: int) -> None:
        series = self.metrics.series(req.tenant, req.tier)
        if prompt:
            series.prompt.inc(prompt)
        if output:
            series.output.inc(output)

    def _count_partial(self, req: QueuedRequest, trace: Trace) -> None:
        """Tokens a cut-off stream delivered: what passed through (one per content chunk)
        and, once the first came back, its prompt."""
        streamed = req.streamed_output_tokens
        prompt = req.prompt_tokens if streamed else 0
        self._count_tokens(req, prompt, streamed)
        trace.usage(prompt, streamed)


def run_sidecar(config: Config, host: str, port: int) -> None:
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
    sidecar = Sidecar(config)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
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
