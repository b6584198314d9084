"""A run's records as one pandas DataFrame, read column-wise: the report's view of a run.

A million records would take tens of seconds as :class:`~weighbridge.records.RequestRecord`
objects; read straight from Parquet into columns they take about a second. An unfinished run
(JSONL files only) goes through :func:`weighbridge.rundir.read_records`, which validates
every line, since such runs are small.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from rich.progress import Progress

from weighbridge.records import ADDED_FIELDS, FIELD_NAMES, RECORD_SCHEMA
from weighbridge.rundir import REQUESTS_PARQUET, RunInfo, read_records, read_run_info

# Labels repeat across rows: categorical columns make group-bys cheap.
CATEGORICAL = ("tenant", "tier", "endpoint", "phase", "status", "reason", "model", "backend")
NUMERIC = ("max_tokens", "scheduled_s", "sent_s", "first_token_s", "last_token_s", "end_s",
           "prompt_tokens", "output_tokens", "itl_p50_s", "itl_p99_s", "itl_max_s", "queue_s",
           "cached_tokens", "turn", "program_calls")
# Ids of agent programs: nearly one value per few rows, so plain strings, not categories.
IDENTIFIERS = ("program_id", "parent_program_id")
COLUMNS = CATEGORICAL + NUMERIC + IDENTIFIERS


@dataclass(frozen=True)
class Run:
    """What the report reads: ``run.json``, the records, and the span they are judged over."""

    path: Path
    info: RunInfo
    frame: pd.DataFrame  # COLUMNS plus the derived ttft_s, e2e_s, decode_tps, tokens
    duration_s: float  # run.json's duration, else the last record's end

    @property
    def records(self) -> int:
        return len(self.frame)


def load_run(run_dir: Path, progress: Progress | None = None) -> Run:
    info = read_run_info(run_dir)
    frame = read_frame(run_dir, progress)
    last_end = float(frame["end_s"].max()) if len(frame) else 0.0
    duration = info.duration_s if info.duration_s else last_end
    return Run(path=run_dir, info=info, frame=frame, duration_s=float(duration))


def read_frame(run_dir: Path, progress: Progress | None = None) -> pd.DataFrame:
    parquet = run_dir / REQUESTS_PARQUET
    if parquet.is_file():
        table = _read_parquet(parquet, progress)
    else:
        table = _read_jsonl(run_dir, progress)
    return with_derived(_to_pandas(table))


def _read_parquet(path: Path, progress: Progress | None) -> pa.Table:
    names = pq.read_schema(path).names
    source = pq.ParquetFile(path, read_dictionary=[c for c in CATEGORICAL if c in names])
    # A file of an older record schema lacks the fields added since: they read as null.
    missing = [c for c in COLUMNS if c not in names and c not in ADDED_FIELDS]
    if missing:
        raise ValueError(f"{path}: not a request-record file (missing {', '.join(missing)})")
    present = [c for c in COLUMNS if c in names]
    groups = source.num_row_groups
    task = progress.add_task(f"reading {path.name}", total=max(groups, 1)) if progress else None
    tables = []
    for i in range(groups):
        tables.append(source.read_row_group(i, columns=present))
        if progress is not None and task is not None:
            progress.advance(task)
    if not tables:
        table = source.schema_arrow.empty_table().select(present)
    else:
        table = pa.concat_tables(tables).unify_dictionaries()
    for name in COLUMNS:
        if name not in names:
            table = table.append_column(RECORD_SCHEMA.field(name),
                                        pa.nulls(table.num_rows, RECORD_SCHEMA.field(name).type))
    return table.select(list(COLUMNS))


def _read_jsonl(run_dir: Path, progress: Progress | None) -> pa.Table:
    task = progress.add_task(f"reading JSONL records in {run_dir.name}", total=None) \
        if progress else None
    records = read_records(run_dir)
    if progress is not None and task is not None:
        progress.update(task, total=1, completed=1)
    columns = {name: [getattr(r, name) for r in records] for name in COLUMNS}
    schema = pa.schema([RECORD_SCHEMA.field(name) for name in COLUMNS])
    return pa.Table.from_pydict(columns, schema=schema)


def _to_pandas(table: pa.Table) -> pd.DataFrame:
    frame = table.to_pandas()
    for name in CATEGORICAL:
        if not isinstance(frame[name].dtype, pd.CategoricalDtype):
            frame[name] = frame[name].astype("category")
    for name in NUMERIC:
        frame[name] = frame[name].astype(np.float64)  # nullable ints: NaN for unknown
    return frame


def with_derived(frame: pd.DataFrame) -> pd.DataFrame:
    """Adds the derived quantities (docs/analysis.md), vectorised (never stored in the
    records)."""
    frame["ttft_s"] = frame["first_token_s"] - frame["scheduled_s"]
    frame["e2e_s"] = frame["end_s"] - frame["scheduled_s"]
    span = frame["last_token_s"] - frame["first_token_s"]
    decoding = (frame["output_tokens"] >= 2) & (span > 0)
    frame["decode_tps"] = ((frame["output_tokens"] - 1) / span).where(decoding)
    frame["tokens"] = frame["prompt_tokens"].fillna(0) + frame["output_tokens"].fillna(0)
    return frame


assert set(COLUMNS) <= set(FIELD_NAMES)  # the record schema is the contract
