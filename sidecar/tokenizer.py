"""Text prompts counted in the served model's own tokens, where a model names its tokenizer
(``models.<name>.tokenizer``, a Hugging Face model directory: weighbridge.hf_tokenizer).

A prompt the tokenizer counts is exact, as a token-id prompt is: its count is the engine's
(rate limits, DRR and the backlog see what the engine computes), and the prefix index cuts
it in the engine's own blocks (sidecar.prefix). Only what the tokenizer counts as the engine
does is tokenized (``text_prompt``): a completion's string prompt, and a chat whose messages
are role and string content, without tools or a template of the request's own. The rest is
estimated, as without a tokenizer.

Tokenizing costs CPU: about 120-390 µs per KB of prompt on the tiny model's byte-level BPE.
It runs on one thread beside the event loop (the batch call releases the GIL, so the loop
keeps serving), and the thread takes the tenants' prompts in fair turns by bytes, each
tenant's in arrival order (``TokenizeQueue``): a tenant's backlog of long prompts delays
another's prompt by at most the one on the thread. A prompt over
``tokenization.max_prompt_bytes``, or past its tenant's ``max_tenant_pending_bytes``, is
estimated at once, never delayed.

The order (``TokenizeQueue``) and the choice of what to tokenize (``text_prompt``) are pure;
``PromptTokenizers`` is the shell that owns the thread and the loaded tokenizers.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from prometheus_client.core import CounterMetricFamily, Metric

from weighbridge.endpoints import EndpointKind
from weighbridge.hf_tokenizer import HfTokenizer
from weighbridge.sidecar.config import Config

__all__ = ["PromptTokenizers", "TextPrompt", "TokenizeQueue", "TokenizerCollector",
           "text_prompt"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# Body fields with which vLLM renders or cuts a prompt otherwise than the plain tokenizer
# and template do: such a prompt is estimated.
_CHAT_OWN_RENDERING = ("tools", "chat_template", "chat_template_kwargs",
                       "continue_final_message", "truncate_prompt_tokens", "documents")
_COMPLETION_OWN_RENDERING = ("truncate_prompt_tokens",)
# What a chat message's template framing counts toward the bounds, beyond its role and
# content: rendering and tokenizing an empty message costs about 2.6 µs, 16 bytes of text's.
CHAT_MESSAGE_BYTES = 16


@dataclass(slots=True)
class TextPrompt:
    """A prompt the served model's tokenizer counts as the engine does: a completion's text,
    or a chat's (role, content) messages, and its size in UTF-8 bytes (a chat's: its roles
    and contents, and ``CHAT_MESSAGE_BYTES`` a message)."""

    size: int
    text: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


def text_prompt(endpoint: str, body: dict[str, Any]) -> TextPrompt | None:
    """What of a validated body (sidecar.session) the tokenizer counts, or None: token ids,
    a batch of prompts, the pooling kinds, content parts, a message with fields beyond role
    and content, and the fields that make vLLM render or cut it otherwise."""
    kind = EndpointKind.of_path(endpoint)
    if kind is EndpointKind.CHAT:
        return _chat(body)
    if kind is not EndpointKind.COMPLETIONS:
        return None
    prompt = body.get("prompt")
    special = body.get("add_special_tokens", True)
    if not isinstance(prompt, str) or not isinstance(special, bool) \
            or any(body.get(name) is not None for name in _COMPLETION_OWN_RENDERING):
        return None
    return TextPrompt(len(prompt.encode()), text=prompt, add_special_tokens=special)


def _chat(body: dict[str, Any]) -> TextPrompt | None:
    generation = body.get("add_generation_prompt", True)
    if not isinstance(generation, bool) \
            or any(body.get(name) is not None for name in _CHAT_OWN_RENDERING):
        return None
    messages: list[tuple[str, str]] = []
    size = 0
    for message in body["messages"]:
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not isinstance(content, str) \
                or message.keys() - {"role", "content"}:
            return None
        messages.append((role, content))
        size += CHAT_MESSAGE_BYTES + len(role.encode()) + len(content.encode())
    return TextPrompt(size, messages=tuple(messages), add_generation_prompt=generation)


class TokenizeQueue(Generic[T]):
    """The prompts waiting for the tokenizer thread, in start-time fair queueing by bytes: a
    prompt's start tag is the later of the tag of the prompt last taken and its tenant's
    previous prompt's finish (start + bytes), and the thread takes the least start first
    (ties in arrival order). So each tenant's prompts go in arrival order, and a tenant with
    none waiting is next but for one prompt per other tenant at most: a backlog delays only
    its own tenant. ``offer`` refuses a prompt over ``max_prompt_bytes``, or one that would
    take its tenant's prompts waiting or on the thread past ``max_tenant_bytes``. Pure."""

    def __init__(self, max_prompt_bytes: int, max_tenant_bytes: int) -> None:
        if max_prompt_bytes < 1 or max_tenant_bytes < 1:
            raise ValueError("the bounds must be at least 1 byte")
        self.max_prompt_bytes = max_prompt_bytes
        self.max_tenant_bytes = max_tenant_bytes
        self._heap: list[tuple[int, int, str, int, T]] = []  # (start, arrival, tenant, size, job)
        self._arrivals = itertools.count()
        self._virtual = 0  # the start tag of the prompt last taken
        self._finish: dict[str, int] = {}  # each tenant's last prompt's finish tag
        self._pending: Counter[str] = Counter()  # bytes waiting or on the thread

    def __len__(self) -> int:
        return len(self._heap)

    def pending(self, tenant: str) -> int:
        return self._pending[tenant]

    def offer(self, tenant: str, size: int, job: T) -> bool:
        """Queue ``job`` of ``size`` bytes for ``tenant``; False: over a bound, not queued."""
        if size > self.max_prompt_bytes or self._pending[tenant] + size > self.max_tenant_bytes:
            return False
        self._pending[tenant] += size
        start = max(self._virtual, self._finish.get(tenant, 0))
        self._finish[tenant] = start + size
        heapq.heappush(self._heap, (start, next(self._arrivals), tenant, size, job))
        return True

    def next(self) -> tuple[str, int, T] | None:
        """The job the thread takes next (the least start tag); None when nothing waits."""
        if not self._heap:
            return None
        start, _, tenant, size, job = heapq.heappop(self._heap)
        self._virtual = start
        return tenant, size, job

    def done(self, tenant: str, size: int) -> None:
        """A job ``next`` gave is finished: its bytes no longer count as pending."""
        left = self._pending[tenant] - size
        if left > 0:
            self._pending[tenant] = left
        else:
            del self._pending[tenant]
            if self._finish.get(tenant, 0) <= self._virtual:
                del self._finish[tenant]  # idle: its next prompt starts at the present


