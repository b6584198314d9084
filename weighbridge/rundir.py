"""The run directory: what a load-generator run leaves behind, and what the report reads.

A run directory holds

* ``run.json`` — :class:`RunInfo`: the scenario, its tenants (tier, weight), tiers with their
  SLOs, phases, the target, the options and when the run started;
* ``records-<process>.jsonl`` — request records appended while the run goes, one file per
  writing process (a distributed run has one per worker, all on the run's single timeline);
* ``requests.parquet`` — all records of the run, written once at its end.

Readers take the Parquet file when it exists and every JSONL file otherwise, so an
interrupted run can still be reported on.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveFloat

from weighbridge.records import RequestRecord, iter_jsonl, jsonl_to_parquet, read_parquet
from weighbridge.tiers import DEFAULT_TIERS

__all__ = [
    "REQUESTS_PARQUET",
    "RUN_JSON",
    "PhaseInfo",
    "RunInfo",
    "TenantInfo",
    "TierInfo",
    "default_tier_infos",
    "finish_run",
    "read_records",
    "read_run_info",
    "records_path",
    "write_run_info",
]

RUN_JSON = "run.json"
REQUESTS_PARQUET = "requests.parquet"
_RECORDS_GLOB = "records-*.jsonl"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TenantInfo(_Model):
    name: str
    tier: str
    weight: PositiveFloat = 1.0  # the tenant's share within its tier, as the sidecar has it
    endpoint: str | None = None  # the API path it mostly sends to, for the report's tables


class TierInfo(_Model):
    rank: int  # lower is served first
    ttft_slo_s: PositiveFloat | None = None
    e2e_slo_s: PositiveFloat | None = None


class PhaseInfo(_Model):
    name: str
    start_s: NonNegativeFloat  # seconds since run start
    end_s: NonNegativeFloat


def default_tier_infos() -> dict[str, TierInfo]:
    """The tiers of weighbridge's default sidecar config, with their SLOs in seconds."""
    return {
        name: TierInfo(
            rank=tier.rank,
            ttft_slo_s=tier.ttft_slo_ms / 1000 if tier.ttft_slo_ms else None,
            e2e_slo_s=tier.e2e_slo_ms / 1000 if tier.e2e_slo_ms else None,
        )
        for name, tier in DEFAULT_TIERS.items()
    }


class RunInfo(_Model):
    run_id: str
    scenario: str
    started_at: datetime  # wall-clock time of the run's t = 0 (UTC)
    target: str  # the URL the load was sent to
    git_commit: str | None = None
    duration_s: NonNegativeFloat | None = None  # filled in when the run ends
    tenants: list[TenantInfo] = Field(default_factory=list)
    tiers: dict[str, TierInfo] = Field(default_factory=default_tier_infos)
    phases: list[PhaseInfo] = Field(default_factory=list)
    options: dict[str, Any] = Field(default_factory=dict)  # the generator's options, as given
    generator: dict[str, Any] = Field(default_factory=dict)  # its own health (schedule lag)

    @classmethod
    def now(cls, **fields: Any) -> RunInfo:
        return cls(started_at=datetime.now(UTC), **fields)

    def tenant(self, name: str) -> TenantInfo | None:
        return next((t for t in self.tenants if t.name == name), None)


def write_run_info(run_dir: Path, info: RunInfo) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / RUN_JSON
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(info.model_dump_json(indent=2) + "\n")
    tmp.replace(path)  # readers never see half a file
    return path


def read_run_info(run_dir: Path) -> RunInfo:
    path = run_dir / RUN_JSON
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no run.json (is {run_dir} a run directory?)")
    return RunInfo.model_validate_json(path.read_text())


def records_path(run_dir: Path, process: str) -> Path:
    """The JSONL file that process ``process`` (e.g. ``master``, ``worker-3``) appends to."""
    if not process or "/" in process:
        raise ValueError(f"bad process name {process!r}")
    return run_dir / f"records-{process}.jsonl"


def _jsonl_files(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob(_RECORDS_GLOB))


def read_records(run_dir: Path) -> list[RequestRecord]:
    """Every record of the run: the Parquet file when the run finished, else the JSONL files."""
    parquet = run_dir / REQUESTS_PARQUET
    if parquet.is_file():
        return read_parquet(parquet)
    files = _jsonl_files(run_dir)
    if not files:
        raise FileNotFoundError(f"{run_dir}: neither {REQUESTS_PARQUET} nor {_RECORDS_GLOB}")
    return [record for f in files for record in iter_jsonl(f)]


def finish_run(run_dir: Path) -> int:
    """Merge every process's JSONL into ``requests.parquet`` (request ids must be unique);
    returns the number of records."""
    return jsonl_to_parquet(_jsonl_files(run_dir), run_dir / REQUESTS_PARQUET, unique_ids=True)
