"""One request's way through the sidecar, without I/O: every rule of its ingress and of its
end, written once for every front that drives it.

A front reads bytes and writes answers; this module decides. The fronts are the aiohttp app
(``sidecar/app.py``), the simulator (``weighbridge/app/simulation/loop.py``) and any other (an
Envoy external-processing service, say): each passes plain values (a header mapping whose
keys are looked up in lower case, the body as bytes or parsed, the clock's reading as
``now``) and gets plain values back, or an :class:`ApiError`, the OpenAI-style answer it
sends. Nothing here imports aiohttp or reads a clock.

Ingress, per request (each step raises ``ApiError``, already counted in the ledger)::

    caller = ingress.authenticate(headers)                  # key -> digest -> tenant, or 401
    arrival = ingress.read(caller, endpoint, headers, body)   # headers and body, or 4xx
    request = ingress.arrive(arrival, request_id, now)      # the core's checks, or 429/503/404

A front may do I/O between the steps (read the body after authenticating, tokenize the
prompt with the served model's tokenizer and tell ``arrival.tokenized``, ask the limits
other replicas share before ``arrive``); the steps' order is the rules' order.

The life of an admitted request (``RequestSession``), each call with ``now``::

    forward = request.dispatched(dispatch, now, backend_interval)  # the body, the headers
    request.chunks(n, now)             # n content chunks reached the client: their tokens
    end = request.relayed(outcome, now)   # or client_gone, crashed, backend_failed, ...

Every way out ends the request in the core exactly once, and returns what the front still
owes: an :class:`End` (the tokens to count, the trace's outcome, a backend to mark failed)
or the ``ApiError`` to answer with. ``tests/unit/sidecar/test_session.py`` drives the same
malformed and edge-case requests through the live app and the simulator and gets the same
answers from both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from weighbridge import headers as headers_
from weighbridge import output_budget
from weighbridge.endpoints import EndpointKind
from weighbridge.keys import key_digest
from weighbridge.sidecar.config import Config
from weighbridge.sidecar.core import Dispatch, SchedulingCore
from weighbridge.sidecar.openapi import DEADLINE_MS
from weighbridge.sidecar.prefix import PromptPrefix
from weighbridge.sidecar.programs import ProgramError, ProgramId, ProgramIdentity, check_xargs
from weighbridge.sidecar.prompt import PromptError, json_integer, prompt_tokens
from weighbridge.sidecar.ratelimit import Admit
from weighbridge.sidecar.rejection import MODEL_NOT_FOUND, Reject
from weighbridge.sidecar.request import QueuedRequest, RequestState

__all__ = ["BACKEND_FAILED", "BACKEND_UNAVAILABLE", "MAX_BODY_DEPTH",
           "MAX_DISPATCH_ATTEMPTS", "ApiError", "Arrival", "Caller", "End", "Forward",
           "Ingress", "Prompt", "RelayOutcome", "RequestSession", "Usage", "bearer",
           "body_too_large", "rejection", "tokens_in_chunks"]

# The body's integer fields the sidecar reads, as vLLM types them (int64), per kind: the
# pooling kinds take no output budget, stream_interval or n (nor read them).
_GENERATION_INTEGER_FIELDS = ("max_tokens", "max_completion_tokens", "priority",
                              "stream_interval", "n")
_POOLING_INTEGER_FIELDS = ("priority",)
# The deepest body the sidecar can forward: orjson writes no deeper.
MAX_BODY_DEPTH = 255
# vLLM's request models bound their integers to int64 (priority explicitly; the others by
# the engine): so does the sidecar, for the fields it reads.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# A request whose backend refuses the connection goes back to the queue this many times.
MAX_DISPATCH_ATTEMPTS = 3
BACKEND_FAILED = "backend_failed"
BACKEND_UNAVAILABLE = "backend_unavailable"
# Errors that end a request as failed (a backend's fault), not rejected.
_FAILURES = frozenset({BACKEND_FAILED, BACKEND_UNAVAILABLE})


# -- answers ------------------------------------------------------------------------------------


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

    @property
    def outcome(self) -> Literal["failed", "rejected"]:
        """How the request ended: failed by a backend's fault, else rejected."""
        return "failed" if self.reason in _FAILURES else "rejected"

    def body(self) -> bytes:
        error: dict[str, Any] = {"message": self.message, "type": self.type, "code": self.reason}
        if self.vllm_body:
            error.update(param=self.param, code=self.status)
        return orjson.dumps({"error": error})

    def response_headers(self) -> dict[str, str]:
        return {headers_.REJECT_REASON: self.reason, **self.headers}


