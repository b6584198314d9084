"""Trace replay: recorded traffic made into request plans, for the load generator
(``locust -f scenarios/ --trace FILE``) and for ``weighbridge simulate --trace FILE``.

Formats, told apart by their content:

* **Mooncake JSONL**: one object a line with ``timestamp`` (ms from the trace's start),
  ``input_length``, ``output_length`` and ``hash_ids``. Each hash id names one block of
  ``TRACE_BLOCK`` (512) tokens: the same id is the same tokens in every request, so requests
  whose ids start alike share a prefix. The last id holds the rest of the prompt (a partial
  block is the first tokens of that id's block). AIPerf's multi-turn form adds
  ``session_id`` and ``delay``: the rows of one session (in file order) are the turns of one
  conversation, replayed as AIPerf replays them (:class:`TraceSession`): each row's
  ``input_length`` (and ``hash_ids``) is the turn's new message, sent after the history so
  far with the answers as the server returned them, ``delay`` ms after the previous answer
  ended (a later row with a ``timestamp`` instead is due then, not before that answer); a
  session's first row is due at its ``timestamp``, or at 0 without one. A turn that does not
  end ok ends its session. Each session is a program (weighbridge.loadgen.programs): its
  requests name it as their tenant's harnesses do, and its records carry it.
* **our records** (a run's ``requests.parquet`` or ``records-*.jsonl``) and CSV or Parquet
  tables with one row per request: ``scheduled_s`` [``arrival_s``, ``t``], ``tenant``,
  ``prompt_tokens``, ``output_tokens`` [``max_tokens``; a run's records: ``max_tokens``,
  what each request asked for], and optionally ``endpoint``, ``priority``, ``deadline_ms``,
  ``stream``, ``request_id``, ``phase``, ``user``, ``model``. The records hold no prompt
  content, so their prompts are prefix-free. A request the run turned away has no
  ``prompt_tokens``: it gets its tenant's median prompt (counted as ``filled``).

Traces carry no tenant of the tenants file, so a rule assigns one (:class:`TenantRule`; a
session takes its first row's):
``hash`` (a hash of the first block's id, so requests that share a first block share a
tenant; a row without blocks by its request id), ``round_robin`` (row ``i`` to tenant
``i mod n``), ``column:NAME`` (the row's ``NAME`` value, which must name a tenant), or
``auto`` (the default: ``column:tenant`` when every row names a tenant, as our records do,
else ``hash``).
A speed factor divides the trace's times (2: twice as fast).

Everything but reading the file is a pure function of the rows, the tenants and the seed:
the load generator and the simulator send the same plans.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from weighbridge.loadgen.plan import Answer, Message, ProgramRef, RequestPlan
from weighbridge.loadgen.tenants import ENDPOINT_PATHS, TenantSpec
from weighbridge.records import ADDED_FIELDS, FIELD_NAMES, read_jsonl, records_to_table

__all__ = ["TenantRule", "TraceError", "TraceReplay", "TraceRow", "TraceRows", "TraceSession",
           "read_trace_rows", "trace_plans", "trace_replay", "trace_sessions"]

_TIME = ("scheduled_s", "arrival_s", "t")
_OUTPUT = ("output_tokens", "max_tokens")
_MOONCAKE = ("input_length", "output_length")
_MOONCAKE_KEYS = (*_MOONCAKE, "timestamp", "hash_ids", "session_id", "delay")
# A session id goes into request ids and identity headers: printable, no spaces.
_SESSION_ID = re.compile(r"[\x21-\x7e]{1,256}")


class TraceError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One recorded request."""

    t_s: float | None  # when it was sent, seconds from the trace's start; None: see session
    prompt_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] | None = None  # Mooncake's blocks; None: prefix-free
    tenant: str | None = None
    request_id: str | None = None
    endpoint: str | None = None  # an API path
    priority: int | None = None
    deadline_ms: float | None = None
    stream: bool | None = None
    phase: str | None = None
    user: str | None = None
    model: str | None = None
    columns: tuple[tuple[str, str], ...] = ()  # every other value, for column:NAME
    session_id: str | None = None  # the AIPerf session it is a turn of
    delay_s: float | None = None  # a turn: due this long after the previous answer ended


