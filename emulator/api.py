"""The OpenAI-compatible request surface of the emulator: parsing, validation and the shapes of
responses, as vLLM's OpenAI server produces them. Pure: bodies in, dicts out.
"""

from __future__ import annotations

import base64
import hashlib
import math
import re
import struct
import time
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import Field, TypeAdapter, ValidationError

from weighbridge import output_budget
from weighbridge.emulator.tiny_model import HIDDEN_SIZE
from weighbridge.emulator.tokenizer import RULE, Tokenizer

Endpoint = Literal["completions", "chat"]

# What vLLM 0.32 puts in the field; clients that parse it see a plausible value.
SYSTEM_FINGERPRINT = "vllm-0.32.0-weighbridge-emulator"


class ApiError(Exception):
    """An error answered with an OpenAI error body; never a 500 for bad input."""

    def __init__(self, status: int, message: str, type_: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.status}}


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    endpoint: Endpoint
    model: str  # the name answered with: the served model's, or the LoRA adapter's
    prompt_tokens: int
    max_tokens: int
    ignore_eos: bool
    priority: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    user: str | None
    lora: str | None = None  # the LoRA adapter that serves it
    # Tokens per streamed chunk the request asks for; the server's --stream-interval may
    # raise it (vLLM takes the larger).
    stream_interval: int | None = None
    prompt_ids: tuple[int, ...] = ()  # what the prefix cache hashes
    # vLLM's return_token_ids: answers carry the output's (and prompt's) token ids.
    return_token_ids: bool = False


T = TypeVar("T")

# vLLM's type of the field on both endpoints (vllm/entrypoints/openai/completion/protocol.py
# and chat_completion/protocol.py), validated by pydantic in lax mode as vLLM's FastAPI does:
# true is 1, 4.0 and "8" are integers, false is 0 and so below the bound.
_STREAM_INTERVAL: TypeAdapter[int | None] = TypeAdapter(Annotated[int, Field(ge=1)] | None)

# vLLM's stand-in for a rejected value in its message is cut at this many characters, a
# rendered error at _MAX_ERROR_CHARS, and a message lists at most _MAX_REPORTED_ERRORS
# (vllm/entrypoints/serve/exception_handling/handlers/validation.py).
_MAX_ERROR_INPUT_CHARS = 200
_MAX_ERROR_CHARS = 1000
_MAX_REPORTED_ERRORS = 10
# The segments of a pydantic error's location that vLLM leaves out of its message and
# `param`: pydantic's names for its wrappers and for a union's branches (vLLM's request
# models are wrapped, so their branches are named in brackets, which vLLM drops too).
_INTERNAL_LOC = frozenset({
    "function-wrap", "function-after", "function-before", "function-plain", "json-or-python",
    "lax-or-strict", "chain", "default", "nullable", "tagged-union", "union", "call",
    "arguments", "is-instance", "is-subclass", "callable", "str", "int", "float", "bool",
    "bytes", "bytearray", "list", "tuple", "dict", "set", "frozenset", "complex", "none",
    "nonetype"})
_BRACKETED = re.compile(r"[\[\]{}()]")


def _validated(body: dict[str, Any], name: str, adapter: TypeAdapter[T]) -> T:
    """``body[name]`` as vLLM's request model validates it; else vLLM's 400 for a request
    body that fails validation."""
    try:
        return adapter.validate_python(body.get(name))
    except ValidationError as e:
        raise validation_error(e, ("body", name)) from None


def validation_error(error: ValidationError, loc: tuple[str, ...] = ("body",),
                     branches: Collection[str] = ()) -> ApiError:
    """vLLM's 400 for a request body that fails validation: FastAPI's error as vLLM renders
    it, each of pydantic's errors with its ``loc`` joined into one dotted string (less the
    union ``branches`` and pydantic's own markers) and its ``input`` summarised, the first
    error's location the ``param``. ``loc``: where the validated value sits in the body."""
    errors = error.errors(include_url=False)
    # vLLM prints each error's dict with its keys in pydantic's order.
    located = [{**e, "loc": _dotted((*loc, *map(str, e["loc"])), branches),
                "input": _error_input(e["input"])} for e in errors]
    rendered = []
    for e in located[:_MAX_REPORTED_ERRORS]:
        text = str(e)
        rendered.append(text if len(text) <= _MAX_ERROR_CHARS
                        else text[:_MAX_ERROR_CHARS] + "...[truncated]")
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "\n".join(f"  {r}" for r in rendered)
    if len(errors) > _MAX_REPORTED_ERRORS:
        message += f"\n  ...and {len(errors) - _MAX_REPORTED_ERRORS} more {label}"
    return ApiError(400, message, "Bad Request",
                    param=str(located[0]["loc"]) if located else None)


