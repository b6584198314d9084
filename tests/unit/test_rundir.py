"""The run directory contract: run.json roundtrip, per-process JSONL merged into one Parquet
file with unique request ids, and readers that fall back to JSONL for an unfinished run."""

from __future__ import annotations

from pathlib import Path

import pytest

from weighbridge.records import RecordAppender, RequestRecord
from weighbridge.rundir import (
    REQUESTS_PARQUET,
    PhaseInfo,
    RunInfo,
    TenantInfo,
    finish_run,
    read_records,
    read_run_info,
    records_path,
    write_run_info,
)


def record(request_id: str, at: float) -> RequestRecord:
    return RequestRecord(run_id="r1", scenario="steady", phase="main", request_id=request_id,
                         tenant="a", tier="standard", endpoint="/v1/completions", stream=True,
                         scheduled_s=at, end_s=at + 1.0, status="ok")


def test_run_info_roundtrips_with_default_tiers(tmp_path: Path) -> None:
    info = RunInfo.now(run_id="r1", scenario="steady", target="http://127.0.0.1:8000",
                       tenants=[TenantInfo(name="a", tier="interactive", weight=2.0)],
                       phases=[PhaseInfo(name="quiet", start_s=0, end_s=10)])
    write_run_info(tmp_path, info)

    back = read_run_info(tmp_path)
    assert back == info
    assert back.tiers["interactive"].ttft_slo_s == 0.5
    assert back.tiers["standard"].e2e_slo_s == 10.0
    assert back.tenant("a") is not None and back.tenant("a").weight == 2.0  # type: ignore[union-attr]
    assert back.tenant("b") is None


def test_missing_run_json_names_the_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no run\.json"):
        read_run_info(tmp_path)


def test_workers_jsonl_merge_into_one_parquet(tmp_path: Path) -> None:
    for process, ids in (("worker-1", ["a", "b"]), ("worker-2", ["c"])):
        with RecordAppender(records_path(tmp_path, process)) as sink:
            for i, rid in enumerate(ids):
                sink.append(record(rid, float(i)))

    unfinished = read_records(tmp_path)  # from the JSONL files
    assert sorted(r.request_id for r in unfinished) == ["a", "b", "c"]
    assert finish_run(tmp_path) == 3
    assert (tmp_path / REQUESTS_PARQUET).is_file()
    assert sorted(r.request_id for r in read_records(tmp_path)) == ["a", "b", "c"]


def test_repeated_request_id_across_workers_is_refused(tmp_path: Path) -> None:
    for process in ("worker-1", "worker-2"):
        with RecordAppender(records_path(tmp_path, process)) as sink:
            sink.append(record("same", 0.0))

    with pytest.raises(ValueError, match="repeated"):
        finish_run(tmp_path)
    assert not (tmp_path / REQUESTS_PARQUET).exists()


def test_empty_directory_has_no_records(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_records(tmp_path)
    with pytest.raises(ValueError):
        records_path(tmp_path, "a/b")
