"""vLLM's pooling endpoints on the emulator: ``/pooling``, ``/classify``, ``/score`` and
``/rerank`` (with their other paths, ``weighbridge.endpoints``), as vLLM 0.32 serves them
for a pooling model. Pure: bodies in, parsed requests and answers out.

Each input is a prefill-only request to the engine (``PoolingRequest.input_ids``, which
``emulator/intake.py`` turns into pooling sequences), and its output is the emulated
model's pooled state (``api.pooled_state``). The emulator is the tiny model under
``--runner pooling --convert embed``: ``/pooling`` runs the ``embed`` task, and ``/score``
and ``/rerank`` are a bi-encoder's, as vLLM serves them for an embedding model: every query
and every document is an input of its own (a query once, however many documents it is
scored against), and a pair's score is the cosine similarity of their embeddings.
``/classify`` is the same model under ``--convert classify``: two labels (transformers'
default ``LABEL_0`` and ``LABEL_1``), the probabilities a softmax of the pooled state's
first two values. A real vLLM instance runs one of these tasks; the emulator serves all
from one process, as it serves generation beside them.

Requests are validated by pydantic models with vLLM's field types (vLLM's FastAPI validates
them the same way, in lax mode), their errors rendered as vLLM renders them
(``api.validation_error``); the checks after validation come in vLLM's order.
"""

from __future__ import annotations

import base64
import json
import math
import struct
import sys
import time
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Required, TypeAlias, Union, cast

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, create_model
from pydantic_core import InitErrorDetails
from typing_extensions import TypedDict

from weighbridge.emulator.api import (
    ApiError,
    PoolingRequest,
    embedding_vector,
    pooled_state,
    pooling_model,
    pooling_usage,
    validation_error,
)
from weighbridge.emulator.tokenizer import RULE, Tokenizer
from weighbridge.endpoints import EndpointKind

__all__ = ["ARCHITECTURE", "CLASS_LABELS", "BinaryAnswer", "EncodeRequest", "ScoringRequest",
           "parse_pooling_request", "pooling_response"]

# What vLLM names the model in its refusals: the tiny model's architecture.
ARCHITECTURE = "LlamaForCausalLM"
# A classifier's labels, by index: transformers' default id2label for two labels.
CLASS_LABELS = ("LABEL_0", "LABEL_1")
PAD_ID = 0  # the tiny model's <pad>, which `padding: max_length` fills with
# The tasks of vLLM's pooling runner (vllm/tasks.py), and those of an embedding model.
PoolingTask = Literal["embed", "classify", "token_embed", "token_classify", "plugin",
                      "embed&token_classify"]
_EMBED_MODEL_TASKS = ("token_embed", "embed")
EmbedDType = Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
Endianness = Literal["native", "big", "little"]
EncodingFormat = Literal["float", "base64", "bytes", "bytes_only"]
_INT64 = Field(default=0, ge=-(2**63), le=2**63 - 1)


# -- vLLM's request models (vllm/entrypoints/pooling/*/protocol.py), the fields the emulator
# -- reads or validates; others are accepted and ignored, as vLLM accepts extra fields.


