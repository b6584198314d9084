"""The scheduler as an endpoint picker: an Envoy external processor
(``envoy.service.ext_proc.v3.ExternalProcessor/Process``) speaking the Gateway API Inference
Extension's endpoint-picker protocol (docs/deploy-kubernetes.md; the choice of body modes is
docs/decisions/0013).

A thin shell, as ``sidecar/app.py`` is for HTTP: every rule of a request's ingress and end is
``sidecar/session.py``'s, every decision the :class:`SchedulingCore`'s, and the process runs
the sidecar's own :class:`Sidecar` (its backend pool, dispatcher, shared state, reload and
``/metrics``) beside the gRPC server. Per request the picker:

- authenticates on the request headers (401 at once, before the body);
- reads the whole body and passes the ingress checks (4xx before the request takes a slot);
- holds the request until the core dispatches it (late binding), then sets
  ``x-gateway-destination-endpoint`` to that backend's single ``ip:port``, as a header and in
  ``dynamic_metadata["envoy.lb"]``, and sends the body as the sidecar would forward it;
- answers ``ImmediateResponse`` 429 (or the sidecar's other refusals) to shed and 503 when no
  endpoint is eligible;
- relays the response body, counting streamed tokens and settling usage at its end of
  stream, as the sidecar's relay does; with the response body mode ``NONE`` it settles the
  estimate instead.

Every byte Envoy passes on came from a client: headers are bounded and decoded leniently,
the body is bounded by ``max_body_bytes``, and nothing of a key is logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import math
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import grpc
import orjson
from aiohttp import web
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from weighbridge import headers as headers_
from weighbridge.sidecar.app import Sidecar, close_loop
from weighbridge.sidecar.config import EMBEDDINGS, Config
from weighbridge.sidecar.core import Dispatch
from weighbridge.sidecar.discovery import PoolDiscovery, PoolRef, api_client
from weighbridge.sidecar.identity import TrustedSources
from weighbridge.sidecar.listener import ClientSite
from weighbridge.sidecar.metrics import StreamedTokens
from weighbridge.sidecar.proxy import _select, _usage_of
from weighbridge.sidecar.session import (
    BACKEND_UNAVAILABLE,
    MAX_DISPATCH_ATTEMPTS,
    ApiError,
    Caller,
    End,
    RelayOutcome,
    RequestSession,
    Usage,
    body_too_large,
)

log = logging.getLogger("weighbridge.epp")

__all__ = ["DESTINATION", "ENDPOINT_SUBSET", "HEALTH_SERVICES", "LB_NAMESPACE", "SERVED",
           "SUBSET_NAMESPACE", "Endpoints", "Picker", "run_epp"]

# The protocol's names (GIE docs/proposals/004-endpoint-picker-protocol).
DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
ENDPOINT_SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# The health services the protocol names ("" is gRPC's overall health): the first serve
# while the process answers, the others while some backend is healthy.
LIVE_SERVICES = ("", "liveness")
READY_SERVICES = ("readiness", EXT_PROC_SERVICE)
HEALTH_SERVICES = LIVE_SERVICES + READY_SERVICES
# Envoy sets this on every answer from an upstream, never on its own (a connection refused).
UPSTREAM_TIME = "x-envoy-upstream-service-time"
_GATEWAY_ERRORS = frozenset({502, 503, 504})
# The paths the picker schedules, as the sidecar serves them.
SCHEDULED = ("/v1/completions", "/v1/chat/completions", EMBEDDINGS)
# Request headers the picker takes off before the backend sees them: the client's key stays
# at the gateway (the sidecar forwards none of a client's headers), and the body it sends
# is not the client's length.
_REMOVED = ("authorization", "content-length")
# The most request-header bytes read from Envoy's message: Envoy bounds them itself (60 KiB
# by default); this bounds what a misconfigured listener could pass.
MAX_HEADER_BYTES = 96 * 1024
# How long the picker waits for the InferencePool's first listing before it serves.
FIRST_LIST_S = 10.0
_FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
_NONE = processing_mode_pb2.ProcessingMode.NONE


# -- endpoints ----------------------------------------------------------------------------------


def endpoint_of(url: str, resolve: Callable[[str], str] | None = None) -> str:
    """A backend URL's ``ip:port``, as ``ORIGINAL_DST`` reads it (IPv6 in brackets); a host
    name is resolved (``resolve``, default the system's resolver)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = ipaddress.ip_address((resolve or _resolve)(host))
    return f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"


def _resolve(host: str) -> str:
    return str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])