def _dotted(loc: tuple[str, ...], branches: Collection[str]) -> str:
    parts = [p for p in loc if p not in branches and p.lower() not in _INTERNAL_LOC
             and not _BRACKETED.search(p)]
    return ".".join(parts or loc)


def _error_input(value: Any) -> str:
    """A rejected JSON value as vLLM's message shows it: a container by its size, anything
    else as text, cut short."""
    if isinstance(value, list | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = value if isinstance(value, str) else str(value)
    if len(text) > _MAX_ERROR_INPUT_CHARS:
        return text[:_MAX_ERROR_INPUT_CHARS] + "...[truncated]"
    return text


def _int_field(body: dict[str, Any], name: str, default: int | None) -> int | None:
    value = body.get(name, default)
    if value is None:
        return None
    # bool is an int subclass in Python; JSON true is not a valid integer here.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer, got {value!r}", param=name)
    return value


def _bool_field(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be a boolean, got {value!r}", param=name)
    return value


def _prompt_ids(endpoint: Endpoint, body: dict[str, Any], vocab_size: int,
                tokenizer: Tokenizer, add_generation_prompt: bool = True) -> tuple[int, ...]:
    """The prompt's token ids (text by ``tokenizer``, emulator/tokenizer.py): what the
    prefix cache hashes, and whose number is the prompt's tokens."""
    if endpoint == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            # A text prompt is tokenized with a BOS token in front, as vLLM's Llama does.
            return tokenizer.prompt_ids(prompt)
        if (ids := _token_ids(prompt, vocab_size)) is not None:
            return ids
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            return _prompt_ids(endpoint, {"prompt": prompt[0]}, vocab_size, tokenizer)
        if isinstance(prompt, list) and len(prompt) > 1:
            raise ApiError(400, "the emulator serves one prompt per request", param="prompt")
        if prompt is None or prompt == "":
            raise ApiError(400, "Either prompt or prompt_embeds must be provided and non-empty."
                           " (parameter=prompt)", param="prompt")
        if prompt == []:
            raise ApiError(400, "You must pass at least one prompt")
        raise ApiError(400, "prompt must be a string or a non-empty list of token ids",
                       param="prompt")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    turns: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string role",
                           param="messages")
        content = message.get("content", "")
        if content is None:
            content = ""
        if isinstance(content, list):
            # The OpenAI content-parts form: only text parts carry tokens here.
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str
                ):
                    raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                                   param="messages")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", param="messages")
        turns.append((message["role"], content))
    return tokenizer.chat_ids(turns, add_generation_prompt)


def tokenize(body: Any, *, served_model: str, vocab_size: int,
             adapters: Collection[str] = (), tokenizer: Tokenizer = RULE) -> tuple[int, ...]:
    """vLLM's ``POST /tokenize``: a text ``prompt`` (BOS first unless ``add_special_tokens``
    is false) or chat ``messages`` (the reply's opening last unless
    ``add_generation_prompt`` is false), numbered as the emulator's tokenizer numbers them."""
    _check_model(body, served_model, adapters)
    if "messages" in body:
        return _prompt_ids("chat", body, vocab_size, tokenizer,
                           _bool_field(body, "add_generation_prompt", True))
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise ApiError(400, "prompt must be a string", param="prompt")
    return tokenizer.prompt_ids(prompt, _bool_field(body, "add_special_tokens", True))