class _Basic(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    padding: Literal["max_length", "do_not_pad"] | None = None
    truncation_side: Literal["left", "right"] | None = None
    request_id: str | None = None
    priority: int = _INT64
    use_activation: bool | None = None


class _Completion(_Basic):
    input: list[int] | list[list[int]] | str | list[str]
    add_special_tokens: bool = True


class ChatMessage(TypedDict, total=False):
    """A chat message's fields the emulator reads (vLLM's are OpenAI's message types): typed,
    so that a body with both ``input`` and ``messages`` is read as a chat, as vLLM's union
    of its request forms reads it."""

    role: Required[str]
    content: str | list[dict[str, Any]] | None


class _Chat(_Basic):
    messages: list[ChatMessage]
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    add_special_tokens: bool = False


class _Encoding(BaseModel):
    encoding_format: EncodingFormat = "float"
    embed_dtype: EmbedDType = "float32"
    endianness: Endianness = "native"


class PoolingCompletionRequest(_Completion, _Encoding):
    task: PoolingTask | None = None
    dimensions: int | None = None


class PoolingChatRequest(_Chat, _Encoding):
    task: PoolingTask | None = None
    dimensions: int | None = None


class IOProcessorRequest(_Basic, _Encoding):
    data: Any
    task: PoolingTask = "plugin"


class ClassificationCompletionRequest(_Completion):
    pass


class ClassificationChatRequest(_Chat):
    pass


class ScoreMultiModalParam(TypedDict, total=False):
    content: Required[list[dict[str, Any]]]


ScoreInput: TypeAlias = str | ScoreMultiModalParam


class _Scoring(_Basic):
    max_tokens_per_query: int = 0
    max_tokens_per_doc: int = 0
    instruction: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


ScoreSide: Any = ScoreInput | list[ScoreInput]
# vLLM's four forms of a score request, in the order its union tries them: each names its
# queries and its documents.
_SCORE_FORMS = (("ScoreQueriesDocumentsRequest", "queries", "documents"),
                ("ScoreQueriesItemsRequest", "queries", "items"),
                ("ScoreDataRequest", "data_1", "data_2"),
                ("ScoreTextRequest", "text_1", "text_2"))


def _score_form(name: str, first: str, second: str) -> type[_Scoring]:
    sides: dict[str, Any] = {first: (ScoreSide, ...), second: (ScoreSide, ...)}
    return create_model(name, __base__=_Scoring, **sides)


_SCORE_MODELS = tuple(_score_form(*form) for form in _SCORE_FORMS)


class RerankRequest(_Scoring):
    query: ScoreInput
    documents: ScoreSide
    top_n: int = Field(default=0, ge=0)


# Each kind's request models, the union's branches in vLLM's order.
_BRANCH_MODELS: dict[EndpointKind, tuple[type[BaseModel], ...]] = {
    EndpointKind.POOLING: (PoolingCompletionRequest, PoolingChatRequest, IOProcessorRequest),
    EndpointKind.CLASSIFY: (ClassificationCompletionRequest, ClassificationChatRequest),
    EndpointKind.SCORE: _SCORE_MODELS,
    EndpointKind.RERANK: (RerankRequest,),
}
_MODELS: dict[EndpointKind, TypeAdapter[Any]] = {
    kind: TypeAdapter(cast(Any, models[0] if len(models) == 1 else Union[models]))  # noqa: UP007
    for kind, models in _BRANCH_MODELS.items()}
# The union branches' names, which vLLM's messages leave out (api.validation_error).
_BRANCHES = frozenset(model.__name__ for models in _BRANCH_MODELS.values()
                      for model in models)


# -- parsed requests -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class EncodeRequest(PoolingRequest):
    """A ``/pooling`` or ``/classify`` request: one output per input."""

    kind: Literal[EndpointKind.POOLING, EndpointKind.CLASSIFY]
    use_activation: bool = True
    encoding_format: EncodingFormat = "float"
    embed_dtype: EmbedDType = "float32"
    endianness: Endianness = "native"


@dataclass(frozen=True, slots=True, kw_only=True)
class ScoringRequest(PoolingRequest):
    """A ``/score`` or ``/rerank`` request: its first ``queries`` inputs are the queries (one,
    or one per document), the rest the documents, in the body's order."""

    kind: Literal[EndpointKind.SCORE, EndpointKind.RERANK]
    queries: int
    documents: tuple[str, ...] = ()  # a rerank's documents, which its answer repeats
    top_n: int = 0  # a rerank's: the best n (0: all)


@dataclass(frozen=True, slots=True)
class BinaryAnswer:
    """``encoding_format`` ``bytes`` or ``bytes_only``: the outputs' raw values, one after
    another, and (``bytes``) their layout in the ``metadata`` header."""

    body: bytes
    metadata: str | None


# -- parsing -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Server:
    served_model: str
    max_model_len: int
    vocab_size: int
    adapters: Collection[str]
    tokenizer: Tokenizer


def parse_pooling_request(kind: EndpointKind, body: Any, *, served_model: str,
                          max_model_len: int, vocab_size: int,
                          adapters: Collection[str] = (),
                          tokenizer: Tokenizer = RULE) -> EncodeRequest | ScoringRequest:
    """A body of ``kind`` (``/pooling``, ``/classify``, ``/score`` or ``/rerank``) as vLLM
    reads it, or the ``ApiError`` vLLM answers it with."""
    server = _Server(served_model, max_model_len, vocab_size, adapters, tokenizer)
    _removed_fields(body)
    try:
        if not isinstance(body, dict):
            raise _not_an_object(kind, body)
        parsed = _MODELS[kind].validate_python(body)
    except ValidationError as e:
        raise validation_error(e, branches=_BRANCHES) from None
    if kind == EndpointKind.POOLING:
        _pooling_task(parsed)
    lora = pooling_model(parsed.model, served_model, adapters)
    truncate = parsed.truncate_prompt_tokens
    if truncate is not None and truncate > max_model_len:
        raise ApiError(400, "truncate_prompt_tokens value is greater than max_model_len. "
                       "Please request a smaller truncation size.")
    common: dict[str, Any] = {"model": lora or served_model, "priority": parsed.priority,
                              "user": parsed.user, "lora": lora}
    if isinstance(parsed, _Scoring):
        return _scoring(kind, parsed, server, common)
    activation = parsed.use_activation is not False
    ids = _encode_inputs(parsed, server)
    if isinstance(parsed, _Encoding):
        return EncodeRequest(kind=EndpointKind.POOLING, input_ids=ids,
                             use_activation=activation,
                             encoding_format=parsed.encoding_format,
                             embed_dtype=parsed.embed_dtype, endianness=parsed.endianness,
                             **common)
    return EncodeRequest(kind=EndpointKind.CLASSIFY, input_ids=ids, use_activation=activation,
                         **common)


def _not_an_object(kind: EndpointKind, body: Any) -> ValidationError:
    """vLLM's validation error for a body that is no JSON object: a missing body's, or one
    per branch of the kind's union (its models are wrapped, so pydantic reads attributes)."""
    if body is None:
        errors = [InitErrorDetails(type="missing", loc=(), input=None)]
    else:
        errors = [InitErrorDetails(type="model_attributes_type", loc=(), input=body)
                  ] * len(_BRANCH_MODELS[kind])
    return ValidationError.from_exception_data(kind.value, errors)


def _removed_fields(body: Any) -> None:
    """vLLM's refusal of the fields it removed, before the body is validated."""
    if isinstance(body, dict) and "normalize" in body:
        raise ApiError(400, "Parameter `normalize` was removed; use `use_activation` instead. "
                       "(parameter=normalize)", param="normalize")


def _pooling_task(parsed: Any) -> None:
    """``/pooling``'s task: the model's own (``embed``) or none; vLLM's refusals else."""
    if getattr(parsed, "dimensions", None) is not None:
        raise ApiError(400, "dimensions is currently not supported (parameter=dimensions)",
                       param="dimensions")
    if isinstance(parsed, IOProcessorRequest):
        raise ApiError(400, "No IOProcessor plugin installed. Please refer to the "
                       "documentation and to the 'prithvi_geospatial_mae_io_processor' "
                       "offline inference example for more details. (parameter=task)",
                       param="task")
    task = parsed.task
    if task is None or task == "embed":
        return
    if task not in _EMBED_MODEL_TASKS:
        raise ApiError(400, f"Unsupported task: {task!r} Supported tasks: "
                       f"{list(_EMBED_MODEL_TASKS)} (parameter=task)", param="task")
    raise ApiError(400, "Try switching the model's pooling_task via --pooler-config.task "
                   f"{task}. (parameter=task)", param="task")


def _encode_inputs(parsed: Any, server: _Server) -> tuple[tuple[int, ...], ...]:
    """Each prompt's token ids: ``input``'s forms, or a chat's ``messages``."""
    if isinstance(parsed, _Chat):
        if parsed.add_generation_prompt and parsed.continue_final_message:
            raise ApiError(400, "Cannot set both `continue_final_message` and "
                           "`add_generation_prompt` to True.")
        return (_render(_chat_ids(parsed, server), parsed, server, text=True),)
    raw = parsed.input
    prompts: list[str | list[int]]
    if isinstance(raw, str) or (raw and all(isinstance(x, int) for x in raw)):
        prompts = [raw]  # one prompt: text, or token ids
    else:
        prompts = list(raw)
    if not prompts:
        raise ApiError(400, "You must pass at least one prompt")
    special = parsed.add_special_tokens
    return tuple(
        _render(server.tokenizer.prompt_ids(p, special), parsed, server, text=True)
        if isinstance(p, str) else _render(_vocabulary(p, server), parsed, server, text=False)
        for p in prompts)


def _chat_ids(parsed: _Chat, server: _Server) -> tuple[int, ...]:
    if not parsed.messages:
        raise ApiError(400, "Cannot apply chat template to an empty conversation. Provide "
                       "at least one message.")
    turns = []
    for message in parsed.messages:
        content = message.get("content")
        if isinstance(content, list):  # the text of the text parts
            content = "".join(str(p.get("text", "")) for p in content
                              if p.get("type") == "text")
        turns.append((message["role"], content or ""))
    ids = server.tokenizer.chat_ids(turns, parsed.add_generation_prompt)
    if parsed.add_special_tokens:  # the tokenizer's own BOS, before the template's
        ids = server.tokenizer.prompt_ids("") + ids
    return ids


def _vocabulary(ids: list[int], server: _Server) -> tuple[int, ...]:
    bad = next((t for t in ids if t < 0 or t >= server.vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"Token id {bad} is out of vocabulary")
    return tuple(ids)


def _render(ids: tuple[int, ...], parsed: _Basic, server: _Server, *,
            text: bool) -> tuple[int, ...]:
    """A prompt's ids as the engine gets them: truncated (``truncate_prompt_tokens``, -1 the
    model's length), padded to the model's length (``padding: max_length``, text only, as
    the tokenizer pads), then checked as vLLM checks a pooling prompt."""
    keep = parsed.truncate_prompt_tokens
    if keep is not None:
        keep = server.max_model_len if keep < 0 else keep
        if len(ids) > keep:
            ids = ids[len(ids) - keep:] if parsed.truncation_side == "left" else ids[:keep]
    if text and parsed.padding == "max_length" and len(ids) < server.max_model_len:
        ids = ids + (PAD_ID,) * (server.max_model_len - len(ids))
    if not ids:
        raise ApiError(400, "The decoder prompt cannot be empty")
    limit = server.max_model_len
    if len(ids) > limit:
        # vLLM tokenizes text only one token past the limit, and says "at least" of a count
        # one past it (vllm/renderers/params.py).
        count = min(len(ids), limit + 1) if text else len(ids)
        qualifier = "at least " if count == limit + 1 else ""
        raise ApiError(
            400, f"This model's maximum context length is {limit} tokens. However, your "
            f"prompt contains {qualifier}{count} input tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt. "
            f"(parameter=input_tokens, value={count})", param="input_tokens")
    return ids


def _scoring(kind: EndpointKind, parsed: _Scoring, server: _Server,
             common: dict[str, Any]) -> ScoringRequest:
    """A bi-encoder's inputs (vllm/entrypoints/pooling/scoring/io_processor.py): the queries,
    then the documents, each text its own prompt."""
    if isinstance(parsed, RerankRequest):
        side_1: Any = parsed.query
        side_2: Any = parsed.documents
    else:
        side_1, side_2 = _score_sides(parsed)
    queries = _texts(side_1 if isinstance(side_1, list) else [side_1])
    documents = _texts(side_2 if isinstance(side_2, list) else [side_2])
    if len(queries) > 1 and len(queries) != len(documents):
        raise ApiError(400, "Input lengths must be either 1:1, 1:N or N:N")
    if not queries:
        raise ApiError(400, "At least one text element must be given")
    if not documents:
        raise ApiError(400, "At least one text_pair element must be given")
    for name in ("max_tokens_per_query", "max_tokens_per_doc"):
        limit = getattr(parsed, name)
        if limit < 0:
            raise ApiError(400, f"{name} must be a non-negative integer")
        if limit >= server.max_model_len:
            raise ApiError(400, f"{name} ({limit}) must be less than max_model_len "
                           f"({server.max_model_len}).")
    ids = tuple(_render(_text_ids(t, limit, server), parsed, server, text=True)
                for texts, limit in ((queries, parsed.max_tokens_per_query),
                                     (documents, parsed.max_tokens_per_doc))
                for t in texts)
    if isinstance(parsed, RerankRequest):
        return ScoringRequest(kind=EndpointKind.RERANK, input_ids=ids, queries=len(queries),
                              documents=tuple(documents), top_n=parsed.top_n, **common)
    return ScoringRequest(kind=EndpointKind.SCORE, input_ids=ids, queries=len(queries),
                          **common)


def _score_sides(parsed: _Scoring) -> tuple[Any, Any]:
    for name, first, second in _SCORE_FORMS:
        if type(parsed).__name__ == name:
            return getattr(parsed, first), getattr(parsed, second)
    raise AssertionError(f"{type(parsed).__name__} is no score request")


def _texts(items: list[Any]) -> list[str]:
    """The texts of one side; a multimodal one is refused, as the model is text-only."""
    if any(not isinstance(item, str) for item in items):
        raise ApiError(400, f"MultiModalParam is not supported for {ARCHITECTURE}")
    return items


def _text_ids(text: str, limit: int, server: _Server) -> tuple[int, ...]:
    """A query's or document's ids, its content cut to ``limit`` tokens (0: uncut) before
    the special tokens are added, as vLLM cuts the text first."""
    ids = server.tokenizer.prompt_ids(text)
    if limit:
        content = server.tokenizer.prompt_ids(text, add_special_tokens=False)
        if len(content) > limit:
            ids = ids[:len(ids) - len(content)] + content[:limit]
    return ids


# -- answers ------------------------------------------------------------------------------------


def pooling_response(request: EncodeRequest | ScoringRequest,
                     request_id: str) -> dict[str, Any] | BinaryAnswer:
    """The answer to ``request`` once every input has been through the engine."""
    if isinstance(request, ScoringRequest):
        return _scores(request, request_id)
    if request.kind == EndpointKind.CLASSIFY:
        return _classified(request, request_id)
    outputs = [embedding_vector(ids) if request.use_activation else pooled_state(ids)
               for ids in request.input_ids]
    created = int(time.time())
    if request.encoding_format in ("bytes", "bytes_only"):
        return _binary(request, request_id, created, outputs)
    data = [{"index": i, "object": "pooling",
             "data": (output if request.encoding_format == "float" else base64.b64encode(
                 _packed(output, request.embed_dtype, request.endianness)).decode())}
            for i, output in enumerate(outputs)]
    return {"id": request_id, "object": "list", "created": created, "model": request.model,
            "data": data, "usage": pooling_usage(request.usage_tokens)}


def new_pooling_id(kind: EndpointKind) -> str:
    """vLLM's request id of a pooling answer: its serving class's prefix."""
    prefix = {EndpointKind.POOLING: "pooling", EndpointKind.CLASSIFY: "classify"}.get(
        kind, "score")
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def _classified(request: EncodeRequest, request_id: str) -> dict[str, Any]:
    data = []
    for i, ids in enumerate(request.input_ids):
        logits = pooled_state(ids)[:len(CLASS_LABELS)]
        probs = _softmax(logits) if request.use_activation else logits
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": i, "label": CLASS_LABELS[best], "probs": probs,
                     "num_classes": len(probs)})
    return {"id": request_id, "object": "list", "created": int(time.time()),
            "model": request.model, "data": data,
            "usage": pooling_usage(request.usage_tokens)}


