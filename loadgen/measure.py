"""The measurement of one request: a state machine fed with timestamped bytes.

The shell (the HTTP client) calls :meth:`StreamMeter.sent`, :meth:`~StreamMeter.response`,
then :meth:`~StreamMeter.feed` with each piece of the body as it arrives and the time it
arrived, and finally one of :meth:`~StreamMeter.finish`, :meth:`~StreamMeter.timed_out`,
:meth:`~StreamMeter.cancelled` or :meth:`~StreamMeter.failed`; :meth:`~StreamMeter.record`
then gives the :class:`~weighbridge.records.RequestRecord`. No clock is read here, so the
rules are tested exactly:

* **first token**: the first chunk that carries generated content — completion ``text``, chat
  ``content``, reasoning or a tool-call delta. A role-only or empty chunk is not a token.
* **inter-token gaps**: between consecutive content chunks (what a reader of the stream sees;
  a server that sends several tokens per chunk has fewer, longer gaps, and
  ``decode_tps`` from the token counts gives the per-token speed).
* **token counts**: the server's ``usage`` (the final usage chunk, or the latest continuous
  one), never a count of chunks; ``cached_tokens`` from its
  ``prompt_tokens_details.cached_tokens`` (vLLM with ``--enable-prompt-tokens-details``),
  None when the server does not report it.
* **the answer** of a conversation's turn (:meth:`StreamMeter.answer`: a session's, an agent
  program's call): the content it streamed,
  and the token ids of its choices when the server returned them (vLLM's ``token_ids``).
* **status**: ``ok`` when the stream ended with ``[DONE]`` (or a whole non-streamed body
  arrived) without an error event; ``rejected`` for 429 and 503 and any answer carrying
  ``x-weighbridge-reject-reason``; ``error`` otherwise; ``timeout`` and ``cancelled`` when
  the client gave up or the run ended first.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, Protocol

import orjson

from weighbridge import headers as headers_
from weighbridge.loadgen.plan import Answer, ProgramRef, RequestPlan
from weighbridge.records import RequestRecord, Status
from weighbridge.statistics import percentile

__all__ = ["StreamMeter"]

_REJECT_STATUSES = frozenset({429, 503})


class HeaderLookup(Protocol):
    """What the meter reads of response headers: a case-insensitive ``get`` (a Mapping or
    the HTTP client's own header view)."""

    def get(self, key: str, /) -> str | None: ...


def _has_content(choice: dict[str, Any]) -> bool:
    if choice.get("text"):
        return True
    delta = choice.get("delta")
    if not delta:
        return False
    return bool(delta.get("content") or delta.get("reasoning_content")
                or delta.get("reasoning") or delta.get("tool_calls"))


def _error_reason(error: Any) -> str:
    if isinstance(error, dict):
        for key in ("code", "type", "message"):
            if error.get(key):
                return str(error[key])
    return str(error)[:200]


class StreamMeter:
    """Measures one request; times are seconds on the caller's (one, monotonic) clock."""

    def __init__(self, plan: RequestPlan, run_id: str, scenario: str) -> None:
        self.plan = plan
        self.run_id = run_id
        self.scenario = scenario
        self.sent_s: float | None = None
        self.http_status: int | None = None
        self.reason: str | None = None
        self.backend: str | None = None
        self.queue_s: float | None = None
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.end_s: float | None = None
        self.prompt_tokens: int | None = None
        self.output_tokens: int | None = None
        self.cached_tokens: int | None = None
        # A conversation's turn (a session's, a program's call: session_id set) keeps its
        # answer for the next turn; other requests keep nothing.
        self._answer: list[str] | None = [] if plan.session_id is not None else None
        self._answer_ids: list[int] | None = None
        self.chunks = 0
        self.gaps: list[float] = []
        self.done = False  # saw [DONE] or a complete body
        self.status: Status | None = None
        self._buffer = b""

    # -- events from the shell ---------------------------------------------------------------

    def sent(self, t: float) -> None:
        self.sent_s = t

    def response(self, t: float, status: int, headers: HeaderLookup) -> None:
        self.http_status = status
        self.backend = headers.get(headers_.BACKEND)
        if (queue_ms := headers.get(headers_.QUEUE_MS)) is not None:
            try:
                self.queue_s = float(queue_ms) / 1000
            except ValueError:
                self.queue_s = None
        if reason := headers.get(headers_.REJECT_REASON):
            self.reason = reason
            self.status = "rejected"
        elif status in _REJECT_STATUSES:
            self.status = "rejected"
        elif status != 200:
            self.status = "error"

    def feed(self, data: bytes, t: float) -> None:
        """A piece of a streamed (SSE) body that arrived at ``t``."""
        buffer = self._buffer + data if self._buffer else data
        if b"\r" in buffer:  # SSE allows CRLF line ends; normalise once here
            buffer = buffer.replace(b"\r\n", b"\n")
        start = 0
        while (end := buffer.find(b"\n\n", start)) >= 0:
            self._event(buffer[start:end], t)
            start = end + 2
        self._buffer = buffer[start:]

    def body(self, data: bytes, t: float) -> None:
        """The whole body of a non-streamed answer (or of an error), arrived at ``t``."""
        try:
            obj = orjson.loads(data) if data else None
        except orjson.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict):
            if self.http_status == 200:
                self.status, self.reason = "error", "invalid_json"
            return
        if "error" in obj:
            self.reason = self.reason or _error_reason(obj["error"])
            if self.status is None:
                self.status = "error"
            return
        if self.http_status == 200:
            choices = obj.get("choices") or []
            # An embeddings list is the whole answer at once, as a non-streamed completion.
            if obj.get("data") or any(
                    _has_content(c) or (c.get("message") or {}).get("content") for c in choices):
                self.first_token_s = self.last_token_s = t
                self.chunks = 1
            if self._answer is not None:
                for choice in choices:
                    self._keep(choice, (choice.get("message") or {}).get("content")
                               or choice.get("text"))
            self._usage(obj.get("usage"))
            self.done = True

    def finish(self, t: float) -> None:
        """The response ended (the connection delivered all of it) at ``t``."""
        self.end_s = t
        if self.status is None:
            if self.done:
                self.status = "ok"
            else:
                self.status, self.reason = "error", "stream_ended_early"

    def timed_out(self, t: float) -> None:
        self.end_s, self.status, self.reason = t, "timeout", "client_timeout"

    def cancelled(self, t: float, reason: str = "run_ended") -> None:
        self.end_s, self.status, self.reason = t, "cancelled", reason

    def failed(self, t: float, reason: str) -> None:
        self.end_s, self.status, self.reason = t, "error", reason

    def content(self, t: float) -> None:
        """A chunk carrying generated content arrived at ``t`` (the SSE parser calls this;
        so does the simulator, whose chunks are never bytes)."""
        if self.first_token_s is None:
            self.first_token_s = t
        else:
            # Why the ignore below: last_token_s is set together with first_token_s, so it is not
            # None here.
            self.gaps.append(t - self.last_token_s)  # type: ignore[operator]
        self.last_token_s = t
        self.chunks += 1

    def contents(self, times: Sequence[float]) -> None:
        """Content chunks that arrived at ``times`` (in order): the same as ``content(t)``
        for each, in bulk (the simulator records a request's chunk times as it streams)."""
        if not times:
            return
        if self.first_token_s is None:
            self.first_token_s = times[0]
            previous = times[:-1]
            later = times[1:]
        else:
            # Why the ignore below: last_token_s is set together with first_token_s, so it is not
            # None here.
            previous = [self.last_token_s, *times[:-1]]  # type: ignore[list-item]
            later = times
        self.gaps.extend(map(operator.sub, later, previous))
        self.last_token_s = times[-1]
        self.chunks += len(times)

    # -- SSE -------------------------------------------------------------------------------

    def _event(self, event: bytes, t: float) -> None:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue  # comments, event names, ids: nothing to measure
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                continue
            try:
                chunk = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue
            if isinstance(chunk, dict):
                self._chunk(chunk, t)

    def _chunk(self, chunk: dict[str, Any], t: float) -> None:
        if "error" in chunk:
            self.status = "error"
            self.reason = _error_reason(chunk["error"])
            return
        choices = chunk.get("choices")
        if choices and any(_has_content(c) for c in choices):
            self.content(t)
        if choices and self._answer is not None:
            for choice in choices:
                self._keep(choice, (choice.get("delta") or {}).get("content")
                           or choice.get("text"))
        if usage := chunk.get("usage"):
            self._usage(usage)

    def _usage(self, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        prompt, output = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int) and prompt >= 0:
            self.prompt_tokens = prompt
        if isinstance(output, int) and output >= 0:
            self.output_tokens = output
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            cached = details.get("cached_tokens")
            if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0:
                self.cached_tokens = cached

    def _keep(self, choice: dict[str, Any], text: Any) -> None:
        """A piece of a session turn's answer: its text and, when sent, its token ids."""
        assert self._answer is not None
        if isinstance(text, str) and text:
            self._answer.append(text)
        ids = choice.get("token_ids")
        if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
            self._answer_ids = (self._answer_ids or []) + ids

    def answer(self) -> Answer | None:
        """A session turn's answer when it ended ok (the next turn sends it back); None for
        any other request or ending."""
        if self._answer is None or self.status != "ok" or self.output_tokens is None:
            return None
        ids = self._answer_ids
        # Ids that do not add up to the usage's count are not the answer (a server that sent
        # some chunks' ids only): the answer then goes back without them.
        if ids is not None and len(ids) != self.output_tokens:
            ids = None
        return Answer(self.output_tokens, "".join(self._answer),
                      tuple(ids) if ids is not None else None)

    # -- result ----------------------------------------------------------------------------

    def record(self) -> RequestRecord:
        if self.end_s is None or self.status is None:
            raise RuntimeError(f"{self.plan.request_id}: record() before the request ended")
        gaps = sorted(self.gaps)
        plan = self.plan
        return RequestRecord(
            run_id=self.run_id, scenario=self.scenario, phase=plan.phase,
            request_id=plan.request_id, tenant=plan.tenant, tier=plan.tier, user=plan.user,
            endpoint=plan.endpoint, stream=plan.stream, max_tokens=plan.max_tokens,
            scheduled_s=plan.scheduled_s, sent_s=self.sent_s,
            first_token_s=self.first_token_s, last_token_s=self.last_token_s,
            end_s=self.end_s, prompt_tokens=self.prompt_tokens,
            output_tokens=self.output_tokens, chunks=self.chunks,
            itl_p50_s=percentile(gaps, 0.5) if gaps else None,
            itl_p99_s=percentile(gaps, 0.99) if gaps else None,
            itl_max_s=gaps[-1] if gaps else None,
            status=self.status, http_status=self.http_status, reason=self.reason,
            backend=self.backend, queue_s=self.queue_s, model=plan.model,
            session_id=plan.session_id, turn=plan.turn, cached_tokens=self.cached_tokens,
            **_program_fields(plan.program),
        )


def _program_fields(program: ProgramRef | None) -> dict[str, Any]:
    if program is None:
        return {}
    return {"program_id": program.program_id, "parent_program_id": program.parent_id,
            "program_calls": program.calls}