def _check_model(body: Any, served_model: str, adapters: Collection[str]) -> str | None:
    """The body is an object naming the served model, one of its LoRA ``adapters`` (whose
    name is returned), or none (vLLM then serves its own model). As vLLM, the 404 lists
    only the served model's names, never the adapters."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model", served_model)
    if model is None or model == "" or model == served_model:
        return None  # vLLM serves its own model when the name is missing or empty
    if isinstance(model, str) and model in adapters:
        return model
    raise ApiError(404, f"The model `{model}` does not exist. Valid aliases: "
                   f"{served_model}.", "NotFoundError", "model")


def pooling_model(name: Any, served_model: str, adapters: Collection[str]) -> str | None:
    """The LoRA adapter a pooling request's ``model`` names, None for the served model (or
    none named), or vLLM's 404 for a pooling request (which, unlike generation's, lists no
    aliases)."""
    if name is None or name == "" or name == served_model:
        return None
    if isinstance(name, str) and name in adapters:
        return name
    raise ApiError(404, f"The model `{name}` does not exist.", "NotFoundError")


def _check_context(prompt_tokens: int, max_model_len: int) -> None:
    if prompt_tokens > max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains at least {prompt_tokens} input tokens, which exceeds this limit "
            "even without any output tokens. Please reduce the length of the input prompt. "
            f"(parameter=input_tokens, value={prompt_tokens})",
            param="input_tokens",
        )


def parse_generation_request(
    endpoint: Endpoint,
    body: Any,
    *,
    served_model: str,
    max_model_len: int,
    vocab_size: int,
    adapters: Collection[str] = (),
    tokenizer: Tokenizer = RULE,
) -> GenerationRequest:
    # vLLM's pydantic model rejects a field of the wrong type before the model is looked up.
    stream_interval = (_validated(body, "stream_interval", _STREAM_INTERVAL)
                       if isinstance(body, dict) else None)
    lora = _check_model(body, served_model, adapters)
    n = _int_field(body, "n", 1)
    if n != 1:
        raise ApiError(400, "the emulator supports n=1 only", param="n")
    prompt_ids = _prompt_ids(endpoint, body, vocab_size, tokenizer)
    prompt_tokens = len(prompt_ids)
    budget_field = output_budget.budget_field(endpoint == "chat", body)
    max_tokens = _int_field(body, budget_field, None)
    if max_tokens is None and endpoint != "chat":
        max_tokens = output_budget.COMPLETIONS_DEFAULT_MAX_TOKENS
    _check_context(prompt_tokens, max_model_len)
    if max_tokens is not None and max_tokens > max_model_len:
        raise ApiError(400, f"{budget_field}={max_tokens} cannot be greater than "
                       f"max_model_len={max_model_len}. Please request fewer output tokens. "
                       f"(parameter={budget_field}, value={max_tokens})", param=budget_field)
    # vLLM 0.32 clamps a max_tokens that fits the model but not the context left.
    room = max_model_len - prompt_tokens
    max_tokens = room if max_tokens is None else min(max_tokens, room)
    if max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}. "
                       f"(parameter=max_tokens, value={max_tokens})", param="max_tokens")
    stream = _bool_field(body, "stream", False)
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    stream_options = stream_options or {}
    if stream_options and not stream:
        raise ApiError(400, "Stream options can only be defined when `stream=True`.",
                       param="stream_options")
    priority = _int_field(body, "priority", 0)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(400, "user must be a string", param="user")
    return GenerationRequest(
        endpoint=endpoint,
        model=lora or served_model,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        ignore_eos=_bool_field(body, "ignore_eos", False),
        priority=priority or 0,
        stream=stream,
        include_usage=_bool_field(stream_options, "include_usage", False),
        continuous_usage=_bool_field(stream_options, "continuous_usage_stats", False),
        user=user,
        lora=lora,
        stream_interval=stream_interval,
        prompt_ids=prompt_ids,
        return_token_ids=_bool_field(body, "return_token_ids", False),
    )


# /v1/embeddings ------------------------------------------------------------------------------

# The width of an embedding: the hidden size of the tiny model that real vLLM serves in
# pooling mode in the conformance suite (last-token pooling of the final hidden state).
EMBEDDING_SIZE = HIDDEN_SIZE


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolingRequest:
    """A request vLLM's pooling runner serves: each input a prefill-only request to the
    engine, whose one output is the pooled state at the end of its prefill."""

    model: str  # the name answered with: the served model's, or the LoRA adapter's
    input_ids: tuple[tuple[int, ...], ...]  # each input's token ids, as the engine sees it
    priority: int = 0
    user: str | None = None
    lora: str | None = None  # the LoRA adapter that serves it

    @property
    def usage_tokens(self) -> int:
        """The prompt tokens its answer's usage counts: every input's."""
        return sum(map(len, self.input_ids))


@dataclass(frozen=True, slots=True, kw_only=True)
class EmbeddingRequest(PoolingRequest):
    """One /v1/embeddings request."""

    inputs: tuple[tuple[int, ...] | str, ...]  # token ids, or text
    prompt_tokens: tuple[int, ...]  # per input
    encoding_format: Literal["float", "base64"]


def _token_ids(value: Any, vocab_size: int) -> tuple[int, ...] | None:
    """``value`` as a non-empty list of token ids, or None if it is not one."""
    if not isinstance(value, list) or not value or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in value):
        return None
    bad = next((t for t in value if t < 0 or t >= vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"Token id {bad} is out of vocabulary")
    return tuple(value)


def parse_embedding_request(body: Any, *, served_model: str, max_model_len: int,
                            vocab_size: int, adapters: Collection[str] = (),
                            tokenizer: Tokenizer = RULE) -> EmbeddingRequest:
    """``input``: a string, a list of strings, a list of token ids, or a list of lists of
    token ids, as OpenAI's embeddings API and vLLM take it."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    lora = pooling_model(body.get("model"), served_model, adapters)
    raw = body.get("input")
    inputs: list[tuple[int, ...] | str]
    ids = _token_ids(raw, vocab_size)
    if isinstance(raw, str):
        inputs = [raw]
    elif ids is not None:
        inputs = [ids]
    elif isinstance(raw, list) and raw and all(isinstance(x, str) for x in raw):
        inputs = list(raw)
    elif isinstance(raw, list) and raw and all(isinstance(x, list) for x in raw):
        inputs = []
        for x in raw:
            one = _token_ids(x, vocab_size)
            if one is None:
                raise ApiError(400, "input: every list of token ids must be non-empty",
                               param="input")
            inputs.append(one)
    else:
        raise ApiError(400, "input must be a string, a list of strings, a list of token ids "
                       "or a list of lists of token ids, and not empty", param="input")
    if any(x == "" for x in inputs):
        raise ApiError(400, "input must not contain an empty string", param="input")
    # A text input is tokenized with a BOS token in front, as for a completions prompt.
    input_ids = tuple(tokenizer.prompt_ids(x) if isinstance(x, str) else x for x in inputs)
    for ids_of_one in input_ids:
        _check_context(len(ids_of_one), max_model_len)
    encoding = body.get("encoding_format", "float")
    if encoding is None:
        encoding = "float"
    if encoding not in ("float", "base64"):
        raise ApiError(400, "encoding_format must be 'float' or 'base64'",
                       param="encoding_format")
    if body.get("dimensions") is not None:
        # vLLM's answer for a model without matryoshka representations (the tiny one).
        raise ApiError(400, "Model does not support matryoshka representation, changing "
                       "output dimensions will lead to poor results.", param="dimensions")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(400, "user must be a string", param="user")
    return EmbeddingRequest(model=lora or served_model, inputs=tuple(inputs),
                            input_ids=input_ids,
                            prompt_tokens=tuple(map(len, input_ids)), encoding_format=encoding,
                            priority=_int_field(body, "priority", 0) or 0, user=user,
                            lora=lora)