# A backend named by host name is resolved again after this long: a pod that restarts keeps
# its name (a StatefulSet's) but not its address.
RESOLVE_TTL_S = 10.0


class Endpoints:
    """Each configured backend's ``ip:port``, read from the config in force (a reload may add
    or remove backends), a host name resolved at most every ``RESOLVE_TTL_S``."""

    def __init__(self, config: Callable[[], Config],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._clock = clock
        self._by_url: dict[str, tuple[str, float]] = {}

    def of(self, backend: str) -> str:
        for b in self._config().backends:
            if b.name == backend:
                return self._endpoint(b.url)
        raise KeyError(backend)

    def _endpoint(self, url: str) -> str:
        now = self._clock()
        known = self._by_url.get(url)
        if known is not None and now < known[1]:
            return known[0]
        endpoint = endpoint_of(url)
        literal = endpoint.lstrip("[").startswith(urlsplit(url).hostname or "")
        self._by_url[url] = (endpoint, math.inf if literal else now + RESOLVE_TTL_S)
        return endpoint

    def backends_at(self, endpoints: list[str]) -> set[str]:
        """The configured backends at these ``ip:port`` endpoints."""
        wanted = set(endpoints)
        found = set()
        for b in self._config().backends:
            try:
                if self._endpoint(b.url) in wanted:
                    found.add(b.name)
            except (OSError, ValueError):
                continue  # unresolvable now: not among the eligible
        return found


# -- the protocol's messages ----------------------------------------------------------------


def header_map(headers: base_pb2.HeaderMap) -> dict[str, str]:
    """Envoy's header map as the session reads headers: lower-case names, one value each
    (repeated ones joined with a comma, as HTTP folds them), bytes decoded leniently."""
    out: dict[str, str] = {}
    size = 0
    for h in headers.headers:
        value = h.raw_value.decode("utf-8", "surrogateescape") if h.raw_value else h.value
        size += len(h.key) + len(value)
        if size > MAX_HEADER_BYTES:
            break
        key = h.key.lower()
        out[key] = f"{out[key]},{value}" if key in out else value
    return out


def subset_hint(request: ext_proc.ProcessingRequest) -> list[str] | None:
    """The endpoints the data plane allows (the subset hint), or None when it names none."""
    namespace = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or ENDPOINT_SUBSET not in namespace.fields:
        return None
    value = namespace.fields[ENDPOINT_SUBSET]
    if value.HasField("list_value"):
        return [v.string_value for v in value.list_value.values if v.HasField("string_value")]
    if value.HasField("string_value"):  # a comma-separated list, as the header carries one
        return [e.strip() for e in value.string_value.split(",") if e.strip()]
    return []


def served_endpoint(request: ext_proc.ProcessingRequest) -> str | None:
    """The endpoint the data plane says served the request, when it says."""
    namespace = request.metadata_context.filter_metadata.get(LB_NAMESPACE)
    if namespace is None or SERVED not in namespace.fields:
        return None
    return namespace.fields[SERVED].string_value or None


def _mutation(set_headers: Mapping[str, str], remove: tuple[str, ...] = ()
              ) -> ext_proc.HeaderMutation:
    return ext_proc.HeaderMutation(
        set_headers=[base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=k.lower(), raw_value=v.encode()),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
            for k, v in set_headers.items()],
        remove_headers=list(remove))


def immediate(error: ApiError) -> ext_proc.ProcessingResponse:
    """``error`` as the client's answer, sent by Envoy without an upstream."""
    answer = {"content-type": "application/json", **error.response_headers()}
    return ext_proc.ProcessingResponse(immediate_response=ext_proc.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=error.status),
        headers=_mutation(answer), body=error.body(), details=error.reason))