def _bad_request(reason: str, message: str) -> ApiError:
    return ApiError(400, reason, message, "invalid_request_error")


def body_too_large(limit: int) -> ApiError:
    return ApiError(413, "body_too_large", f"request body exceeds {limit} bytes",
                    "invalid_request_error")


def rejection(reject: Reject) -> ApiError:
    """The answer to a request the core turned away."""
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


def bearer(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header, or None."""
    scheme, _, key = (authorization or "").partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        return None
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:  # bytes that are not UTF-8 (kept as surrogates): no key of ours
        return None
    return key


# -- ingress ------------------------------------------------------------------------------------

# The values below are plain (not frozen) dataclasses on purpose: they are made once or more
# per request, and a frozen dataclass's __init__ costs several times a plain one's.


@dataclass(slots=True)
class Caller:
    """Who sent a request: the tenant and the caller's identity, which the client cannot
    choose (unlike the body's ``user``): its key's digest."""

    tenant: str
    identity: str
    tier: str  # the tenant's own


@dataclass(slots=True)
class Prompt:
    """A prompt its front counted itself, so the body carries none: the simulator's clients,
    whose prompts are exact by construction (or a front that tokenizes)."""

    tokens: int
    prefix: PromptPrefix | None = None


@dataclass(slots=True)
class Arrival:
    """A request that passed validation: what the core's checks need, and the body to
    forward (normalised: integers as integers, the output limit as its budget)."""

    caller: Caller
    endpoint: EndpointKind  # its path is the one forwarded
    body: dict[str, Any]
    tier: str
    deadline_ms: float | None
    prompt_tokens: int
    max_tokens: int | None  # per sequence; None: bounded by the context alone
    sequences: int
    prefix: PromptPrefix | None
    program: ProgramId | None = None  # the agent program it is a call of (sidecar.programs)

    @property
    def model(self) -> Any:
        return self.body.get("model")

    def tokenized(self, ids: list[int]) -> None:
        """The served model's tokenizer counted the prompt (sidecar.tokenizer): its tokens
        are the engine's, and the prefix index cuts them in the engine's blocks. The body is
        forwarded as it came."""
        self.prompt_tokens = len(ids)
        self.prefix = PromptPrefix(token_ids=ids)

    @property
    def stream(self) -> bool:
        # The pooling kinds never stream (vLLM ignores the field there).
        return self.endpoint.generates and bool(self.body.get("stream", False))


class Ingress:
    """The checks every request passes before it takes a slot, in their order; each refusal
    is counted in the ledger once, under its tenant when it has one."""

    def __init__(self, config: Config, core: SchedulingCore) -> None:
        self.config = config
        self.core = core
        # `programs` changes only with a restart (sidecar.reload).
        self._programs = ProgramIdentity.of(config.programs.sources,
                                            config.programs.agent_headers)

    def _program(self, tenant: str, headers: Mapping[str, str], body: dict[str, Any]
                 ) -> ProgramId | None:
        """The program the request names (sidecar.programs), its ``vllm_xargs`` made one
        vLLM takes; a 400 for a shape no harness sends."""
        try:
            check_xargs(body)
            return self._programs.read(tenant, headers, body)
        except ProgramError as e:
            raise _bad_request(e.reason, str(e)) from None

    def authenticate(self, headers: Mapping[str, str], *, counted: bool = True) -> Caller:
        """The caller owning the bearer key, or a 401. ``counted``: the request is one the
        ledger counts (a generation request), so its rejection is an arrival too."""
        key = bearer(headers.get("authorization"))
        digest = None if key is None else key_digest(key)
        tenant = None if digest is None else self.config.tenant_for_digest(digest)
        if tenant is None or digest is None:
            raise self._unauthorized(counted)
        return Caller(tenant, digest, self.config.tenants[tenant].tier)

    def named(self, tenant: str) -> Caller:
        """A caller named by its tenant (a replayed trace names tenants, not keys), or the
        401 of an unknown one."""
        if tenant not in self.config.tenants:
            raise self._unauthorized(counted=True)
        return Caller(tenant, f"tenant:{tenant}", self.config.tenants[tenant].tier)

    def _configured(self, caller: Caller) -> None:
        """A reload (sidecar.reload) may remove the caller's tenant while the front reads
        its body or asks the shared limits: its key is no longer one, a 401."""
        if caller.tenant not in self.config.tenants:
            raise self._unauthorized(counted=True)

    def _unauthorized(self, counted: bool) -> ApiError:
        if counted:  # before it has a tenant
            self.core.ledger.rejected_on_arrival("", "", "unauthorized")
        return ApiError(401, "unauthorized", "missing or invalid API key",
                        "authentication_error")

    def refused(self, caller: Caller, error: ApiError) -> ApiError:
        """``error``, counted as ``caller``'s rejection on arrival."""
        self.core.ledger.rejected_on_arrival(caller.tenant, caller.tier, error.reason)
        return error

    def body_timeout(self, caller: Caller) -> ApiError:
        """A body that took longer than ``client_body_timeout_ms`` to arrive."""
        ms = self.config.client_body_timeout_ms
        return self.refused(caller, ApiError(
            408, "request_timeout", f"the request body took longer than {ms} ms to arrive",
            "invalid_request_error", close=True))

    def read(self, caller: Caller, endpoint: str, headers: Mapping[str, str],
             body: bytes | dict[str, Any], prompt: Prompt | None = None) -> Arrival:
        """Validate everything the sidecar relies on (the backend validates the rest) for a
        request on the path ``endpoint`` (any path vLLM serves a kind on; the arrival is of
        its kind, whose path is forwarded). A parsed ``body`` is normalised in place;
        ``prompt``: counted by the front (the body has none), else counted from the body."""
        self._configured(caller)
        try:
            return self._read(caller, endpoint, headers, body, prompt)
        except ApiError as e:
            raise self.refused(caller, e) from None

    def _read(self, caller: Caller, path: str, headers: Mapping[str, str],
              raw: bytes | dict[str, Any], prompt: Prompt | None) -> Arrival:
        kind = EndpointKind.of_path(path)
        if kind is None:
            raise ApiError(404, "unknown_endpoint", f"no endpoint is served at {path!r}",
                           "invalid_request_error")
        body = raw if isinstance(raw, dict) else self._decode(raw)
        tier = self._tier(caller, headers.get(headers_.TIER))
        deadline_ms = _deadline_ms(headers.get(headers_.DEADLINE_MS))
        _integers(kind, body)
        max_tokens = self._output_budget(kind, body)
        _fields(kind, body)
        program = self._program(caller.tenant, headers, body)
        if prompt is None:
            prompt = _prompt(kind, body)
        try:
            # What is forwarded must serialise, known before the request takes any budget:
            # orjson reads 1,024 levels of nesting but writes 255.
            orjson.dumps(body)
        except orjson.JSONEncodeError:
            raise _bad_request("invalid_body", f"the request body nests deeper than "
                               f"{MAX_BODY_DEPTH} levels") from None
        # A pooling request is one engine request per input, however many answers `n` asks.
        sequences = output_budget.sequences(body) if kind.generates else 1
        return Arrival(caller, kind, body, tier, deadline_ms, prompt.tokens, max_tokens,
                       sequences, prompt.prefix, program)

    def _decode(self, raw: bytes) -> dict[str, Any]:
        if len(raw) > self.config.max_body_bytes:
            raise body_too_large(self.config.max_body_bytes)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise _bad_request("invalid_json", f"malformed JSON body: {e}") from None
        if not isinstance(body, dict):
            raise _bad_request("invalid_body", "the request body must be a JSON object")
        return body

    def _tier(self, caller: Caller, asked: str | None) -> str:
        """The tier asked for in the header (at or below the tenant's own), else its own."""
        if asked is None:
            return caller.tier
        asked = asked.strip(" \t")  # HTTP's optional whitespace only
        if asked not in self.config.tiers:
            raise _bad_request("unknown_tier", f"unknown tier {asked!r} in {headers_.TIER}")
        if not self.config.tier_allowed(caller.tenant, asked):
            raise ApiError(403, "tier_not_allowed",
                           f"tenant may not use tier {asked!r}; its highest is {caller.tier!r}",
                           "permission_error")
        return asked

    def _output_budget(self, kind: EndpointKind, body: dict[str, Any]) -> int | None:
        """The output tokens a sequence may generate, as vLLM reads the body (None:
        unbounded but by the context); ``max_tokens_limit`` refuses a larger one asked for,
        and is forwarded as the budget of a request that asked for none."""
        if not kind.generates:
            return 0  # a pooling request generates nothing: it costs its input tokens
        chat = kind is EndpointKind.CHAT
        field = output_budget.budget_field(chat, body)
        asked = body.get(field)
        if asked is not None and asked < 1:
            raise _bad_request("invalid_max_tokens", f"{field} must be at least 1")
        budget = (asked if asked is not None or chat
                  else output_budget.COMPLETIONS_DEFAULT_MAX_TOKENS)
        limit = self.config.max_tokens_limit
        if limit is None:
            return budget
        if asked is not None and asked > limit:
            raise _bad_request("max_tokens_too_large", f"{field} may be at most {limit}")
        if budget is None or budget > limit:
            # The limit is a cap, not advice: the engine gets it as the request's budget.
            budget = body["max_completion_tokens" if chat else "max_tokens"] = limit
        return budget

    def arrive(self, arrival: Arrival, request_id: str, now: float,
               admitted: Admit | Reject | None = None,
               allowed_backends: frozenset[str] | None = None) -> RequestSession:
        """The core's checks (rate limits, early rejection, the bounded queue): the queued
        request's session, or the rejection's answer. ``admitted``: the verdict of the
        limits several replicas share; ``allowed_backends``: an endpoint picker's subset
        (both as ``SchedulingCore.arrive`` takes them)."""
        caller = arrival.caller
        self._configured(caller)
        tier = self.config.tiers[arrival.tier]
        result = self.core.arrive(
            request_id=request_id, tenant=caller.tenant, tier=arrival.tier,
            endpoint=arrival.endpoint.value, prompt_tokens=arrival.prompt_tokens,
            max_tokens=arrival.max_tokens, sequences=arrival.sequences, now=now,
            # Repeat demotion counts by the key, never by the body's `user`, which the client
            # can vary per request to escape it.
            user=caller.identity,
            priority=arrival.body.get("priority") or 0,
            deadline_s=tier.deadline(now, arrival.deadline_ms),
            deadline_covers_output=tier.deadline_covers_output(arrival.deadline_ms),
            model=arrival.model, admitted=admitted, prefix=arrival.prefix,
            allowed_backends=allowed_backends,
            # The program never chooses the tenant or tier: it orders the tenant's own
            # queue (program_las) and keeps its calls on one backend (session_affinity).
            session=None if arrival.program is None else arrival.program.program,
            program=None if arrival.program is None else arrival.program.family)
        if isinstance(result, Reject):
            raise rejection(result)
        return RequestSession(self.core, result, arrival,
                              self.config.tiers[arrival.tier].stream_interval or 1)


def _deadline_ms(raw: str | None) -> float | None:
    if raw is None:
        return None
    if DEADLINE_MS.fullmatch(raw) is None:
        raise _bad_request("invalid_deadline",
                           f"{headers_.DEADLINE_MS} must be a positive decimal number of ms")
    return float(raw)


def _integers(kind: EndpointKind, body: dict[str, Any]) -> None:
    """The integer fields the sidecar reads, as 64-bit integers (16.0 is forwarded as 16)."""
    for field in _GENERATION_INTEGER_FIELDS if kind.generates else _POOLING_INTEGER_FIELDS:
        value = body.get(field)
        if value is None:
            continue
        number = json_integer(value)
        # An integer beyond 64 bits reaches us as the parser's float, rounded: -2**63 - 1
        # arrives as -2.0**63, inside the range. No float that large is an exact int64.
        if isinstance(value, float) and abs(value) >= 2.0**63:
            number = None
        if number is None or not INT64_MIN <= number <= INT64_MAX:
            raise _bad_request("invalid_" + field, f"{field} must be a 64-bit integer")
        body[field] = number


def _prompt(kind: EndpointKind, body: dict[str, Any]) -> Prompt:
    """The body's prompt, counted (exact for token ids, estimated for text; token ids are
    normalised in ``body``), with what the prefix index reads of it."""
    try:
        tokens = prompt_tokens(kind, body)
    except PromptError as e:
        raise _bad_request("invalid_prompt", str(e)) from None
    return Prompt(tokens, PromptPrefix.of(kind, body))


def _fields(kind: EndpointKind, body: dict[str, Any]) -> None:
    """The other fields the sidecar reads, by their types and bounds."""
    if kind.generates and body.get("n") is not None and body["n"] < 1:
        raise _bad_request("invalid_n", "n must be at least 1")
    if kind.generates and body.get("stream_interval") is not None \
            and body["stream_interval"] < 1:
        # Live charging counts a streamed chunk's tokens by it (vLLM refuses it too).
        raise _bad_request("invalid_stream_interval", "stream_interval must be at least 1")
    # The pooling kinds never stream: vLLM ignores the field there, and so does the sidecar.
    if kind.generates and body.get("stream") is not None and not isinstance(body["stream"],
                                                                          bool):
        raise _bad_request("invalid_stream", "stream must be a boolean")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad_request("invalid_user", "user must be a string")
    # Optional, as in vLLM (a request without it gets the served model); per-model limits
    # key on it, so it must be a string when present.
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad_request("invalid_model", "model must be a string")


# -- a request's life ---------------------------------------------------------------------------


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    # What the engine found in its prefix cache (vLLM's --enable-prompt-tokens-details);
    # None: not reported.
    cached_tokens: int | None = None


@dataclass(slots=True)
class RelayOutcome:
    """How a backend's answer ended, as its relay saw it."""

    status: int  # the backend's HTTP status
    usage: Usage | None
    first_token_s: float | None = None  # when the first content chunk reached the client
    content_chunks: int = 0
    broken: bool = False  # the backend failed after the response started
    error: str | None = None
    client_gone: bool = False  # the client went away mid-stream (the upstream was closed)


def tokens_in_chunks(chunks: int, interval: int) -> int:
    """The output tokens known to have reached the client after ``chunks`` content chunks of
    a stream the engine sends every ``interval`` tokens (vLLM's ``stream_interval``: the
    first token at once, then a chunk whenever ``interval`` tokens are unsent, and the rest
    when it finishes).

    A lower bound, exact but for the latest chunk: the first carries one token, every chunk
    between it and the latest carries ``interval``, and the latest at least one (it may be
    the last, with fewer). So a counter fed by it never needs lowering when the usage
    settles the stream, and a stream cut off is charged no more than it surely delivered.
    With ``interval`` 1 it is one token per chunk. (Speculative decoding or a slow reader
    can put more tokens in a chunk than this counts; the usage settles those.)"""
    if chunks <= 1:
        return max(chunks, 0)
    return interval * (chunks - 2) + 2


@dataclass(slots=True)
class Forward:
    """One attempt at a backend: the body to send and the headers of the client's answer."""

    body: dict[str, Any]
    headers: dict[str, str]


@dataclass(slots=True)
class End:
    """How a request ended, and what its front still owes."""

    outcome: Literal["completed", "cancelled", "failed"]
    status: int | None = None  # the backend's, when it answered
    reason: str | None = None  # a failure's code: backend_failed, backend_<status>
    # (prompt, output) tokens the client got, for the token counters; None: nothing to count.
    tokens: tuple[int, int] | None = None
    backend_fault: str | None = None  # mark the backend failed, for this reason
    # The backend was just found to answer without cached tokens (worth a warning).
    unreported: bool = False


class RequestSession:
    """One admitted request from its arrival to its single end in the core."""

    __slots__ = ("_backend", "_chunks", "_interval", "_sent", "_tier_interval", "arrival",
                 "client_wants_usage", "core", "request", "stream")

    def __init__(self, core: SchedulingCore, request: QueuedRequest, arrival: Arrival,
                 tier_interval: int) -> None:
        self.core = core
        self.request = request
        self.arrival = arrival
        self.stream = arrival.stream
        options = arrival.body.get("stream_options")
        self.client_wants_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        self._tier_interval = tier_interval
        self._interval = 1  # tokens per content chunk after the first, as the engine sends
        self._chunks = 0
        self._sent = False  # the current attempt went to a backend
        self._backend = ""

    def dispatched(self, dispatch: Dispatch, now: float, backend_interval: int = 1) -> Forward:
        """An attempt at ``dispatch.backend``, whose engine streams every
        ``backend_interval`` tokens: the body to send (the priority the core chose, usage
        asked for on a stream, the tier's stream interval) and the answer's headers."""
        body = self.arrival.body
        forwarded = dict(body)
        if dispatch.vllm_priority is None:
            forwarded.pop("priority", None)
        else:
            forwarded["priority"] = dispatch.vllm_priority
        interval = 1  # a whole answer: its usage is counted at once
        if self.stream:
            options = body.get("stream_options")
            # Always ask for usage: it settles rate limits and deficits with real counts.
            forwarded["stream_options"] = {**(options if isinstance(options, dict) else {}),
                                           "include_usage": True}
            if self._tier_interval > (body.get("stream_interval") or 1):
                forwarded["stream_interval"] = self._tier_interval
            # What each chunk carries, as the engine will send them (it takes the larger of
            # the request's and its own).
            interval = max(forwarded.get("stream_interval") or 1, backend_interval)
        self._interval, self._chunks, self._sent = interval, 0, True
        self._backend = dispatch.backend
        request = self.request
        return Forward(forwarded, {
            headers_.TENANT: request.tenant,
            headers_.QUEUE_MS: f"{(now - request.arrival_s) * 1000:.1f}",
            headers_.BACKEND: dispatch.backend,
        })

    def chunks(self, n: int, now: float) -> int:
        """``n`` more content chunks reached the client: the output tokens they surely
        carried (``tokens_in_chunks``), told to the core."""
        before, self._chunks = self._chunks, self._chunks + n
        tokens = (tokens_in_chunks(before + n, self._interval)
                  - tokens_in_chunks(before, self._interval))
        self.core.on_tokens_streamed(self.request, tokens, now)
        return tokens

    def streamed(self, tokens: int, now: float) -> None:
        """``tokens`` output tokens reached the client (a front that counts tokens, not
        chunks)."""
        self.core.on_tokens_streamed(self.request, tokens, now)

    def _partial(self) -> tuple[int, int]:
        """Tokens a cut-off stream delivered: what passed through and, once the first came
        back, its prompt."""
        streamed = self.request.streamed_output_tokens
        return (self.request.prompt_tokens if streamed else 0), streamed

    def relayed(self, outcome: RelayOutcome, now: float) -> End:
        """The relay ended: completed (a whole answer), cancelled (the client left), or
        failed (the backend's own error answer, or a stream it broke off)."""
        if outcome.client_gone:
            return self.client_gone(now, outcome.status)
        request, core = self.request, self.core
        if outcome.status == 200 and not outcome.broken:
            usage = outcome.usage
            prompt = usage.prompt_tokens if usage else request.prompt_tokens
            output = usage.completion_tokens if usage else request.streamed_output_tokens
            if not self.stream and usage is not None:
                core.on_tokens_streamed(request, output, now)
            reporting = self._backend not in core.unreported
            core.on_completed(request, prompt, output, now,
                              usage.cached_tokens if usage else None)
            return End("completed", outcome.status, tokens=(prompt, output),
                       unreported=reporting and self._backend in core.unreported)
        if outcome.broken:
            end = End("failed", outcome.status, BACKEND_FAILED, self._partial(),
                      outcome.error or "stream broke")
        else:
            # A backend's own error answer (4xx/5xx) passes through: the request failed.
            end = End("failed", outcome.status, f"backend_{outcome.status}")
        core.on_failed(request, request.prompt_tokens if outcome.broken else 0,
                       request.streamed_output_tokens, now)
        return end

    def client_gone(self, now: float, status: int | None = None) -> End:
        """The client went away: a queued request leaves the queue; one dispatched but not
        yet sent ends with nothing consumed; one being relayed ends with what streamed (its
        backend request aborted by the front)."""
        request = self.request
        if request.state is RequestState.QUEUED:
            self.core.cancel(request.id, now)
            return End("cancelled", status)
        if request.state is RequestState.ENDED:
            return End("cancelled", status)  # its dispatch found its handler gone: ended
        if not self._sent:
            # Dispatched in the same instant the client left: it never reached a backend.
            self.core.on_client_gone(request, 0, 0, now)
            return End("cancelled", status)
        self.core.on_client_gone(request, request.prompt_tokens,
                                 request.streamed_output_tokens, now)
        return End("cancelled", status, tokens=self._partial())

    def crashed(self, now: float) -> None:
        """The front failed while relaying (a bug): the request failed with what streamed."""
        self.core.on_failed(self.request, self.request.prompt_tokens,
                            self.request.streamed_output_tokens, now)

    def unreachable(self, now: float) -> None:
        """The backend never got the request (connection refused): back to its place in the
        queue, for another attempt. Mark the backend failed first."""
        self._sent = False
        self.core.dispatch_failed(self.request, now)

    def backend_failed(self, error: str, headers: dict[str, str], now: float) -> ApiError:
        """The backend took the request and failed before answering: the 502 to send (not
        retried: a request that crashes backends must not visit them all)."""
        self.core.on_failed(self.request, 0, 0, now)
        return ApiError(502, BACKEND_FAILED, f"the backend failed before answering: {error}",
                        "server_error", headers)

    def given_up(self, now: float) -> ApiError:
        """No backend could be reached in ``MAX_DISPATCH_ATTEMPTS`` attempts: the 502."""
        self.core.on_failed(self.request, 0, 0, now)
        return ApiError(502, BACKEND_UNAVAILABLE,
                        f"no backend could be reached in {MAX_DISPATCH_ATTEMPTS} attempts",
                        "server_error", {headers_.TENANT: self.request.tenant})
