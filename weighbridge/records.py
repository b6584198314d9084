"""The request record: one row per request, JSONL while a run is going, Parquet at the end.

Field names and order are a contract shared by the load generator, the exporters and the
analysis (docs/loadgen.md, "Measurement definitions"): extend it, never rename a field. A field
added after the first schema is optional, appended at the end and listed in
``ADDED_FIELDS`` with the schema version that added it; files written before it (a JSONL line
or a Parquet file without the column) read it as null.
Times are seconds since run start. Derived quantities (``ttft_s``, ``e2e_s``,
``decode_tps``) are properties, never stored, so they cannot disagree with the fields they
come from.
"""

from __future__ import annotations

import math
import os
import types
import typing
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import IO, Any, Literal, Self

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

__all__ = [
    "ADDED_FIELDS",
    "FIELD_NAMES",
    "PROGRAM_ENDS",
    "RECORD_SCHEMA",
    "SCHEMA_VERSION",
    "STATUSES",
    "ProgramEnd",
    "RecordAppender",
    "RequestRecord",
    "Status",
    "iter_jsonl",
    "jsonl_to_parquet",
    "read_jsonl",
    "read_parquet",
    "records_to_table",
    "write_parquet",
]

Status = Literal["ok", "rejected", "error", "cancelled", "timeout"]
STATUSES: frozenset[str] = frozenset(typing.get_args(Status))
ProgramEnd = Literal["completed", "failed"]
PROGRAM_ENDS: tuple[str, ...] = typing.get_args(ProgramEnd)

_INT64_MAX = 2**63 - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestRecord:
    run_id: str
    scenario: str
    phase: str
    request_id: str
    tenant: str
    tier: str
    user: str | None = None
    endpoint: str
    stream: bool
    max_tokens: int | None = None
    scheduled_s: float  # when the request was due to be sent: latencies start here
    sent_s: float | None = None  # None when it was never sent (e.g. the run ended first)
    first_token_s: float | None = None  # first chunk carrying generated content
    last_token_s: float | None = None
    end_s: float
    prompt_tokens: int | None = None  # from the server's usage, not counted from chunks
    output_tokens: int | None = None
    chunks: int = 0
    itl_p50_s: float | None = None
    itl_p99_s: float | None = None
    itl_max_s: float | None = None
    status: Status
    http_status: int | None = None  # None when no HTTP response arrived
    reason: str | None = None  # rejection or failure reason, e.g. rate_limited
    backend: str | None = None
    queue_s: float | None = None  # time spent queued in the sidecar, from its header
    # Schema 2: the `model` the request's body named (its tenant's, else the run's); None
    # when it named none, or in runs recorded before schema 2.
    model: str | None = None
    # Schema 3: the session a multi-turn request belongs to and its turn (0 first), None
    # outside sessions; the prompt tokens the server answered from its prefix cache
    # (usage.prompt_tokens_details.cached_tokens), None when it did not report them.
    session_id: str | None = None
    turn: int | None = None
    cached_tokens: int | None = None
    # Schema 4: the agent program the request is a call of (weighbridge.loadgen.programs, or
    # a replayed trace's session), the program that forked it (None for a program nobody
    # forked), and the calls its program planned (its turns); None outside programs.
    program_id: str | None = None
    parent_program_id: str | None = None
    program_calls: int | None = None

    def __post_init__(self) -> None:
        # Validation happens here so that JSONL, Parquet and direct construction all hold
        # the same invariants; a record that cannot roundtrip is refused at creation.
        for name, kind, optional in _FIELD_SPECS:
            value = getattr(self, name)
            checked = _check_value(name, kind, optional, value)
            if checked is not value:
                object.__setattr__(self, name, checked)

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, from the scheduled send time (no coordinated omission)."""
        if self.first_token_s is None:
            return None
        return self.first_token_s - self.scheduled_s

    @property
    def computed_prompt_tokens(self) -> int | None:
        """Prompt tokens the server computed: the prompt less its prefix-cache hits; None
        unless the server reported both."""
        if self.prompt_tokens is None or self.cached_tokens is None:
            return None
        return self.prompt_tokens - self.cached_tokens

    @property
    def program_end(self) -> ProgramEnd | None:
        """How this request ended its program, when it did. A program nobody forked (a
        root: what a person waits for) is ``completed`` when its last planned call ends ok,
        and ``failed`` when any of its calls ends neither ok nor cut off by the run's end
        (``cancelled``: the program is unfinished). A forked program's calls end no root:
        its parent resumes without its answer (weighbridge.loadgen.programs)."""
        if self.program_id is None or self.parent_program_id is not None:
            return None
        if self.status == "cancelled":
            return None
        if self.status != "ok":
            return "failed"
        if self.turn is not None and self.program_calls is not None \
                and self.turn + 1 >= self.program_calls:
            return "completed"
        return None

    @property
    def e2e_s(self) -> float:
        """End-to-end latency from the scheduled send time."""
        return self.end_s - self.scheduled_s

    @property
    def decode_tps(self) -> float | None:
        """Per-sequence decode speed: tokens after the first over the time they took."""
        if (
            self.output_tokens is None
            or self.output_tokens < 2
            or self.first_token_s is None
            or self.last_token_s is None
        ):
            return None
        span = self.last_token_s - self.first_token_s
        if span <= 0:
            return None
        return (self.output_tokens - 1) / span

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in FIELD_NAMES}

    @classmethod
    def from_dict(cls, row: dict[str, Any]) -> Self:
        """Build from a mapping with exactly the record's fields (optional ones may be absent)."""
        unknown = row.keys() - _FIELD_SET
        if unknown:
            raise ValueError(f"unknown field(s): {', '.join(sorted(unknown))}")
        try:
            return cls(**row)
        except TypeError as exc:  # missing required fields
            raise ValueError(str(exc).removeprefix("RequestRecord.__init__() ")) from None