def destination_metadata(endpoint: str) -> struct_pb2.Struct:
    """The picked endpoint in ``envoy.lb``, the same value as the header."""
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION: endpoint}})
    return metadata


def bound(endpoint: str, forward_body: bytes, full_duplex: bool,
          removed: tuple[str, ...] = _REMOVED) -> list[ext_proc.ProcessingResponse]:
    """The answers that bind a held request to ``endpoint``: with a full-duplex body, the
    request-headers answer (the only one Envoy routes on) then the body; buffered, the body
    answer carries both. ``removed``: the request headers taken off."""
    mutation = _mutation({DESTINATION: endpoint}, removed)
    metadata = destination_metadata(endpoint)
    if full_duplex:
        return [
            ext_proc.ProcessingResponse(
                request_headers=ext_proc.HeadersResponse(
                    # The route is chosen again with the header: a fail-open route without
                    # it (docs/deploy-kubernetes.md) is left for the bound one.
                    response=ext_proc.CommonResponse(header_mutation=mutation,
                                                     clear_route_cache=True)),
                dynamic_metadata=metadata),
            ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse(
                response=ext_proc.CommonResponse(body_mutation=ext_proc.BodyMutation(
                    streamed_response=ext_proc.StreamedBodyResponse(
                        body=forward_body, end_of_stream=True))))),
        ]
    return [ext_proc.ProcessingResponse(
        request_body=ext_proc.BodyResponse(response=ext_proc.CommonResponse(
            clear_route_cache=True, header_mutation=mutation,
            body_mutation=ext_proc.BodyMutation(body=forward_body))),
        dynamic_metadata=metadata)]


def _continue_headers(phase: str, set_headers: Mapping[str, str] | None = None
                      ) -> ext_proc.ProcessingResponse:
    response = ext_proc.HeadersResponse(response=ext_proc.CommonResponse(
        header_mutation=_mutation(set_headers or {})))
    return ext_proc.ProcessingResponse(**{phase: response})


def _streamed_body(phase: str, body: bytes, end: bool) -> ext_proc.ProcessingResponse:
    return ext_proc.ProcessingResponse(**{phase: ext_proc.BodyResponse(
        response=ext_proc.CommonResponse(body_mutation=ext_proc.BodyMutation(
            streamed_response=ext_proc.StreamedBodyResponse(body=body, end_of_stream=end))))})


# -- one request ----------------------------------------------------------------------------


def _no_endpoint(detail: str) -> ApiError:
    return ApiError(503, "no_eligible_endpoint", f"no eligible endpoint: {detail}",
                    "server_error")


@dataclass(slots=True)
class _Response:
    """The response as it passes through the picker."""

    status: int = 0
    stream: bool = False  # an SSE stream whose chunks the picker counts
    buffer: bytes = b""  # a stream's incomplete event, or a whole answer's bytes so far
    outcome: RelayOutcome | None = None