@dataclass(frozen=True)
class TraceRows:
    rows: list[TraceRow]
    format: str  # "mooncake" | "records" | "table"
    filled: int = 0  # rows whose prompt length was filled in (see the module doc)

    @property
    def end_s(self) -> float:
        """The last send were every answer instant: a session's turns add their delays."""
        ends = [r.t_s for r in self.rows if r.session_id is None and r.t_s is not None]
        for rows in self.sessions().values():
            t = rows[0].t_s or 0.0
            for row in rows[1:]:
                t = t + row.delay_s if row.delay_s is not None else max(t, row.t_s or 0.0)
            ends.append(t)
        return max(ends, default=0.0)

    @property
    def longest_session(self) -> int:
        """Turns of the longest session (1: none has more, or there are none)."""
        return max((len(rows) for rows in self.sessions().values()), default=1)

    def sessions(self) -> dict[str, list[TraceRow]]:
        """Each session's rows, in file order; sessions in the order they first appear."""
        out: dict[str, list[TraceRow]] = {}
        for row in self.rows:
            if row.session_id is not None:
                out.setdefault(row.session_id, []).append(row)
        return out


def _is_mooncake(path: Path) -> bool:
    if path.suffix.lower() != ".jsonl":
        return False
    with path.open("rb") as file:
        for line in file:
            if line.strip():
                first = orjson.loads(line)
                return isinstance(first, dict) and all(k in first for k in _MOONCAKE)
    return False


def _ms(obj: dict[str, Any], key: str) -> float | None:
    """``obj[key]``, milliseconds, as seconds: finite and >= 0, or absent."""
    if obj.get(key) is None:
        return None
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or value < 0:
        raise ValueError(f"{key} must be a number of ms >= 0, got {value!r}")
    return float(value) / 1000


def _mooncake_row(obj: Any) -> TraceRow:
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    prompt, output = obj["input_length"], obj["output_length"]
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in (prompt, output)):
        raise ValueError("input_length and output_length must be integers >= 1")
    ids = obj.get("hash_ids")
    hash_ids = tuple(int(h) for h in ids) if ids else None
    t, delay = _ms(obj, "timestamp"), _ms(obj, "delay")
    session = obj.get("session_id")
    if session is not None:
        session = str(session)
        if isinstance(obj["session_id"], bool) or _SESSION_ID.fullmatch(session) is None:
            raise ValueError("session_id must be 1-256 printable characters without spaces")
    elif t is None:
        raise ValueError("a row outside a session needs a timestamp")
    elif delay is not None:
        raise ValueError("delay is a turn's, and the row names no session_id")
    extra = tuple((str(k), str(v)) for k, v in obj.items() if k not in _MOONCAKE_KEYS)
    return TraceRow(t, prompt, output, hash_ids, columns=extra, session_id=session,
                    delay_s=delay)


def _mooncake(path: Path) -> TraceRows:
    rows = []
    with path.open("rb") as file:
        for lineno, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                rows.append(_mooncake_row(orjson.loads(line)))
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise TraceError(f"{path}:{lineno}: not a Mooncake row: {exc}") from None
    return TraceRows(rows, "mooncake")


def _column(table: pa.Table, names: tuple[str, ...], path: Path) -> list[Any]:
    for name in names:
        if name in table.column_names:
            return table.column(name).to_pylist()
    raise TraceError(f"{path}: no {' / '.join(names)} column")


def _optional(table: pa.Table, name: str, n: int) -> list[Any]:
    return table.column(name).to_pylist() if name in table.column_names else [None] * n