def _softmax(values: Sequence[float]) -> list[float]:
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    total = math.fsum(exps)
    return [e / total for e in exps]


def _scores(request: ScoringRequest, request_id: str) -> dict[str, Any]:
    """Each document's cosine similarity to its query (the one query, or its own)."""
    vectors = [embedding_vector(ids) for ids in request.input_ids]
    queries, documents = vectors[:request.queries], vectors[request.queries:]
    scores = [math.fsum(a * b for a, b in zip(queries[0 if len(queries) == 1 else i], doc,
                                               strict=True))
              for i, doc in enumerate(documents)]
    usage = request.usage_tokens
    if request.kind == EndpointKind.SCORE:
        return {"id": request_id, "object": "list", "created": int(time.time()),
                "model": request.model,
                "data": [{"index": i, "object": "score", "score": s}
                         for i, s in enumerate(scores)],
                "usage": pooling_usage(usage)}
    # By relevance, best first (a stable sort: ties keep the documents' order), then the top n.
    ranked = sorted(enumerate(scores), key=lambda pair: -pair[1])
    if 0 < request.top_n < len(ranked):
        ranked = ranked[:request.top_n]
    results = [{"index": i, "document": {"text": request.documents[i], "multi_modal": None},
                "relevance_score": score} for i, score in ranked]
    return {"id": request_id, "model": request.model,
            "usage": {"prompt_tokens": usage, "total_tokens": usage}, "results": results}