def _check_value(name: str, kind: type, optional: bool, value: Any) -> Any:
    if value is None:
        if optional:
            return None
        raise ValueError(f"{name}: must not be null")
    if kind is float:
        # bool is an int subclass; True as a time is always a bug.
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{name}: expected a number, got {type(value).__name__}")
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"{name}: must be finite, got {value}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}: expected an integer, got {type(value).__name__}")
        if not 0 <= value <= _INT64_MAX:
            raise ValueError(f"{name}: must be a non-negative 64-bit integer, got {value}")
        return value
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{name}: expected a boolean, got {type(value).__name__}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"{name}: expected a string, got {type(value).__name__}")
    if name == "status" and value not in STATUSES:
        raise ValueError(f"status: unknown status {value!r}; expected one of {sorted(STATUSES)}")
    return value


def _field_specs() -> tuple[tuple[str, type, bool], ...]:
    """(name, base type, optional) per field, derived from the annotations."""
    hints = typing.get_type_hints(RequestRecord)
    specs = []
    for f in fields(RequestRecord):
        hint = hints[f.name]
        args = typing.get_args(hint)
        optional = isinstance(hint, types.UnionType) and type(None) in args
        base = next(a for a in args if a is not type(None)) if optional else hint
        if typing.get_origin(base) is Literal:
            base = str
        specs.append((f.name, base, optional))
    return tuple(specs)


_FIELD_SPECS = _field_specs()
FIELD_NAMES: tuple[str, ...] = tuple(name for name, _, _ in _FIELD_SPECS)
_FIELD_SET = frozenset(FIELD_NAMES)

_ARROW_TYPES: dict[type, pa.DataType] = {
    str: pa.string(),
    bool: pa.bool_(),
    int: pa.int64(),
    float: pa.float64(),
}

SCHEMA_VERSION = 4
# Fields added after schema 1 -> the schema version that added them. Each is optional and
# comes after every field of schema 1; an older file without it reads it as null.
ADDED_FIELDS: dict[str, int] = {"model": 2, "session_id": 3, "turn": 3, "cached_tokens": 3,
                                "program_id": 4, "parent_program_id": 4, "program_calls": 4}
assert all(optional for name, _, optional in _FIELD_SPECS if name in ADDED_FIELDS)
assert set(FIELD_NAMES[-len(ADDED_FIELDS):]) == set(ADDED_FIELDS)