@dataclass(slots=True)
class _Job:
    tokenizer: HfTokenizer
    prompt: TextPrompt
    answer: asyncio.Future[list[int] | None]


def _tokenize(tokenizer: HfTokenizer, prompt: TextPrompt) -> tuple[list[int] | None, float]:
    """On the thread: the prompt's ids (None: the template refused it) and the CPU seconds."""
    started = time.thread_time()
    try:
        if prompt.messages is not None:
            ids = tokenizer.chat_ids(prompt.messages, prompt.add_generation_prompt)
        else:
            assert prompt.text is not None
            ids = tokenizer.encode(prompt.text, prompt.add_special_tokens)
    except Exception:  # a template's raise_exception, or a render error: the engine's to say
        ids = None
    return ids, time.thread_time() - started


def _load(directory: str) -> HfTokenizer:
    return HfTokenizer(directory, what="models.*.tokenizer", extra="tokenizer")


class PromptTokenizers:
    """The loaded tokenizers of the configuration in force (``config()``, read at each use:
    a reload may change them) and the one thread that runs them. ``counts``: prompts by
    how they were counted (``tokenized``, or estimated: ``form``, ``over_bounds``,
    ``loading``, ``unavailable``, ``refused``); ``bytes`` and ``cpu_s``: the tokenized
    prompts' UTF-8 and the thread's CPU seconds on them."""

    def __init__(self, config: Callable[[], Config]) -> None:
        self._config = config
        settings = config().tokenization
        self._queue: TokenizeQueue[_Job] = TokenizeQueue(settings.max_prompt_bytes,
                                                         settings.max_tenant_pending_bytes)
        self._executor: ThreadPoolExecutor | None = None
        self._busy = False
        # Directory -> its tokenizer; None while it loads; the error when it failed.
        self._loaded: dict[str, HfTokenizer | Exception | None] = {}
        self.counts: Counter[str] = Counter()
        self.bytes = 0
        self.cpu_s = 0.0

    def start(self) -> None:
        """Load every configured tokenizer on the thread (requests meanwhile are estimated)."""
        for model in self._config().models.values():
            if model.tokenizer:
                self._tokenizer(model.tokenizer)

    def stop(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def _thread(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        return self._executor

    def _tokenizer(self, directory: str) -> HfTokenizer | None:
        """The directory's tokenizer once loaded; None while it loads or when it failed
        (logged once). The first ask starts the load, on the thread."""
        if directory not in self._loaded:
            self._loaded[directory] = None
            loop = asyncio.get_running_loop()
            loading = loop.run_in_executor(self._thread(), _load, directory)
            loading.add_done_callback(lambda done: self._loaded_one(directory, done))
        found = self._loaded[directory]
        return found if isinstance(found, HfTokenizer) else None

    def _loaded_one(self, directory: str, done: asyncio.Future[HfTokenizer]) -> None:
        if done.cancelled():
            del self._loaded[directory]
            return
        error = done.exception()
        if error is not None:
            log.error("tokenizer %s: %s; its models' prompts are estimated", directory, error)
        self._loaded[directory] = error if isinstance(error, Exception) else done.result()

    def _count(self, reason: str) -> None:
        self.counts[reason] += 1

    async def tokenize(self, model: str | None, tenant: str, endpoint: str,
                       body: dict[str, Any]) -> list[int] | None:
        """The prompt's ids by ``model``'s tokenizer, or None: the model names none, or the
        prompt is estimated (``counts`` says why)."""
        config = self._config()
        spec = config.models.get(model) if model else None
        if spec is None or not spec.tokenizer:
            return None
        prompt = text_prompt(endpoint, body)
        if prompt is None:
            self._count("form")
            return None
        tokenizer = self._tokenizer(spec.tokenizer)
        if tokenizer is None:
            self._count("loading" if self._loaded.get(spec.tokenizer) is None
                        else "unavailable")
            return None
        if prompt.messages is not None and not tokenizer.has_chat_template:
            self._count("form")
            return None
        self._queue.max_prompt_bytes = config.tokenization.max_prompt_bytes
        self._queue.max_tenant_bytes = config.tokenization.max_tenant_pending_bytes
        answer: asyncio.Future[list[int] | None] = asyncio.get_running_loop().create_future()
        if not self._queue.offer(tenant, prompt.size, _Job(tokenizer, prompt, answer)):
            self._count("over_bounds")
            return None
        self._pump()
        return await answer

    def _pump(self) -> None:
        if self._busy:
            return
        taken = self._queue.next()
        if taken is None:
            return
        tenant, size, job = taken
        if job.answer.done():  # its client left while it waited
            self._queue.done(tenant, size)
            self._pump()
            return
        self._busy = True
        running = asyncio.get_running_loop().run_in_executor(
            self._thread(), _tokenize, job.tokenizer, job.prompt)
        running.add_done_callback(lambda done: self._finished(tenant, size, job, done))

    def _finished(self, tenant: str, size: int, job: _Job,
                  done: asyncio.Future[tuple[list[int] | None, float]]) -> None:
        self._busy = False
        self._queue.done(tenant, size)
        ids: list[int] | None = None
        if not done.cancelled() and done.exception() is None:
            ids, cpu_s = done.result()
            self.cpu_s += cpu_s
            if ids is None:
                self._count("refused")
            else:
                self._count("tokenized")
                self.bytes += size
        if not job.answer.done():
            job.answer.set_result(ids)
        self._pump()


class TokenizerCollector:
    """How the prompts of models with a tokenizer were counted, on /metrics (every reason
    from 0, with or without a tokenizer configured)."""

    REASONS = ("tokenized", "form", "over_bounds", "loading", "unavailable", "refused")

    def __init__(self, tokenizers: PromptTokenizers) -> None:
        self.tokenizers = tokenizers

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        tokenizers = self.tokenizers
        prompts = CounterMetricFamily(
            "weighbridge_prompt_tokenization",
            "Prompts of models with a tokenizer, by how they were counted: tokenized, or "
            "estimated (form, over_bounds, loading, unavailable, refused).",
            labels=["result"])
        for reason in self.REASONS:
            prompts.add_metric([reason], tokenizers.counts.get(reason, 0))
        yield prompts
        size = CounterMetricFamily("weighbridge_prompt_tokenization_bytes",
                                   "UTF-8 bytes of the prompts tokenized.")
        size.add_metric([], tokenizers.bytes)
        yield size
        cpu = CounterMetricFamily("weighbridge_prompt_tokenization_cpu_seconds",
                                  "CPU seconds the tokenizer thread spent on prompts.")
        cpu.add_metric([], tokenizers.cpu_s)
        yield cpu