def _binary(request: EncodeRequest, request_id: str, created: int,
            outputs: list[list[float]]) -> BinaryAnswer:
    chunks = [_packed(output, request.embed_dtype, request.endianness) for output in outputs]
    metadata = None
    if request.encoding_format == "bytes":
        items, offset = [], 0
        for i, (chunk, output) in enumerate(zip(chunks, outputs, strict=True)):
            items.append({"index": i, "embed_dtype": request.embed_dtype,
                          "endianness": request.endianness, "start": offset,
                          "end": offset + len(chunk), "shape": [len(output)]})
            offset += len(chunk)
        usage = request.usage_tokens
        metadata = json.dumps({"id": request_id, "created": created, "model": request.model,
                          "data": items, "usage": {"prompt_tokens": usage,
                                                   "total_tokens": usage}})
    return BinaryAnswer(b"".join(chunks), metadata)


# A small float format: exponent bits, mantissa bits, and whether the all-ones exponent is
# infinity/NaN (IEEE) or an ordinary exponent (fp8 e4m3fn, whose only NaN is all ones).
_FORMATS: dict[str, tuple[int, int, bool]] = {
    "bfloat16": (8, 7, True), "fp8_e4m3": (4, 3, False), "fp8_e5m2": (5, 2, True)}


def _packed(values: Sequence[float], dtype: EmbedDType, endianness: Endianness) -> bytes:
    """``values`` as raw ``dtype`` numbers in ``endianness`` byte order (native: this
    machine's), rounded to nearest even as torch converts them."""
    order = {"little": "<", "big": ">"}.get(endianness, "<" if sys.byteorder == "little"
                                                      else ">")
    if dtype == "float32":
        return struct.pack(f"{order}{len(values)}f", *values)
    if dtype == "float16":
        return struct.pack(f"{order}{len(values)}e", *values)
    exponent, mantissa, ieee = _FORMATS[dtype]
    bits = [_small_float(v, exponent, mantissa, ieee) for v in values]
    if exponent + mantissa + 1 == 8:
        return bytes(bits)
    return struct.pack(f"{order}{len(bits)}H", *bits)