def pooled_state(ids: tuple[int, ...]) -> list[float]:
    """The emulated model's hidden state at the last of ``ids``, what its pooler reads:
    ``EMBEDDING_SIZE`` floats determined by the token ids alone, so the same prompt pools
    the same way every time and whatever form it came in (as on a real model)."""
    seed = hashlib.sha256(repr(tuple(ids)).encode()).digest()
    raw: list[float] = []
    counter = 0
    while len(raw) < EMBEDDING_SIZE:
        block = hashlib.sha256(seed + counter.to_bytes(4, "little")).digest()
        raw.extend(b / 127.5 - 1.0 for b in block)
        counter += 1
    return raw[:EMBEDDING_SIZE]


def normalised(vector: Sequence[float]) -> list[float]:
    """``vector`` scaled to unit length (an embedding pooler's activation)."""
    norm = math.sqrt(math.fsum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]


def embedding_vector(ids: tuple[int, ...]) -> list[float]:
    """The embedding of a prompt: its pooled state as a unit vector."""
    return normalised(pooled_state(ids))


def pooling_usage(prompt_tokens: int) -> dict[str, Any]:
    """The usage of a pooling request's answer (vLLM's ``UsageInfo``): prompt tokens only."""
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
            "completion_tokens": 0, "prompt_tokens_details": None,
            "completion_tokens_details": None}


def embeddings_response(request: EmbeddingRequest, request_id: str,
                        vectors: Sequence[list[float]]) -> dict[str, Any]:
    data = []
    for i, vector in enumerate(vectors):
        embedding: list[float] | str = vector
        if request.encoding_format == "base64":
            # OpenAI's (and vLLM's) base64 form: little-endian float32s.
            embedding = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
        data.append({"index": i, "object": "embedding", "embedding": embedding})
    prompt = sum(request.prompt_tokens)
    return {"id": request_id, "object": "list", "created": int(time.time()),
            "model": request.model, "data": data,
            "usage": pooling_usage(prompt)}


def new_request_id(endpoint: Endpoint) -> str:
    prefix = "cmpl" if endpoint == "completions" else "chatcmpl"
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }


@dataclass(slots=True)
class ResponseShape:
    """Builds the JSON objects of one response, stream chunks or whole."""

    request: GenerationRequest
    request_id: str
    created: int
    # vLLM's --enable-prompt-tokens-details: usage says how many prompt tokens were cached.
    prompt_tokens_details: bool = False

    @classmethod
    def for_request(cls, request: GenerationRequest, request_id: str, *,
                    prompt_tokens_details: bool = False) -> ResponseShape:
        return cls(request=request, request_id=request_id, created=int(time.time()),
                   prompt_tokens_details=prompt_tokens_details)

    def _prompt_details(self, cached_tokens: int, created_cache_tokens: int
                        ) -> dict[str, Any] | None:
        """vLLM's ``prompt_tokens_details`` (None without the flag): chat fills
        ``created_cache_tokens`` (the prompt tokens this request put in the cache),
        completions leaves it null."""
        if not self.prompt_tokens_details:
            return None
        created = created_cache_tokens if self.request.endpoint == "chat" else None
        return {"cached_tokens": cached_tokens, "created_cache_tokens": created,
                "multimodal_tokens": None}

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created,
                "model": self.request.model, "choices": choices}

    def role_chunk(self) -> dict[str, Any]:
        chunk = self._envelope("chat.completion.chunk", [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None}
        ])
        chunk["prompt_token_ids"] = (list(self.request.prompt_ids)
                                     if self.request.return_token_ids else None)
        chunk["prompt_text"] = None
        if self.request.include_usage and self.request.continuous_usage:
            chunk["usage"] = usage(self.request.prompt_tokens, 0)  # as vLLM's role chunk
        return chunk

    def delta_chunk(self, delta_text: str, finish_reason: str | None,
                    completion_tokens: int, token_ids: Sequence[int] = (),
                    first: bool = False) -> dict[str, Any]:
        """A chunk of output; ``token_ids`` its tokens' ids, sent with ``return_token_ids``
        (and the prompt's with the ``first`` chunk of a completion, as vLLM)."""
        ids = list(token_ids) if self.request.return_token_ids else None
        if self.request.endpoint == "completions":
            prompt = (list(self.request.prompt_ids)
                      if self.request.return_token_ids and first else None)
            chunk = self._envelope("text_completion", [
                {"index": 0, "text": delta_text, "logprobs": None,
                 "finish_reason": finish_reason, "stop_reason": None,
                 "prompt_token_ids": prompt, "token_ids": ids}
            ])
        else:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": delta_text},
                                      "logprobs": None, "finish_reason": finish_reason}
            if finish_reason:
                choice["stop_reason"] = None
            choice["token_ids"] = ids
            chunk = self._envelope("chat.completion.chunk", [choice])
        if self.request.include_usage and self.request.continuous_usage:
            chunk["usage"] = usage(self.request.prompt_tokens, completion_tokens)
        return chunk

    def usage_chunk(self, completion_tokens: int, cached_tokens: int = 0,
                    created_cache_tokens: int = 0) -> dict[str, Any]:
        obj = "text_completion" if self.request.endpoint == "completions" else (
            "chat.completion.chunk")
        chunk = self._envelope(obj, [])
        chunk["usage"] = usage(self.request.prompt_tokens, completion_tokens)
        details = self._prompt_details(cached_tokens, created_cache_tokens)
        if details is not None:
            # vLLM writes the usage chunk without its null fields.
            chunk["usage"]["prompt_tokens_details"] = {
                k: v for k, v in details.items() if v is not None}
        chunk["system_fingerprint"] = SYSTEM_FINGERPRINT
        return chunk

    def full_response(self, output_text: str, finish_reason: str, completion_tokens: int,
                      cached_tokens: int = 0, created_cache_tokens: int = 0,
                      token_ids: Sequence[int] = ()) -> dict[str, Any]:
        ids = list(token_ids) if self.request.return_token_ids else None
        if self.request.endpoint == "completions":
            prompt = list(self.request.prompt_ids) if self.request.return_token_ids else None
            body = self._envelope("text_completion", [
                {"index": 0, "text": output_text, "logprobs": None,
                 "finish_reason": finish_reason, "stop_reason": None, "token_ids": ids,
                 "prompt_logprobs": None, "prompt_token_ids": prompt}
            ])
        else:
            body = self._envelope("chat.completion", [
                {"index": 0,
                 "message": {"role": "assistant", "content": output_text, "refusal": None,
                             "annotations": None, "audio": None, "function_call": None,
                             "reasoning": None},
                 "logprobs": None, "finish_reason": finish_reason, "stop_reason": None,
                 "token_ids": ids}
            ])
        body["service_tier"] = None
        body["system_fingerprint"] = SYSTEM_FINGERPRINT
        body["usage"] = {**usage(self.request.prompt_tokens, completion_tokens),
                         "prompt_tokens_details": self._prompt_details(
                             cached_tokens, created_cache_tokens),
                         "completion_tokens_details": None}
        return body