class _Exchange:
    """One ext_proc stream: one HTTP request through Envoy, from its headers to its end in
    the core, exactly once."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.sidecar = picker.sidecar
        self.session: RequestSession | None = None
        self.dispatch: Dispatch | None = None
        self.streamed: StreamedTokens | None = None
        self.ended = False
        self.first = True
        self.response = _Response()
        self.forward_headers: dict[str, str] = {}  # the sidecar's answer headers, once bound
        self.response_body_mode: int | None = None
        # The picker answered the client itself on the response path: Envoy's messages
        # already on their way are left unanswered.
        self.replaced = False
        self.request_trailers = False  # the client's request ended with trailers

    # -- request ----------------------------------------------------------------------------

    async def request(self, first: ext_proc.ProcessingRequest,
                      messages: AsyncIterator[ext_proc.ProcessingRequest]
                      ) -> AsyncIterator[ext_proc.ProcessingResponse]:
        """From the request headers to the held request's binding (or its refusal)."""
        if first.HasField("protocol_config"):
            self.response_body_mode = first.protocol_config.response_body_mode
            full_duplex = first.protocol_config.request_body_mode == _FULL_DUPLEX
        else:
            full_duplex = True  # Envoy older than 1.35 says nothing: the protocol's mode
        headers = header_map(first.request_headers.headers)
        path = headers.get(":path", "").partition("?")[0]
        method = headers.get(":method", "")
        if path not in SCHEDULED or method != "POST":
            yield immediate(_unscheduled(path, method))
            return
        caller = self._caller(headers, first)
        hint = subset_hint(first)
        if not full_duplex:
            yield _continue_headers("request_headers")  # buffered: the body follows
        raw = await self._body(caller, first, messages)
        if raw is None:
            return  # Envoy closed the stream before the body ended: nothing was admitted
        async for response in self._schedule(caller, path, headers, raw, hint, full_duplex):
            yield response

    async def _body(self, caller: Caller, first: ext_proc.ProcessingRequest,
                    messages: AsyncIterator[ext_proc.ProcessingRequest]) -> bytes | None:
        """The whole request body, bounded in size and time (the ingress's 413 and 408);
        None: the stream closed before its end."""
        sidecar = self.sidecar
        raw = bytearray()
        limit = sidecar.config.max_body_bytes
        ended = first.request_headers.end_of_stream
        try:
            async with asyncio.timeout(sidecar.config.client_body_timeout_ms / 1000):
                while not ended:
                    message = await anext(messages)
                    if message.HasField("request_body"):
                        raw += message.request_body.body
                        ended = message.request_body.end_of_stream
                        if len(raw) > limit:
                            raise sidecar.ingress.refused(caller, body_too_large(limit))
                    elif message.HasField("request_trailers"):
                        ended = self.request_trailers = True  # the body's end, answered too
        except TimeoutError:
            raise sidecar.ingress.body_timeout(caller) from None
        except StopAsyncIteration:
            return None
        return bytes(raw)

    def _caller(self, headers: Mapping[str, str], first: ext_proc.ProcessingRequest
                ) -> Caller:
        """The tenant as the first trusted source present names it (sidecar.identity), or
        the ingress's 401."""
        ingress = self.sidecar.ingress
        filter_metadata = first.metadata_context.filter_metadata
        claim = self.picker.identity.claimed(headers, filter_metadata.get)
        if claim is None or claim[1] is None:
            return ingress.authenticate(headers)  # the key, or the 401 of none
        return ingress.named(claim[1])

    def _allowed(self, caller: Caller, model: str | None, hint: list[str] | None
                 ) -> frozenset[str] | None:
        """The backends the request may be bound to: those of the subset hint, and of the
        pool's pods those ready now (sidecar.discovery); None: any. The protocol's 503 at
        once when none is healthy (the sidecar would hold the request until one is)."""
        sidecar = self.sidecar
        assert sidecar.pool is not None
        states = sidecar.pool.states
        serving = sidecar.core.catalog.backends_for(model)
        if serving and not any(states[b].healthy for b in serving if b in states):
            raise sidecar.ingress.refused(caller, _no_endpoint(
                "no backend serving the model is healthy"))
        allowed, why = None, ""
        if hint is not None:
            allowed = frozenset(self.picker.endpoints.backends_at(hint) & serving)
            why = "none of the subset hint's endpoints is a healthy backend serving the model"
        ready = self.picker.ready_backends()
        if ready is not None:
            allowed = ready if allowed is None else allowed & ready
            why = why or "no pod of the InferencePool is ready"
        if allowed is not None and not any(states[b].healthy for b in allowed if b in states):
            raise sidecar.ingress.refused(caller, _no_endpoint(why))
        return allowed

    async def _schedule(self, caller: Caller, endpoint: str, headers: dict[str, str],
                        raw: bytes, hint: list[str] | None, full_duplex: bool
                        ) -> AsyncIterator[ext_proc.ProcessingResponse]:
        sidecar = self.sidecar
        ingress = sidecar.ingress
        arrival = ingress.read(caller, endpoint, headers, raw)
        allowed = self._allowed(caller, arrival.model or None, hint)
        ids = await sidecar.tokenizers.tokenize(
            sidecar.core.request_model(arrival.model) or sidecar.core.catalog.default_model(),
            caller.tenant, endpoint, arrival.body)
        if ids is not None:
            arrival.tokenized(ids)
        core = sidecar.core
        tenant, tier, model = caller.tenant, arrival.tier, arrival.model
        estimate = core.estimated_tokens(tenant, endpoint, arrival.prompt_tokens,
                                         arrival.max_tokens, arrival.sequences, model)
        sidecar.metrics.offer(tenant, tier, estimate,
                              core.catalog.backends_for(core.request_model(model)))
        admitted = None
        if sidecar.shared is not None and core.serves(model):
            admitted = await sidecar.shared.admit(tenant, endpoint, tier, model, estimate)
        # The day and month levels are in the quota file before the admission, as the
        # sidecar's own front does.
        async with sidecar.quota_admission(tenant, endpoint, tier, model, estimate):
            session = ingress.arrive(arrival, sidecar.request_id(), sidecar.clock(),
                                     admitted, allowed)
        self.session = session
        req = session.request
        sidecar.metrics.in_system.enter(req.tenant, req.tier, req.arrival_s)
        self.streamed = sidecar.metrics.streamed(req.tenant, req.tier, req.prompt_tokens)
        series = sidecar.metrics.series(req.tenant, req.tier)
        assert sidecar.pool is not None
        for _attempt in range(MAX_DISPATCH_ATTEMPTS):
            try:
                dispatch = await sidecar.await_dispatch(session)
            except asyncio.CancelledError:
                self.ended = True  # the wait ended it: out of the queue, or unsent
                raise
            now = sidecar.clock()
            if allowed is not None and dispatch.backend not in allowed:
                # The core chose outside the subset: back to the queue (it never left).
                session.unreachable(now)
                sidecar.wake()
                continue
            try:
                endpoint_ = self.picker.endpoints.of(dispatch.backend)
            except (KeyError, OSError, ValueError) as e:
                sidecar.pool.mark_failed(dispatch.backend, f"no endpoint: {e}")
                session.unreachable(now)
                sidecar.wake()
                continue
            series.queue_wait.observe(now - req.arrival_s)
            forward = session.dispatched(
                dispatch, now, sidecar.pool.states[dispatch.backend].config.stream_interval)
            self.dispatch = dispatch
            self.forward_headers = forward.headers
            for response in bound(endpoint_, orjson.dumps(forward.body), full_duplex,
                                  self.picker.removed):
                yield response
            if self.request_trailers:
                yield ext_proc.ProcessingResponse(request_trailers=ext_proc.TrailersResponse())
            return
        self._end_unsent()
        raise _no_endpoint("the core's choices fell outside the subset hint"
                           if allowed is not None else "no backend has an endpoint")

    def _end_unsent(self) -> None:
        assert self.session is not None
        self.ended = True
        self.session.core.on_failed(self.session.request, 0, 0, self.sidecar.clock())
        self.sidecar.wake()

    # -- response ---------------------------------------------------------------------------

    def response_headers(self, message: ext_proc.ProcessingRequest
                         ) -> ext_proc.ProcessingResponse:
        headers = header_map(message.response_headers.headers)
        try:
            status = int(headers.get(":status", "0"))
        except ValueError:
            status = 0
        response = self.response
        response.status = status
        served = served_endpoint(message)
        if served is not None and self.dispatch is not None:
            picked = self.picker.endpoints.of(self.dispatch.backend)
            if served != picked:
                self.picker.served_elsewhere += 1
                log.warning("the data plane served %s a request bound to %s", served, picked)
        if status in _GATEWAY_ERRORS and UPSTREAM_TIME not in headers \
                and self.dispatch is not None and self.sidecar.pool is not None:
            return self._unreached(status)
        content_type = headers.get("content-type", "")
        assert self.session is not None
        response.stream = (self.session.stream and status == 200
                           and content_type.startswith("text/event-stream"))
        response.outcome = RelayOutcome(status, None)
        if message.response_headers.end_of_stream:
            self._settle()
        return _continue_headers("response_headers", self.forward_headers)

    def _unreached(self, status: int) -> ext_proc.ProcessingResponse:
        """Envoy's own answer, not the engine's: it could not reach the endpoint. Routing
        avoids the backend until a probe finds it again, as the sidecar does, and the client
        gets the sidecar's answer to an unreachable backend instead of Envoy's text."""
        assert self.dispatch is not None and self.sidecar.pool is not None
        assert self.session is not None
        backend = self.dispatch.backend
        self.sidecar.pool.mark_failed(backend, f"the gateway answered {status} without it")
        self.ended = self.replaced = True
        self._finish(self.session.relayed(RelayOutcome(status, None), self.sidecar.clock()))
        return immediate(ApiError(
            502, BACKEND_UNAVAILABLE, "the gateway could not reach the backend the request "
            "was bound to", "server_error", {headers_.BACKEND: backend}))

    def response_body(self, message: ext_proc.ProcessingRequest
                      ) -> ext_proc.ProcessingResponse | None:
        """A response body chunk: counted, the usage chunk read (and dropped unless the
        client asked for it), passed on; its end settles the request."""
        body = message.response_body
        response = self.response
        assert response.outcome is not None and self.session is not None
        if response.stream:
            buffer = response.buffer + body.body if response.buffer else body.body
            end = len(buffer) if body.end_of_stream else buffer.rfind(b"\n\n") + 2
            out = b""
            if end > 0:
                events, response.buffer = buffer[:end], buffer[end:]
                out = _select(events, response.outcome, not self.session.client_wants_usage,
                              self._on_content, self.sidecar.clock)
            else:
                response.buffer = buffer
        else:
            out = body.body
            if response.status == 200 and len(response.buffer) < self.sidecar.config.max_body_bytes:
                response.buffer += body.body  # a whole answer: its usage at the end
        if body.end_of_stream:
            if not response.stream and response.status == 200:
                with contextlib.suppress(orjson.JSONDecodeError):
                    response.outcome.usage = _usage_of(orjson.loads(response.buffer))
            self._settle()
        if self.response_body_mode == _FULL_DUPLEX:
            if not out and not body.end_of_stream:
                return None
            return _streamed_body("response_body", out, body.end_of_stream)
        return ext_proc.ProcessingResponse(response_body=ext_proc.BodyResponse())

    def _on_content(self, n: int) -> None:
        assert self.session is not None and self.streamed is not None
        now = self.sidecar.clock()
        if self.first:
            self.first = False
            req = self.session.request
            self.sidecar.metrics.series(req.tenant, req.tier).ttft.observe(now - req.arrival_s)
        self.streamed.tokens(self.session.chunks(n, now))

    def _settle(self) -> None:
        """The response's end of stream: the request ends in the core, with its usage."""
        if self.ended or self.session is None or self.response.outcome is None:
            return
        outcome = self.response.outcome
        session = self.session
        if outcome.status == 200 and outcome.usage is None and self.response_body_mode in (
                None, _NONE):  # NONE: the body never passed here
            req = session.request
            outcome.usage = Usage(req.prompt_tokens,
                                  req.estimated_output_tokens * req.sequences)
        elif outcome.status == 200 and self.response.stream and outcome.usage is None \
                and not outcome.content_chunks:
            outcome.broken, outcome.error = True, "backend ended the stream early"
        self.ended = True
        end = session.relayed(outcome, self.sidecar.clock())
        self._finish(end)

    def gone(self) -> None:
        """The stream ended before the response did: the client left (or Envoy did)."""
        if self.ended or self.session is None:
            return
        if self.response.outcome is not None and self.response_body_mode in (None, _NONE) \
                and self.response.status:
            self._settle()  # NONE: the stream's end is the response's end
            return
        self.ended = True
        self._finish(self.session.client_gone(self.sidecar.clock()))

    def _finish(self, end: End) -> None:
        sidecar = self.sidecar
        assert self.session is not None
        req = self.session.request
        if end.backend_fault is not None and self.dispatch is not None \
                and sidecar.pool is not None:
            sidecar.pool.mark_failed(self.dispatch.backend, end.backend_fault)
        sidecar.count_tokens(req, end)
        if self.streamed is not None and end.outcome == "completed" and end.tokens is not None:
            self.streamed.settle(*end.tokens)
        sidecar.wake()

    def close(self) -> None:
        """Every way out of the stream: the request's single end, and its metrics."""
        self.gone()
        if self.session is not None:
            req = self.session.request
            now = self.sidecar.clock()
            metrics = self.sidecar.metrics
            metrics.in_system.leave(req.tenant, req.tier, req.arrival_s, now)
            metrics.series(req.tenant, req.tier).duration.observe(now - req.arrival_s)
        if self.streamed is not None:
            self.streamed.close()