def _table(path: Path) -> pa.Table:
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return pacsv.read_csv(path)
    if suffix in (".parquet", ".pq"):
        return pq.read_table(path)
    if suffix == ".jsonl":  # a run's records-*.jsonl
        return records_to_table(read_jsonl(path))
    raise TraceError(f"{path}: a trace is Mooncake .jsonl, records .jsonl, .csv or .parquet")


def read_trace_rows(path: Path) -> TraceRows:
    """The rows of a trace file in any of the formats above."""
    if _is_mooncake(path):
        return _mooncake(path)
    table = _table(path)
    n = table.num_rows
    times = _column(table, _TIME, path)
    prompts = _column(table, ("prompt_tokens",), path)
    # A run's records: max_tokens is what each request asked for (output_tokens is the
    # usage, absent for requests that were turned away or cut off). Records of an older
    # schema lack the fields added since.
    is_records = set(FIELD_NAMES) - set(ADDED_FIELDS) <= set(table.column_names)
    outputs = _column(table, ("max_tokens",) if is_records else _OUTPUT, path)
    tenants = _optional(table, "tenant", n)
    optional = {name: _optional(table, name, n) for name in (
        "endpoint", "priority", "deadline_ms", "stream", "request_id", "phase", "user", "model")}
    known: dict[str, list[int]] = defaultdict(list)
    for tenant, prompt in zip(tenants, prompts, strict=True):
        if prompt is not None:
            known[str(tenant)].append(int(prompt))
    median = {t: max(1, round(statistics.median(v))) for t, v in known.items()}
    rows, filled = [], 0
    for i in range(n):
        t, tenant = times[i], None if tenants[i] is None else str(tenants[i])
        if t is None or not math.isfinite(float(t)) or float(t) < 0:
            raise TraceError(f"{path}: row {i}: bad send time {t!r}")
        prompt, output = prompts[i], outputs[i]
        if prompt is None:
            if str(tenant) not in median:
                raise TraceError(f"{path}: row {i}: no prompt_tokens, and tenant {tenant!r} "
                                 "has none to fill it from")
            prompt = median[str(tenant)]
            filled += 1
        if output is None or int(output) < 1:
            raise TraceError(f"{path}: row {i}: output tokens must be >= 1, got {output!r}")
        endpoint = optional["endpoint"][i]
        rows.append(TraceRow(
            t_s=float(t), prompt_tokens=int(prompt), output_tokens=int(output), tenant=tenant,
            request_id=None if optional["request_id"][i] is None
            else str(optional["request_id"][i]),
            endpoint=ENDPOINT_PATHS.get(str(endpoint), str(endpoint)) if endpoint else None,
            priority=None if optional["priority"][i] is None else int(optional["priority"][i]),
            deadline_ms=None if optional["deadline_ms"][i] is None
            else float(optional["deadline_ms"][i]),
            stream=None if optional["stream"][i] is None else bool(optional["stream"][i]),
            phase=str(optional["phase"][i]) if optional["phase"][i] else None,
            user=optional["user"][i], model=str(optional["model"][i])
            if optional["model"][i] else None))
    return TraceRows(rows, "records" if is_records else "table", filled)


@dataclass(frozen=True, slots=True)
class TenantRule:
    """Which tenant of the tenants file sends each row (see the module doc)."""

    kind: str  # "auto" | "hash" | "round_robin" | "column"
    column: str | None = None

    @classmethod
    def parse(cls, text: str) -> TenantRule:
        if text in ("auto", "hash", "round_robin"):
            return cls(text)
        if text.startswith("column:") and len(text) > len("column:"):
            return cls("column", text.removeprefix("column:"))
        raise TraceError(f"tenant rule {text!r}: one of auto, hash, round_robin, column:NAME")

    def __str__(self) -> str:
        return f"column:{self.column}" if self.kind == "column" else self.kind

    def assign(self, rows: Sequence[TraceRow], names: Sequence[str]) -> list[str]:
        if not names:
            raise TraceError("no tenants to assign the trace's requests to")
        if self.kind == "auto":
            named = bool(rows) and all(row.tenant is not None for row in rows)
            rule = TenantRule("column", "tenant") if named else TenantRule("hash")
            return rule.assign(rows, names)
        if self.kind == "round_robin":
            return [names[i % len(names)] for i in range(len(rows))]
        if self.kind == "hash":
            return [names[_stable_hash(_first_block(row, i)) % len(names)]
                    for i, row in enumerate(rows)]
        out, known = [], set(names)
        for i, row in enumerate(rows):
            value = row.tenant if self.column == "tenant" else dict(row.columns).get(
                str(self.column))
            if value is None or value not in known:
                raise TraceError(f"row {i}: {self.column} = {value!r} is not a tenant "
                                 f"({', '.join(names)})")
            out.append(value)
        return out


