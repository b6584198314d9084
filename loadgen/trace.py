"""Trace replay: recorded traffic made into request plans, for the load generator
(``locust -f scenarios/ --trace FILE``) and for ``weighbridge simulate --trace FILE``.

Formats, told apart by their content:

* **Mooncake JSONL**: one object a line with ``timestamp`` (ms from the trace's start),
  ``input_length``, ``output_length`` and ``hash_ids``. Each hash id names one block of
  ``TRACE_BLOCK`` (512) tokens: the same id is the same tokens in every request, so requests
  whose ids start alike share a prefix. The last id holds the rest of the prompt (a partial
  block is the first tokens of that id's block).
* **our records** (a run's ``requests.parquet`` or ``records-*.jsonl``) and CSV or Parquet
  tables with one row per request: ``scheduled_s`` [``arrival_s``, ``t``], ``tenant``,
  ``prompt_tokens``, ``output_tokens`` [``max_tokens``; a run's records: ``max_tokens``,
  what each request asked for], and optionally ``endpoint``, ``priority``, ``deadline_ms``,
  ``stream``, ``request_id``, ``phase``, ``user``, ``model``. The records hold no prompt
  content, so their prompts are prefix-free. A request the run turned away has no
  ``prompt_tokens``: it gets its tenant's median prompt (counted as ``filled``).

Traces carry no tenant of the tenants file, so a rule assigns one (:class:`TenantRule`):
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

from weighbridge.loadgen.plan import Message, RequestPlan
from weighbridge.loadgen.tenants import ENDPOINT_PATHS, TenantSpec
from weighbridge.records import ADDED_FIELDS, FIELD_NAMES, read_jsonl, records_to_table

__all__ = ["TenantRule", "TraceError", "TraceRow", "TraceRows", "read_trace_rows",
           "trace_plans"]

_TIME = ("scheduled_s", "arrival_s", "t")
_OUTPUT = ("output_tokens", "max_tokens")
_MOONCAKE = ("timestamp", "input_length", "output_length")


class TraceError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One recorded request."""

    t_s: float  # when it was sent, seconds from the trace's start
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


@dataclass(frozen=True)
class TraceRows:
    rows: list[TraceRow]
    format: str  # "mooncake" | "records" | "table"
    filled: int = 0  # rows whose prompt length was filled in (see the module doc)

    @property
    def end_s(self) -> float:
        return max((r.t_s for r in self.rows), default=0.0)


def _is_mooncake(path: Path) -> bool:
    if path.suffix.lower() != ".jsonl":
        return False
    with path.open("rb") as file:
        for line in file:
            if line.strip():
                first = orjson.loads(line)
                return isinstance(first, dict) and all(k in first for k in _MOONCAKE)
    return False


def _mooncake(path: Path) -> TraceRows:
    rows = []
    with path.open("rb") as file:
        for lineno, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                obj = orjson.loads(line)
                t = float(obj["timestamp"]) / 1000
                prompt, output = int(obj["input_length"]), int(obj["output_length"])
                ids = obj.get("hash_ids")
                hash_ids = tuple(int(h) for h in ids) if ids else None
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise TraceError(f"{path}:{lineno}: not a Mooncake row: {exc}") from None
            if not (math.isfinite(t) and t >= 0 and prompt >= 1 and output >= 1):
                raise TraceError(f"{path}:{lineno}: timestamp >= 0, input_length and "
                                 "output_length >= 1 expected")
            extra = tuple((str(k), str(v)) for k, v in obj.items()
                          if k not in (*_MOONCAKE, "hash_ids"))
            rows.append(TraceRow(t, prompt, output, hash_ids, columns=extra))
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


def trace_plans(trace: TraceRows, tenants: Sequence[TenantSpec], rule: TenantRule, *,
                speed: float = 1.0, seed: int = 0, model: str | None = None
                ) -> list[RequestPlan]:
    """The trace's requests as plans of the tenants the rule picks, in send order; a row's
    own endpoint, stream, user and model win over its tenant's."""
    if not speed > 0:
        raise TraceError(f"speed must be > 0, got {speed}")
    by_name = {t.name: t for t in tenants}
    embeddings = [t.name for t in tenants if t.endpoint == "embeddings"]
    if embeddings:
        raise TraceError(f"tenants {', '.join(embeddings)}: a trace replays generation "
                         "requests, not embeddings")
    names = rule.assign(trace.rows, [t.name for t in tenants])
    plans = []
    for i, (row, name) in enumerate(zip(trace.rows, names, strict=True)):
        tenant = by_name[name]
        request_id = row.request_id if row.request_id is not None else f"trace-{i}"
        messages = None
        if row.hash_ids:
            blocks = tuple(block_seed(seed, h) for h in row.hash_ids)
            messages = (Message("user", row.prompt_tokens, blocks=blocks),)
        plans.append(RequestPlan(
            request_id=request_id, tenant=name, tier=tenant.tier,
            phase=row.phase or "trace", user=row.user, endpoint=row.endpoint or tenant.path,
            stream=tenant.stream if row.stream is None else row.stream,
            prompt_tokens=row.prompt_tokens, max_tokens=row.output_tokens,
            scheduled_s=row.t_s / speed,
            content_seed=random.Random(f"{seed}/{request_id}").getrandbits(32),
            model=row.model or tenant.model or model, messages=messages))
    if len({p.request_id for p in plans}) != len(plans):
        raise TraceError("request ids repeat")
    plans.sort(key=lambda p: (p.scheduled_s, p.request_id))
    return plans