RECORD_SCHEMA: pa.Schema = pa.schema(
    [
        pa.field(name, _ARROW_TYPES[kind], nullable=optional)
        for name, kind, optional in _FIELD_SPECS
    ],
    metadata={"weighbridge.record_schema": str(SCHEMA_VERSION)},
)


# --------------------------------------------------------------------------- JSONL


class RecordAppender:
    """Appends records to a JSONL file, one line each, flushed so a crash loses at most one."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._file: IO[bytes] | None = self.path.open("ab")

    def append(self, record: RequestRecord) -> None:
        if self._file is None:
            raise ValueError(f"{self.path}: appender is closed")
        self._file.write(orjson.dumps(record.to_dict(), option=orjson.OPT_APPEND_NEWLINE))
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def iter_jsonl(path: str | os.PathLike[str]) -> Iterator[RequestRecord]:
    """Records of a JSONL file; blank lines are skipped, any bad line is a ValueError."""
    with Path(path).open("rb") as file:
        for lineno, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: invalid JSON: {exc}") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object")
            try:
                yield RequestRecord.from_dict(row)
            except ValueError as exc:
                raise ValueError(f"{path}:{lineno}: {exc}") from None


def read_jsonl(path: str | os.PathLike[str]) -> list[RequestRecord]:
    return list(iter_jsonl(path))


# --------------------------------------------------------------------------- Parquet


def records_to_table(records: Iterable[RequestRecord]) -> pa.Table:
    rows = list(records)
    columns = {name: [getattr(r, name) for r in rows] for name in FIELD_NAMES}
    return pa.Table.from_pydict(columns, schema=RECORD_SCHEMA)


def _conform(table: pa.Table) -> pa.Table:
    """The table's columns in schema order and types; a field added after schema 1
    (``ADDED_FIELDS``) that the table lacks is all null; other missing or extra columns are
    errors."""
    names = set(table.column_names)
    for name in ADDED_FIELDS:
        if name not in names:
            table = table.append_column(RECORD_SCHEMA.field(name),
                                        pa.nulls(table.num_rows, RECORD_SCHEMA.field(name).type))
    names = set(table.column_names)
    missing = [n for n in FIELD_NAMES if n not in names]
    extra = sorted(names - _FIELD_SET)
    if missing or extra:
        raise ValueError(f"table does not match RECORD_SCHEMA: missing {missing}, extra {extra}")
    return table.select(list(FIELD_NAMES)).cast(RECORD_SCHEMA)


def write_parquet(
    records_or_table: Iterable[RequestRecord] | pa.Table, path: str | os.PathLike[str]
) -> None:
    if isinstance(records_or_table, pa.Table):
        table = _conform(records_or_table)
    else:
        table = records_to_table(records_or_table)
    pq.write_table(table, path, compression="zstd")


def read_parquet(path: str | os.PathLike[str]) -> list[RequestRecord]:
    table = _conform(pq.read_table(path))
    return [RequestRecord(**row) for row in table.to_pylist()]


def jsonl_to_parquet(
    src: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    dst: str | os.PathLike[str],
    *,
    batch_size: int = 50_000,
    unique_ids: bool = False,
) -> int:
    """Convert a run's JSONL file(s) to one Parquet file in bounded memory; returns the number
    of records. With ``unique_ids``, a request id repeated anywhere in the files (a
    distributed run's workers each write one) raises ``ValueError``; no file is left behind
    on any error."""
    sources = [src] if isinstance(src, str | os.PathLike) else list(src)
    count = 0
    seen: set[str] = set()
    batch: list[RequestRecord] = []
    try:
        with pq.ParquetWriter(dst, RECORD_SCHEMA, compression="zstd") as writer:
            for path in sources:
                for record in iter_jsonl(path):
                    if unique_ids:
                        if record.request_id in seen:
                            raise ValueError(
                                f"{path}: request_id {record.request_id!r} repeated")
                        seen.add(record.request_id)
                    batch.append(record)
                    if len(batch) >= batch_size:
                        writer.write_table(records_to_table(batch))
                        count += len(batch)
                        batch.clear()
            # Always write, so an empty run still yields a file with the schema.
            writer.write_table(records_to_table(batch))
            count += len(batch)
    except BaseException:
        # A half-written Parquet file would look like a complete, shorter run.
        Path(dst).unlink(missing_ok=True)
        raise
    return count