def _first_block(row: TraceRow, i: int) -> str:
    if row.hash_ids:
        return f"block/{row.hash_ids[0]}"
    return f"row/{row.request_id if row.request_id is not None else i}"


def _stable_hash(text: str) -> int:
    # Python's hash() of a str changes per process; the assignment must not.
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def block_seed(seed: int, hash_id: int) -> int:
    """The content seed of a trace's block: the same for an id throughout a run."""
    return random.Random(f"{seed}/block/{hash_id}").getrandbits(32)


def _assigned(trace: TraceRows, tenants: Sequence[TenantSpec], rule: TenantRule,
              speed: float) -> list[str]:
    """Each row's tenant, by the rule; a session's rows all take its first row's."""
    if not speed > 0:
        raise TraceError(f"speed must be > 0, got {speed}")
    embeddings = [t.name for t in tenants if t.endpoint == "embeddings"]
    if embeddings:
        raise TraceError(f"tenants {', '.join(embeddings)}: a trace replays generation "
                         "requests, not embeddings")
    names = rule.assign(trace.rows, [t.name for t in tenants])
    first: dict[str, str] = {}
    for i, row in enumerate(trace.rows):
        if row.session_id is not None:
            names[i] = first.setdefault(row.session_id, names[i])
    return names


def _message(row: TraceRow, seed: int, content_key: str) -> Message | None:
    """A row's prompt with its blocks; None for a prefix-free one outside a session."""
    if row.hash_ids:
        return Message("user", row.prompt_tokens,
                       blocks=tuple(block_seed(seed, h) for h in row.hash_ids))
    if row.session_id is None:
        return None
    return Message("user", row.prompt_tokens,
                   random.Random(f"{seed}/{content_key}").getrandbits(32))


def trace_plans(trace: TraceRows, tenants: Sequence[TenantSpec], rule: TenantRule, *,
                speed: float = 1.0, seed: int = 0, model: str | None = None
                ) -> list[RequestPlan]:
    """The trace's requests outside sessions as plans of the tenants the rule picks, in send
    order; a row's own endpoint, stream, user and model win over its tenant's. A session's
    turns follow answers: :func:`trace_sessions`."""
    by_name = {t.name: t for t in tenants}
    plans = []
    for i, (row, name) in enumerate(zip(trace.rows, _assigned(trace, tenants, rule, speed),
                                        strict=True)):
        if row.session_id is not None:
            continue
        assert row.t_s is not None  # a row outside a session has a time (_mooncake_row)
        tenant = by_name[name]
        request_id = row.request_id if row.request_id is not None else f"trace-{i}"
        message = _message(row, seed, request_id)
        plans.append(RequestPlan(
            request_id=request_id, tenant=name, tier=tenant.tier,
            phase=row.phase or "trace", user=row.user, endpoint=row.endpoint or tenant.path,
            stream=tenant.stream if row.stream is None else row.stream,
            prompt_tokens=row.prompt_tokens, max_tokens=row.output_tokens,
            scheduled_s=row.t_s / speed,
            content_seed=random.Random(f"{seed}/{request_id}").getrandbits(32),
            model=row.model or tenant.model or model,
            messages=None if message is None else (message,)))
    if len({p.request_id for p in plans}) != len(plans):
        raise TraceError("request ids repeat")
    plans.sort(key=lambda p: (p.scheduled_s, p.request_id))
    return plans


