"""The request record: its field contract, derived values, and lossless JSONL/Parquet storage."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weighbridge.records import (
    ADDED_FIELDS,
    FIELD_NAMES,
    RECORD_SCHEMA,
    SCHEMA_VERSION,
    STATUSES,
    RecordAppender,
    RequestRecord,
    jsonl_to_parquet,
    read_jsonl,
    read_parquet,
    records_to_table,
    write_parquet,
)

# The record contract (docs/loadgen.md, "Measurement definitions"), in order.
DESIGN_FIELDS = [
    "run_id",
    "scenario",
    "phase",
    "request_id",
    "tenant",
    "tier",
    "user",
    "endpoint",
    "stream",
    "max_tokens",
    "scheduled_s",
    "sent_s",
    "first_token_s",
    "last_token_s",
    "end_s",
    "prompt_tokens",
    "output_tokens",
    "chunks",
    "itl_p50_s",
    "itl_p99_s",
    "itl_max_s",
    "status",
    "http_status",
    "reason",
    "backend",
    "queue_s",
    "model",  # schema 2
    "session_id",  # schema 3
    "turn",  # schema 3
    "cached_tokens",  # schema 3
    "program_id",  # schema 4
    "parent_program_id",  # schema 4
    "program_calls",  # schema 4
]


def record(**overrides: Any) -> RequestRecord:
    values: dict[str, Any] = {
        "run_id": "run-1",
        "scenario": "noisy",
        "phase": "steady",
        "request_id": "r-1",
        "tenant": "acme",
        "tier": "interactive",
        "user": "u-7",
        "endpoint": "/v1/chat/completions",
        "stream": True,
        "max_tokens": 128,
        "scheduled_s": 10.0,
        "sent_s": 10.001,
        "first_token_s": 10.25,
        "last_token_s": 12.25,
        "end_s": 12.5,
        "prompt_tokens": 1000,
        "output_tokens": 101,
        "chunks": 101,
        "itl_p50_s": 0.02,
        "itl_p99_s": 0.05,
        "itl_max_s": 0.08,
        "status": "ok",
        "http_status": 200,
        "reason": None,
        "backend": "127.0.0.1:8001",
        "queue_s": 0.003,
        "model": "model-a",
    }
    values.update(overrides)
    return RequestRecord(**values)


def rejected(**overrides: Any) -> RequestRecord:
    """A rejection knows only the minimum: no tokens, no timings past the end."""
    base = dict(
        run_id="run-1",
        scenario="noisy",
        phase="steady",
        request_id="r-2",
        tenant="acme",
        tier="batch",
        endpoint="/v1/completions",
        stream=False,
        scheduled_s=3.0,
        sent_s=3.0,
        end_s=3.002,
        status="rejected",
        http_status=429,
        reason="rate_limited",
    )
    return RequestRecord(**(base | overrides))


# ----------------------------------------------------------------------------- schema


def test_fields_are_exactly_the_design_contract_in_order() -> None:
    assert list(FIELD_NAMES) == DESIGN_FIELDS
    assert [f.name for f in dataclasses.fields(RequestRecord)] == DESIGN_FIELDS
    assert RECORD_SCHEMA.names == DESIGN_FIELDS


def test_derived_fields_are_not_stored() -> None:
    stored = set(record().to_dict()) | set(RECORD_SCHEMA.names)

    assert not stored & {"ttft_s", "e2e_s", "decode_tps"}


def test_arrow_schema_types_and_nullability() -> None:
    schema = RECORD_SCHEMA

    assert schema.field("scheduled_s").type == pa.float64()
    assert not schema.field("scheduled_s").nullable
    assert schema.field("first_token_s").nullable
    assert schema.field("prompt_tokens").type == pa.int64()
    assert schema.field("stream").type == pa.bool_()
    assert schema.field("status").type == pa.string()
    assert not schema.field("status").nullable


def test_statuses() -> None:
    assert {"ok", "rejected", "error", "cancelled", "timeout"} == STATUSES


# ----------------------------------------------------------------------------- derived


def test_derived_values() -> None:
    r = record()

    assert r.ttft_s == pytest.approx(0.25)
    assert r.e2e_s == pytest.approx(2.5)
    # 100 tokens after the first, over the 2 s between first and last token.
    assert r.decode_tps == pytest.approx(50.0)


def test_derived_values_undefined_for_a_rejection() -> None:
    r = rejected()

    assert r.ttft_s is None
    assert r.decode_tps is None
    assert r.e2e_s == pytest.approx(0.002)


@pytest.mark.parametrize(
    "overrides",
    [
        {"output_tokens": 1},  # one token: no decode interval
        {"output_tokens": 0},
        {"output_tokens": None},
        {"last_token_s": 10.25},  # zero span
        {"last_token_s": None},
    ],
)
def test_decode_tps_undefined(overrides: dict[str, Any]) -> None:
    assert record(**overrides).decode_tps is None


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"status": "done"}, "status: unknown status 'done'"),
        ({"scheduled_s": None}, "scheduled_s: must not be null"),
        ({"end_s": float("nan")}, "end_s: must be finite"),
        ({"sent_s": "1.0"}, "sent_s: expected a number"),
        ({"output_tokens": 1.5}, "output_tokens: expected an integer"),
        ({"output_tokens": -1}, "output_tokens: must be a non-negative 64-bit integer"),
        ({"chunks": True}, "chunks: expected an integer"),
        ({"stream": 1}, "stream: expected a boolean"),
        ({"tenant": 7}, "tenant: expected a string"),
    ],
)
def test_invalid_values_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        record(**overrides)


def test_integer_times_become_floats() -> None:
    r = record(scheduled_s=10, end_s=12)

    assert isinstance(r.scheduled_s, float)
    assert isinstance(r.end_s, float)


# ----------------------------------------------------------------------------- JSONL


def test_appender_writes_one_flushed_line_per_record(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"

    with RecordAppender(path) as sink:
        sink.append(record())
        # Flushed: readable before the appender closes.
        assert read_jsonl(path) == [record()]
        sink.append(rejected())

    lines = path.read_bytes().splitlines()
    assert len(lines) == 2
    assert list(orjson.loads(lines[0])) == DESIGN_FIELDS
    assert read_jsonl(path) == [record(), rejected()]


def test_appender_appends_to_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    with RecordAppender(path) as sink:
        sink.append(record())
    with RecordAppender(path) as sink:
        sink.append(rejected())

    assert read_jsonl(path) == [record(), rejected()]


def test_closed_appender_refuses(tmp_path: Path) -> None:
    sink = RecordAppender(tmp_path / "run.jsonl")
    sink.close()

    with pytest.raises(ValueError, match="closed"):
        sink.append(record())


def test_optional_fields_may_be_omitted_in_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    row = {k: v for k, v in rejected().to_dict().items() if v is not None}
    path.write_bytes(orjson.dumps(row) + b"\n\n")  # a trailing blank line is fine

    assert read_jsonl(path) == [rejected()]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (b"{not json", r"run\.jsonl:2: invalid JSON"),
        (b"[1, 2]", r"run\.jsonl:2: expected a JSON object"),
        (
            orjson.dumps(record().to_dict() | {"status": "finished"}),
            r"run\.jsonl:2: status: unknown status 'finished'",
        ),
        (
            orjson.dumps(record().to_dict() | {"colour": "red"}),
            r"run\.jsonl:2: unknown field\(s\): colour",
        ),
        (
            orjson.dumps({k: v for k, v in record().to_dict().items() if k != "end_s"}),
            r"run\.jsonl:2: missing 1 required keyword-only argument: 'end_s'",
        ),
    ],
)
def test_bad_jsonl_line_names_its_line_number(tmp_path: Path, line: bytes, message: str) -> None:
    path = tmp_path / "run.jsonl"
    path.write_bytes(orjson.dumps(record().to_dict()) + b"\n" + line + b"\n")

    with pytest.raises(ValueError, match=message):
        read_jsonl(path)


# ----------------------------------------------------------------------------- Parquet


def test_parquet_roundtrip_and_file_schema(tmp_path: Path) -> None:
    path = tmp_path / "run.parquet"
    records = [record(), rejected()]

    write_parquet(records, path)

    assert read_parquet(path) == records
    assert pq.read_schema(path).remove_metadata() == RECORD_SCHEMA.remove_metadata()


def test_model_roundtrips_and_is_null_when_the_request_named_none(tmp_path: Path) -> None:
    path = tmp_path / "run.parquet"
    records = [record(model="model-a-lora"), record(request_id="r-2", model=None)]

    write_parquet(records, path)

    assert [r.model for r in read_parquet(path)] == ["model-a-lora", None]
    assert RECORD_SCHEMA.field("model").type == pa.string()
    assert RECORD_SCHEMA.field("model").nullable
    assert RECORD_SCHEMA.metadata == {b"weighbridge.record_schema": str(SCHEMA_VERSION).encode()}
    assert ADDED_FIELDS["model"] == 2 and SCHEMA_VERSION >= 2


@pytest.mark.parametrize(("overrides", "end"), [
    ({}, None),  # not a program's call
    ({"program_id": "a-p0", "turn": 3, "program_calls": 4}, "completed"),
    ({"program_id": "a-p0", "turn": 2, "program_calls": 4}, None),  # more calls follow
    ({"program_id": "a-p0", "turn": 1, "program_calls": 4, "status": "timeout"}, "failed"),
    ({"program_id": "a-p0", "turn": 3, "program_calls": 4, "status": "rejected"}, "failed"),
    # Cut off by the run's end: the program is unfinished, neither completed nor failed.
    ({"program_id": "a-p0", "turn": 3, "program_calls": 4, "status": "cancelled"}, None),
    # A subagent's calls end no program a person waits for: its parent resumes without it.
    ({"program_id": "a-p0-c1.0", "parent_program_id": "a-p0", "turn": 1,
      "program_calls": 2}, None),
    ({"program_id": "a-p0-c1.0", "parent_program_id": "a-p0", "turn": 0,
      "program_calls": 2, "status": "error"}, None),
])
def test_a_program_ends_with_its_last_call_or_its_first_failure(
        overrides: dict[str, Any], end: str | None) -> None:
    assert record(**overrides).program_end == end


def test_a_run_recorded_before_schema_2_reads_without_its_fields(tmp_path: Path) -> None:
    """A requests.parquet and JSONL lines written before ``model`` existed still load; the
    field reads as null. Other missing columns are still errors."""
    records = [record(model=None), rejected()]
    old = records_to_table(records).drop_columns(list(ADDED_FIELDS))
    old = old.replace_schema_metadata({"weighbridge.record_schema": "1"})
    path = tmp_path / "old.parquet"
    pq.write_table(old, path)

    assert read_parquet(path) == records

    src, dst = tmp_path / "old.jsonl", tmp_path / "converted.parquet"
    lines = [orjson.dumps({k: v for k, v in r.to_dict().items() if k not in ADDED_FIELDS})
             for r in records]
    src.write_bytes(b"\n".join(lines) + b"\n")
    assert read_jsonl(src) == records
    jsonl_to_parquet(src, dst)
    assert read_parquet(dst) == records

    with pytest.raises(ValueError, match=r"missing \['queue_s'\]"):
        write_parquet(old.drop_columns(["queue_s"]), tmp_path / "bad.parquet")


def test_write_parquet_accepts_a_table_in_any_column_order(tmp_path: Path) -> None:
    table = records_to_table([record(), rejected()])
    shuffled = table.select(list(reversed(table.column_names)))
    path = tmp_path / "run.parquet"

    write_parquet(shuffled, path)

    assert read_parquet(path) == [record(), rejected()]


def test_write_parquet_refuses_a_table_with_wrong_columns(tmp_path: Path) -> None:
    table = (
        records_to_table([record()])
        .drop_columns(["queue_s"])
        .append_column("colour", pa.array(["red"]))
    )

    with pytest.raises(ValueError, match=r"missing \['queue_s'\], extra \['colour'\]"):
        write_parquet(table, tmp_path / "run.parquet")


def test_empty_run_converts_to_a_schema_only_parquet(tmp_path: Path) -> None:
    src, dst = tmp_path / "run.jsonl", tmp_path / "run.parquet"
    src.touch()

    assert jsonl_to_parquet(src, dst) == 0
    assert read_parquet(dst) == []
    assert pq.read_schema(dst).names == DESIGN_FIELDS


def test_jsonl_to_parquet_in_batches(tmp_path: Path) -> None:
    src, dst = tmp_path / "run.jsonl", tmp_path / "run.parquet"
    records = [record(request_id=f"r-{i}", scheduled_s=float(i)) for i in range(7)]
    with RecordAppender(src) as sink:
        for r in records:
            sink.append(r)

    assert jsonl_to_parquet(src, dst, batch_size=3) == 7
    assert read_parquet(dst) == records


def test_failed_conversion_leaves_no_parquet(tmp_path: Path) -> None:
    src, dst = tmp_path / "run.jsonl", tmp_path / "run.parquet"
    src.write_bytes(orjson.dumps(record().to_dict()) + b"\n{oops\n")

    with pytest.raises(ValueError, match=":2: invalid JSON"):
        jsonl_to_parquet(src, dst)
    assert not dst.exists()


# ----------------------------------------------------------------------------- property

_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
_time = st.floats(min_value=0, max_value=1e7, allow_nan=False, allow_infinity=False)
_count = st.integers(min_value=0, max_value=2**63 - 1)

records_strategy = st.builds(
    RequestRecord,
    run_id=_text,
    scenario=_text,
    phase=_text,
    request_id=_text,
    tenant=_text,
    tier=_text,
    user=st.none() | _text,
    endpoint=_text,
    stream=st.booleans(),
    max_tokens=st.none() | _count,
    scheduled_s=_time,
    sent_s=st.none() | _time,
    first_token_s=st.none() | _time,
    last_token_s=st.none() | _time,
    end_s=_time,
    prompt_tokens=st.none() | _count,
    output_tokens=st.none() | _count,
    chunks=_count,
    itl_p50_s=st.none() | _time,
    itl_p99_s=st.none() | _time,
    itl_max_s=st.none() | _time,
    status=st.sampled_from(sorted(STATUSES)),
    http_status=st.none() | st.integers(min_value=100, max_value=599),
    reason=st.none() | _text,
    backend=st.none() | _text,
    queue_s=st.none() | _time,
)


@settings(max_examples=50, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=st.lists(records_strategy, max_size=20))
def test_roundtrip_jsonl_parquet_is_exact(tmp_path: Path, records: list[RequestRecord]) -> None:
    src, dst = tmp_path / "run.jsonl", tmp_path / "run.parquet"
    src.unlink(missing_ok=True)
    with RecordAppender(src) as sink:
        for r in records:
            sink.append(r)

    assert read_jsonl(src) == records
    assert jsonl_to_parquet(src, dst) == len(records)
    assert read_parquet(dst) == records