def _unscheduled(path: str, method: str) -> ApiError:
    if path in SCHEDULED:
        return ApiError(405, "method_not_allowed", "Method Not Allowed",
                        "invalid_request_error", {"Allow": "POST"})
    return ApiError(404, "not_found", "Not Found", "invalid_request_error")


# -- the service ----------------------------------------------------------------------------


class Picker(ext_proc_grpc.ExternalProcessorServicer):
    """The ext_proc service over one :class:`Sidecar`: its core, pool and configuration."""

    def __init__(self, sidecar: Sidecar, identity: TrustedSources | None = None,
                 discovery: PoolDiscovery | None = None) -> None:
        self.sidecar = sidecar
        self.identity = identity or TrustedSources()
        self.discovery = discovery
        # What the backend never sees: the client's key, the length of a body the picker
        # rewrites, and the headers that carried the caller's identity.
        self.removed = _REMOVED + self.identity.headers
        self.endpoints = Endpoints(lambda: sidecar.config)
        self.served_elsewhere = 0  # responses the data plane says another endpoint served

    def ready_backends(self) -> frozenset[str] | None:
        """The backends of the pool's pods ready now, when that is not every backend in
        force; None without discovery, or when every one is."""
        if self.discovery is None:
            return None
        ready = self.discovery.ready
        if ready is None:
            return frozenset()  # the pool not listed yet: nothing is known ready
        if all(b.name in ready for b in self.sidecar.config.backends):
            return None
        return ready

    async def Process(self, request_iterator: AsyncIterator[ext_proc.ProcessingRequest],
                      context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[ext_proc.ProcessingResponse]:
        exchange = _Exchange(self)
        messages = aiter(request_iterator)
        try:
            try:
                first = await anext(messages)
            except StopAsyncIteration:
                return
            if not first.HasField("request_headers"):
                return  # a stream that starts elsewhere is no request of ours
            try:
                async for response in exchange.request(first, messages):
                    yield response
            except ApiError as e:
                yield immediate(e)
                return
            async for message in messages:
                answer = self._respond(exchange, message)
                if answer is not None:
                    yield answer
        finally:
            exchange.close()

    @staticmethod
    def _respond(exchange: _Exchange, message: ext_proc.ProcessingRequest
                 ) -> ext_proc.ProcessingResponse | None:
        if exchange.session is None or exchange.replaced:
            return None
        # One look at the message's kind: a body chunk is most of them.
        kind = message.WhichOneof("request")
        if kind == "response_body":
            return exchange.response_body(message)
        if kind == "response_headers":
            return exchange.response_headers(message)
        if kind == "response_trailers":
            exchange._settle()
            return ext_proc.ProcessingResponse(response_trailers=ext_proc.TrailersResponse())
        if kind == "request_trailers":
            return ext_proc.ProcessingResponse(request_trailers=ext_proc.TrailersResponse())
        return None


class Health:
    """The protocol's health services: liveness while the process answers, readiness (and
    the ext_proc service's) while some backend is healthy, as the sidecar's /readyz, and
    with pod discovery some pod of the pool is ready."""

    def __init__(self, sidecar: Sidecar, discovery: PoolDiscovery | None = None) -> None:
        self.sidecar = sidecar
        self.discovery = discovery
        self.servicer = health_aio.HealthServicer()

    async def watch(self, period_s: float = 1.0) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        for service in LIVE_SERVICES:
            await self.servicer.set(service, serving)
        while True:
            pool = self.sidecar.pool
            ready = pool is not None and pool.any_healthy() and (
                self.discovery is None or bool(self.discovery.ready))
            for service in READY_SERVICES:
                await self.servicer.set(service, serving if ready else not_serving)
            await asyncio.sleep(period_s)


async def serve_epp(sidecar: Sidecar, host: str, port: int, http_host: str,
                    http_port: int, ready: Callable[[int], None] | None = None,
                    identity: TrustedSources | None = None,
                    discovery: PoolDiscovery | None = None) -> None:
    """Serve the picker on ``host:port`` (gRPC) and the sidecar's HTTP app on
    ``http_host:http_port`` (/metrics, /healthz, /readyz, /admin), until cancelled.
    ``identity``: where a request's tenant is read (default: the bearer key alone);
    ``discovery``: the InferencePool's pods as the backends (default: the config's),
    started and attached to ``sidecar``; stopped here."""
    runner = web.AppRunner(sidecar.app, handle_signals=False, access_log=None,
                           handler_cancellation=True)
    await runner.setup()  # the sidecar's lifecycle: the pool, the dispatch tick, shared state
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", sidecar.config.max_body_bytes + MAX_HEADER_BYTES),
        # Envoy keeps one long stream per request; many at once is the normal load.
        ("grpc.max_concurrent_streams", 100_000),
    ])
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(Picker(sidecar, identity, discovery),
                                                          server)
    health = Health(sidecar, discovery)
    health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
    bound_port = server.add_insecure_port(f"{host}:{port}")
    watching = asyncio.create_task(health.watch(), name="epp-health")
    try:
        await ClientSite(runner, http_host, http_port,
                         max_connections=sidecar.config.max_client_connections,
                         keepalive_timeout=sidecar.config.client_timeout_ms / 1000).start()
        await server.start()
        if ready is not None:
            ready(bound_port)
        await server.wait_for_termination()
    finally:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching
        if discovery is not None:
            await discovery.stop()
        await health.servicer.enter_graceful_shutdown()
        await server.stop(grace=1.0)
        await runner.cleanup()