@dataclass(frozen=True, slots=True)
class TraceSession:
    """One AIPerf session of a trace as a conversation (weighbridge.loadgen.conversations):
    its rows are turns, each sent after the previous answer (see the module doc)."""

    session_id: str
    tenant: TenantSpec
    rows: tuple[TraceRow, ...]
    speed: float
    seed: int
    model: str | None = None  # the run's, for a tenant naming none

    @property
    def start_s(self) -> float:
        return (self.rows[0].t_s or 0.0) / self.speed

    def first(self) -> RequestPlan:
        return self._turn(0, (), self.start_s)

    def ended(self, plan: RequestPlan, answer: Answer | None, end_s: float
              ) -> list[RequestPlan]:
        assert plan.turn is not None and plan.messages is not None
        turn = plan.turn + 1
        if answer is None or turn >= len(self.rows):
            return []
        row, end = self.rows[turn], max(end_s, plan.scheduled_s)
        if row.delay_s is not None:
            due = end + row.delay_s / self.speed
        else:
            due = max(end, (row.t_s or 0.0) / self.speed)
        reply = Message("assistant", answer.tokens, text=answer.text,
                        token_ids=answer.token_ids)
        return [self._turn(turn, (*plan.messages, reply), due)]

    def _turn(self, turn: int, history: tuple[Message, ...], due: float) -> RequestPlan:
        row, tenant = self.rows[turn], self.tenant
        request_id = f"{self.session_id}-t{turn}"
        message = _message(row, self.seed, request_id)
        assert message is not None  # a session's row always makes a message
        messages = (*history, message)
        return RequestPlan(
            request_id=request_id, tenant=tenant.name, tier=tenant.tier,
            phase=row.phase or "trace", user=row.user, endpoint=row.endpoint or tenant.path,
            stream=tenant.stream if row.stream is None else row.stream,
            prompt_tokens=sum(m.tokens for m in messages), max_tokens=row.output_tokens,
            scheduled_s=due, content_seed=message.content_seed,
            model=row.model or tenant.model or self.model, messages=messages,
            session_id=self.session_id, turn=turn,
            program=ProgramRef(self.session_id, self.session_id, None, len(self.rows)))


def trace_sessions(trace: TraceRows, tenants: Sequence[TenantSpec], rule: TenantRule, *,
                   speed: float = 1.0, seed: int = 0, model: str | None = None
                   ) -> list[TraceSession]:
    """The trace's sessions, sent by the tenants the rule picks, in the order they start."""
    by_name = {t.name: t for t in tenants}
    grouped: dict[str, tuple[str, list[TraceRow]]] = {}
    for row, name in zip(trace.rows, _assigned(trace, tenants, rule, speed), strict=True):
        if row.session_id is not None:
            grouped.setdefault(row.session_id, (name, []))[1].append(row)
    sessions = [TraceSession(sid, by_name[name], tuple(rows), speed, seed, model)
                for sid, (name, rows) in grouped.items()]
    sessions.sort(key=lambda s: (s.start_s, s.session_id))
    return sessions


@dataclass(frozen=True)
class TraceReplay:
    """What a trace sends: its requests outside sessions at their times, and its sessions,
    each a conversation started at its first turn's time."""

    plans: list[RequestPlan]
    sessions: list[TraceSession]


def trace_replay(trace: TraceRows, tenants: Sequence[TenantSpec], rule: TenantRule, *,
                 speed: float = 1.0, seed: int = 0, model: str | None = None) -> TraceReplay:
    return TraceReplay(
        trace_plans(trace, tenants, rule, speed=speed, seed=seed, model=model),
        trace_sessions(trace, tenants, rule, speed=speed, seed=seed, model=model))