def _small_float(value: float, exponent_bits: int, mantissa_bits: int, ieee: bool) -> int:
    """The bits of ``value`` in a float format of 1 sign bit, ``exponent_bits`` and
    ``mantissa_bits``, rounded to nearest even; too large, infinity (IEEE) or NaN (e4m3fn,
    which has no infinity), as torch converts."""
    sign = 1 << (exponent_bits + mantissa_bits) if math.copysign(1.0, value) < 0 else 0
    nan = sign | ((1 << (exponent_bits + mantissa_bits)) - 1)
    if math.isnan(value):
        return nan
    bias = (1 << (exponent_bits - 1)) - 1
    top = (1 << exponent_bits) - (2 if ieee else 1)  # the largest finite exponent field
    largest = (1 << mantissa_bits) - (1 if ieee else 2)  # its largest finite mantissa
    magnitude = abs(value)
    # The exponent field of the value's binade; below the normal range, field 1's step,
    # which is the subnormals' too.
    field = max(math.frexp(magnitude)[1] - 1 + bias, 1) if magnitude else 1
    units = round(magnitude / math.ldexp(1.0, field - bias - mantissa_bits))  # to even
    if units >= 2 << mantissa_bits:  # rounding carried into the next binade
        field, units = field + 1, units >> 1
    if field > top or (field == top and units - (1 << mantissa_bits) > largest):
        return sign | (((1 << exponent_bits) - 1) << mantissa_bits) if ieee else nan
    if units < 1 << mantissa_bits:  # a subnormal, or zero: exponent field 0
        return sign | units
    return sign | (field << mantissa_bits) | (units - (1 << mantissa_bits))