def run_epp(config: Config, host: str, port: int, http_host: str, http_port: int,
            config_path: str | None = None, identity: TrustedSources | None = None,
            pool: PoolRef | None = None, kubeconfig: str | None = None) -> None:
    """Serve until SIGINT or SIGTERM; SIGHUP reloads ``config_path`` as the sidecar does.
    ``pool``: the InferencePool whose ready pods are the backends, read from the API server
    in-cluster or through ``kubeconfig``. The default event loop, not uvloop: grpc.aio
    supports the former."""
    for warning in config.warnings:
        log.warning("config: %s", warning)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)

    async def serve() -> None:
        discovery, start = None, config
        if pool is not None:
            discovery = PoolDiscovery(pool, lambda: api_client(kubeconfig))
            # The pool's pods are the backends from the start, when the API server answers
            # soon; else they come when it does, and requests get 503 until then.
            start = await discovery.start(config, FIRST_LIST_S)
        sidecar = Sidecar(start, config_path=config_path)
        if discovery is not None:
            discovery.attach(sidecar)
        loop.add_signal_handler(signal.SIGHUP, sidecar.reload_on_signal)
        await serve_epp(
            sidecar, host, port, http_host, http_port,
            ready=lambda p: log.info("weighbridge epp: ext_proc on %s:%d, HTTP on %s:%d",
                                     host, p, http_host, http_port),
            identity=identity, discovery=discovery)

    main = loop.create_task(serve())
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, main.cancel)
    try:
        loop.run_until_complete(main)
    except asyncio.CancelledError:
        pass
    finally:
        close_loop(loop)
