"""The emulator's HTTP face: vLLM's OpenAI-compatible server over the step model.

One task owns the engine loop (:class:`EngineRunner`); request handlers only submit sequences
and relay the tokens the loop hands them. aiohttp serves it (chosen by measurement, see
benchmarks/RESULTS.md), orjson encodes the chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from weighbridge.emulator.api import (
    ApiError,
    Endpoint,
    GenerationRequest,
    PoolingRequest,
    ResponseShape,
    embedding_vector,
    embeddings_response,
    new_request_id,
    parse_embedding_request,
    parse_generation_request,
    tokenize,
)
from weighbridge.emulator.engine import EngineConfig, Sequence, StepModel
from weighbridge.emulator.eos import EosModel
from weighbridge.emulator.frontend import ApiFrontEnd
from weighbridge.emulator.intake import engine_sequences
from weighbridge.emulator.metrics import EngineMetrics
from weighbridge.emulator.options import LoraModule
from weighbridge.emulator.pooling import (
    BinaryAnswer,
    new_pooling_id,
    parse_pooling_request,
    pooling_response,
)
from weighbridge.emulator.profiles import StepTimeProfile
from weighbridge.emulator.tokenizer import RULE, Tokenizer
from weighbridge.endpoints import EndpointKind

MAX_BODY_BYTES = 16 * 1024 * 1024


@dataclass(slots=True)
class TokenStream:
    """Tokens the engine produced for one request that its handler has not sent yet.

    As vLLM's output processor with a ``stream_interval`` of N
    (vllm/v1/engine/output_processor.py): the first token is handed over at once, then the
    tokens are held until N are unsent, and the rest go with the finish. The handler sends
    what it was handed as one chunk (several, merged, if it fell behind).
    """

    seq: Sequence
    seed: int
    interval: int = 1  # tokens per chunk
    pending: int = 0  # handed to the handler, not sent yet
    held: int = 0  # generated, not handed over until the interval fills
    handed: int = 0  # handed over in all
    finished: bool = False
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)

    def emitted(self) -> None:
        """The engine generated one more token."""
        self.held += 1
        if self.handed == 0 or self.held >= self.interval:
            self._hand_over()

    def finish(self) -> None:
        """The engine finished the sequence: the held tokens go with the finish."""
        self.finished = True
        self._hand_over()

    def _hand_over(self) -> None:
        self.pending += self.held
        self.handed += self.held
        self.held = 0
        self.wakeup.set()


class EngineRunner:
    """Owns the step model and drives it with the wall clock.

    Steps are scheduled on the model's timeline, not from wherever the previous sleep
    happened to wake: the event loop's timers overshoot by up to a millisecond, and
    restarting each step from the late wake-up would make the emulated engine slower than its
    model. Only when the loop falls behind by more than ``MAX_CATCH_UP_S`` (an overloaded
    process) does the timeline resynchronise with the wall clock.
    """

    MAX_CATCH_UP_S = 0.005

    def __init__(self, model: StepModel, metrics: EngineMetrics,
                 clock: Callable[[], float] = time.monotonic,
                 tokenizer: Tokenizer = RULE) -> None:
        self.model = model
        self.metrics = metrics
        self.clock = clock
        self.tokenizer = tokenizer
        self._streams: dict[str, TokenStream] = {}
        self._work = asyncio.Event()
        self._seeds = 0
        self._front_end = ApiFrontEnd(model.profile)
        # Every step takes this many times its modelled duration: an engine that slows down at
        # run time (thermal throttling, a noisy GPU neighbour) for chaos tests.
        self.slowdown = 1.0

    def submit(self, seq: Sequence, *, interval: int = 1) -> TokenStream:
        """Hand a request to the engine after the API server's per-request work: a serial
        part (one request at a time, as vLLM's frontend, queued behind the streaming work
        of the tokens already generated, longer while the engine has work) and a parallel
        latency (emulator/frontend.py).
        Its tokens reach the stream ``interval`` at a time (:class:`TokenStream`)."""
        self.model.check(seq)
        self._seeds += 1
        stream = TokenStream(seq=seq, seed=self._seeds, interval=interval)
        # Its decode blocks hash the ids of the words it streams: a next turn that resends
        # the answer hits them, as in vLLM.
        seq.output_ids = functools.partial(self.tokenizer.output_id, self._seeds)
        self._streams[seq.request_id] = stream
        if self._front_end.instant:
            self._enter_engine(seq)
        else:
            now = self.clock()
            ready = self._front_end.ready_at(now, self.model.has_work)
            asyncio.get_running_loop().call_later(ready - now, self._enter_engine, seq)
        return stream

    def _enter_engine(self, seq: Sequence) -> None:
        if seq.request_id not in self._streams:
            return  # aborted while the API server was still on it
        self.model.add(seq)
        self._work.set()

    def abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        seq = self.model.abort(request_id, self.clock())
        if seq is not None:
            self.metrics.on_finish(seq)
        if stream is not None:
            stream.finished = True
            stream.wakeup.set()

    async def run(self) -> None:
        model = self.model
        timeline: float | None = None  # the model's clock: when the next step starts
        while True:
            if not model.has_work:
                timeline = None
                self._work.clear()
                await self._work.wait()
                continue
            now = self.clock()
            start = now if timeline is None or now - timeline > self.MAX_CATCH_UP_S else timeline
            batch = model.schedule(start)
            if batch is None:
                # Waiting work that cannot be admitted yet cannot exist without running work,
                # so this only happens between an abort and the loop noticing it.
                timeline = None
                await asyncio.sleep(0)
                continue
            target_end = start + batch.duration_s * self.slowdown
            delay = target_end - self.clock()
            # Even a late step yields, so handlers get to write what the last one produced.
            await asyncio.sleep(max(delay, 0.0))
            end = self.clock()
            timeline = target_end
            result = model.complete(batch, end)
            self.metrics.on_step(result, lag_s=end - target_end)
            if result.emitted:
                self._front_end.streamed(end, len(result.emitted))
            for seq in result.emitted:
                stream = self._streams.get(seq.request_id)
                if stream is not None:
                    stream.emitted()
            for seq in result.finished:
                self.metrics.on_finish(seq)
                stream = self._streams.pop(seq.request_id, None)
                if stream is not None:
                    stream.finish()


@dataclass(frozen=True, slots=True)
class EmulatorSettings:
    model_name: str = "weighbridge-emulator"
    engine: EngineConfig = field(default_factory=EngineConfig)
    profile_name: str = "cpu-tiny"
    seed: int = 0
    mean_output_tokens: float = 128.0
    vocab_size: int = 32000
    # How the KV cache was sized, as vLLM's flags (reported in vllm:cache_config_info):
    # a block count (--num-gpu-blocks-override) and/or bytes (--kv-cache-memory-bytes);
    # engine.num_kv_blocks is the result either way.
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    # vLLM's --enable-lora and --lora-modules (the adapters' max_loras is in engine).
    enable_lora: bool = False
    lora_modules: tuple[LoraModule, ...] = ()
    # vLLM's --stream-interval: tokens per streamed chunk, unless a request asks for more.
    stream_interval: int = 1
    # vLLM's --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens.
    enable_prompt_tokens_details: bool = False
    # vLLM's --tokenizer: what counts and numbers prompt tokens (emulator/tokenizer.py).
    tokenizer: Tokenizer = RULE
    # vLLM's VLLM_SERVER_DEV_MODE=1: /server_info serves the engine's configuration.
    dev_mode: bool = False
    # A non-zero priority under fcfs: 400, as vLLM's V0 engine answered, instead of accepted
    # and ignored, as vLLM 0.32's V1 engine does (tests/conformance/test_scheduling_policy.py).
    refuse_priority_under_fcfs: bool = False

    def __post_init__(self) -> None:
        if self.lora_modules and not self.enable_lora:
            raise ValueError("LoRA is not enabled. Use --enable-lora to enable LoRA.")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.stream_interval}")


class Emulator:
    """The aiohttp application around one :class:`EngineRunner`."""

    def __init__(self, settings: EmulatorSettings, profile: StepTimeProfile) -> None:
        self.settings = settings
        self.model = StepModel(settings.engine, profile)
        self.metrics = EngineMetrics(
            self.model, settings.model_name,
            num_gpu_blocks_override=settings.num_gpu_blocks_override,
            kv_cache_memory_bytes=settings.kv_cache_memory_bytes,
            max_loras=settings.engine.max_loras if settings.enable_lora else None)
        self.adapters = {m.name: m for m in settings.lora_modules}
        # What every request is parsed against: the served model and its limits.
        self._served: dict[str, Any] = {
            "served_model": settings.model_name, "max_model_len": settings.engine.max_model_len,
            "vocab_size": settings.vocab_size, "adapters": self.adapters,
            "tokenizer": settings.tokenizer}
        self.runner = EngineRunner(self.model, self.metrics, tokenizer=settings.tokenizer)
        self.eos = EosModel(settings.mean_output_tokens, settings.seed)
        self.app = web.Application(client_max_size=MAX_BODY_BYTES,
                                   middlewares=[self._errors])
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_post(EndpointKind.EMBEDDINGS, self.embeddings)
        for kind in (EndpointKind.POOLING, EndpointKind.CLASSIFY, EndpointKind.SCORE,
                     EndpointKind.RERANK):
            for path in kind.paths:
                self.app.router.add_post(path, functools.partial(self.pooling, kind))
        self.app.router.add_post("/tokenize", self.tokenize)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/version", self.version)
        self.app.router.add_get("/metrics", self.metrics_endpoint)
        self.app.router.add_post("/admin/slowdown", self.slowdown)
        if settings.dev_mode:
            self.app.router.add_get("/server_info", self.server_info)
        self.app.cleanup_ctx.append(self._engine_task)

    async def _engine_task(self, _app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(self.runner.run(), name="engine-loop")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as e:
            return _json_response(e.body(), status=e.status)
        except web.HTTPRequestEntityTooLarge as e:
            return _json_response(ApiError(413, e.text or "request body too large").body(), 413)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            err = ApiError(e.status, e.reason, "NotFoundError" if e.status == 404 else
                           "BadRequestError")
            return _json_response(err.body(), status=e.status)

    # -- endpoints --------------------------------------------------------------------------

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def server_info(self, _request: web.Request) -> web.Response:
        """vLLM's development endpoint, the parts of ``vllm_config`` the emulator has (the
        JSON form, ``?config_format=json``, which is what a client can read a field of)."""
        engine = self.settings.engine
        return _json_response({
            "vllm_config": {
                "model_config": {"served_model_name": self.settings.model_name,
                                 "max_model_len": engine.max_model_len},
                "cache_config": {"block_size": engine.block_size,
                                 "num_gpu_blocks_override": engine.num_kv_blocks,
                                 "enable_prefix_caching": engine.enable_prefix_caching},
                "scheduler_config": {"policy": engine.scheduling_policy,
                                     "max_num_seqs": engine.max_num_seqs,
                                     "max_num_batched_tokens": engine.max_num_batched_tokens},
            },
            "vllm_env": {"VLLM_SERVER_DEV_MODE": True},
            "system_env": {},
        })

    def _refuse_priority(self, requested: int) -> None:
        """Under fcfs a request's priority is ignored (``engine_sequences``), or refused as
        vLLM's V0 engine did. Checked after the sequences are made, so every parsed
        generation request takes one draw of the EOS model, refused or not."""
        if (self.settings.engine.scheduling_policy == "fcfs" and requested
                and self.settings.refuse_priority_under_fcfs):
            raise ApiError(400, f"Got priority {requested} but Priority scheduling is not "
                           "enabled.")

    async def version(self, _request: web.Request) -> web.Response:
        return _json_response({"version": "0.32.0"})

    async def models(self, _request: web.Request) -> web.Response:
        """The served model's card, then one per LoRA adapter (vLLM's shape: ``root`` the
        adapter's path, ``parent`` the served model, no ``max_model_len``)."""
        s = self.settings
        now = int(time.time())
        permission = [{
            "id": "modelperm-weighbridge", "object": "model_permission",
            "created": now, "allow_create_engine": False, "allow_sampling": True,
            "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
            "allow_fine_tuning": False, "organization": "*", "group": None,
            "is_blocking": False}]
        cards = [{"id": s.model_name, "object": "model", "created": now,
                  "owned_by": "vllm", "root": s.model_name, "parent": None,
                  "max_model_len": s.engine.max_model_len, "permission": permission}]
        cards += [{"id": m.name, "object": "model", "created": now, "owned_by": "vllm",
                   "root": m.path, "parent": s.model_name, "max_model_len": None,
                   "permission": permission} for m in s.lora_modules]
        return _json_response({"object": "list", "data": cards})

    async def metrics_endpoint(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def slowdown(self, request: web.Request) -> web.Response:
        """``POST /admin/slowdown {"factor": F}``: from the next step on, every step takes F
        times its modelled duration (1 restores the profile). Not a vLLM endpoint."""
        try:
            factor = orjson.loads(await request.read())["factor"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            raise ApiError(400, 'expected a JSON body {"factor": <number>}') from None
        if isinstance(factor, bool) or not isinstance(factor, int | float) \
                or not math.isfinite(factor) or factor <= 0:
            raise ApiError(400, "factor must be a positive finite number")
        self.runner.slowdown = float(factor)
        return _json_response({"factor": self.runner.slowdown})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /tokenize``: the token ids the engine (and its prefix cache) sees."""
        s = self.settings
        ids = tokenize(await self._json_body(request), served_model=s.model_name,
                       vocab_size=s.vocab_size, adapters=self.adapters,
                       tokenizer=s.tokenizer)
        return _json_response({"count": len(ids), "max_model_len": s.engine.max_model_len,
                               "tokens": list(ids), "token_strs": None})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate("completions", request)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate("chat", request)

    async def _generate(self, endpoint: Endpoint, request: web.Request) -> web.StreamResponse:
        body = await self._json_body(request)
        s = self.settings
        req = parse_generation_request(endpoint, body, **self._served)
        request_id = new_request_id(endpoint)
        (seq,) = engine_sequences(req, request_id, self.runner.clock(), self.eos,
                                  s.engine.scheduling_policy)
        self._refuse_priority(req.priority)
        try:
            stream = self.runner.submit(seq, interval=self._stream_interval(req))
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        shape = ResponseShape.for_request(
            req, request_id, prompt_tokens_details=s.enable_prompt_tokens_details)
        try:
            if req.stream:
                return await self._stream(request, req, shape, stream)
            return await self._whole(shape, stream)
        except ConnectionResetError:
            # The client hung up mid-stream: not an error of ours; the sequence is aborted
            # below. The response is over, so there is nothing to send.
            return web.Response(status=499)
        finally:
            if not seq.is_finished:
                # The client went away (handler cancelled or a write failed): free the slot.
                self.runner.abort(request_id)

    def _stream_interval(self, req: GenerationRequest) -> int:
        """Tokens per chunk, as vLLM: a request's ``stream_interval`` raises the server's,
        never lowers it; a whole (non-stream) response ignores both."""
        if not req.stream:
            return 1
        return max(req.stream_interval or 1, self.settings.stream_interval)

    async def embeddings(self, request: web.Request) -> web.Response:
        """Each input is a prefill-only request to the engine (vLLM's pooling runner); the
        answer waits for all of them."""
        body = await self._json_body(request)
        req = parse_embedding_request(body, **self._served)
        request_id = f"embd-{uuid.uuid4().hex[:16]}"
        if not await self._pool(req, request_id):
            return web.Response(status=499)  # aborted: the client is gone
        return _json_response(embeddings_response(
            req, request_id, [embedding_vector(ids) for ids in req.input_ids]))

    async def pooling(self, kind: EndpointKind, request: web.Request) -> web.Response:
        """``/pooling``, ``/classify``, ``/score`` and ``/rerank`` (emulator/pooling.py): every
        input a prefill-only request to the engine, the answer once all are done."""
        body = await self._json_body(request)
        req = parse_pooling_request(kind, body, **self._served)
        request_id = new_pooling_id(kind)
        if not await self._pool(req, request_id):
            return web.Response(status=499)
        answer = pooling_response(req, request_id)
        if isinstance(answer, BinaryAnswer):
            headers = {} if answer.metadata is None else {"metadata": answer.metadata}
            return web.Response(body=answer.body, headers=headers,
                                content_type="application/octet-stream")
        return _json_response(answer)

    async def _pool(self, req: PoolingRequest, request_id: str) -> bool:
        """Run every input of ``req`` through the engine; False if the client left first
        (its sequences are aborted, their KV blocks freed)."""
        seqs = engine_sequences(req, request_id, self.runner.clock(), self.eos,
                                self.settings.engine.scheduling_policy)
        self._refuse_priority(req.priority)
        submitted: list[TokenStream] = []
        try:
            for seq in seqs:
                try:
                    submitted.append(self.runner.submit(seq))
                except ValueError as e:
                    raise ApiError(400, str(e)) from None
            for stream in submitted:
                while not stream.finished:
                    await stream.wakeup.wait()
                    stream.wakeup.clear()
            return all(seq.is_finished and seq.finish_reason != "abort" for seq in seqs)
        finally:
            for seq in seqs:
                if not seq.is_finished:
                    self.runner.abort(seq.request_id)

    async def _json_body(self, request: web.Request) -> Any:
        if request.content_type != "application/json":
            raise ApiError(400, "1 validation error:\n  Unsupported Media Type: Only "
                           "'application/json' is allowed", "Bad Request")
        raw = await request.read()
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise ApiError(400, f"JSON decode error: {e}", "Bad Request") from None

    async def _whole(self, shape: ResponseShape, stream: TokenStream) -> web.Response:
        while not stream.finished:
            await stream.wakeup.wait()
            stream.wakeup.clear()
        seq = stream.seq
        tokenizer = self.settings.tokenizer
        output = tokenizer.output_text(stream.seed, 0, seq.output_tokens)
        body = shape.full_response(
            output, seq.finish_reason or "abort", seq.output_tokens, seq.num_cached_tokens,
            seq.num_cache_creation_tokens,
            tokenizer.output_ids(stream.seed, 0, seq.output_tokens))
        return _json_response(body)

    async def _stream(self, request: web.Request, req: GenerationRequest, shape: ResponseShape,
                      stream: TokenStream) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await response.prepare(request)
        if req.endpoint == "chat":
            await response.write(_sse(shape.role_chunk()))
        sent = 0
        seq = stream.seq
        while True:
            await stream.wakeup.wait()
            stream.wakeup.clear()
            count = stream.pending
            stream.pending = 0
            done = stream.finished
            if count:
                # A slow reader gets the tokens it missed merged into one chunk, as vLLM does
                # (with a stream interval, every chunk handed over since it last wrote).
                delta = self.settings.tokenizer.output_text(stream.seed, sent, count)
                ids = self.settings.tokenizer.output_ids(stream.seed, sent, count)
                first = sent == 0
                sent += count
                reason = seq.finish_reason if done and seq.finish_reason != "abort" else None
                await response.write(_sse(shape.delta_chunk(delta, reason, sent, ids, first)))
            if done:
                break
        if req.include_usage:
            await response.write(_sse(shape.usage_chunk(
                sent, seq.num_cached_tokens, seq.num_cache_creation_tokens)))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _sse(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _json_response(obj: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def run_emulator(settings: EmulatorSettings, profile: StepTimeProfile, host: str,
                 port: int) -> None:
    """Serve until interrupted (the CLI's entry point)."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        pass
    emulator = Emulator(settings, profile)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts the
    # sequence and frees its KV blocks at once, as vLLM does.
    web.run_app(emulator.app, host=host, port=port, print=None, access_log=None,
                handler_cancellation=True)
