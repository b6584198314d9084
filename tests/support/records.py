"""Synthetic run directories for tests of the analysis: records written through the real
contract (RecordAppender, finish_run, run.json), so the report reads what a run leaves."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from weighbridge.records import RecordAppender, RequestRecord
from weighbridge.rundir import (
    PhaseInfo,
    RunInfo,
    TenantInfo,
    finish_run,
    records_path,
    write_run_info,
)

_ids = itertools.count()


def rec(tenant: str = "a", *, scheduled: float = 0.0, ttft: float | None = 0.1,
        duration: float = 1.0, prompt: int | None = 10, output: int | None = 10,
        status: str = "ok", tier: str = "standard", phase: str = "main",
        endpoint: str = "/v1/completions", **extra: Any) -> RequestRecord:
    """A record scheduled at ``scheduled``, first token ``ttft`` later, ending ``duration``
    after it was scheduled (the last token at its end)."""
    first = None if ttft is None else scheduled + ttft
    fields: dict[str, Any] = dict(
        run_id="synthetic", scenario="synthetic", phase=phase, request_id=f"r{next(_ids)}",
        tenant=tenant, tier=tier, endpoint=endpoint, stream=True, scheduled_s=scheduled,
        sent_s=scheduled, first_token_s=first,
        last_token_s=None if first is None else scheduled + duration,
        end_s=scheduled + duration, prompt_tokens=prompt, output_tokens=output,
        status=status)
    fields.update(extra)
    return RequestRecord(**fields)


def write_run(run_dir: Path, records: Iterable[RequestRecord], *,
              tenants: Iterable[tuple[str, str, float]] = (), duration: float | None = None,
              phases: Iterable[tuple[str, float, float]] = (),
              options: dict[str, Any] | None = None,
              finish: bool = True, **info: Any) -> Path:
    """A run directory; ``tenants`` as (name, tier, weight), ``phases`` as (name, start, end)."""
    run = RunInfo.now(run_id=info.pop("run_id", "synthetic"), scenario="synthetic",
                      target="http://127.0.0.1:1", duration_s=duration,
                      tenants=[TenantInfo(name=n, tier=t, weight=w) for n, t, w in tenants],
                      phases=[PhaseInfo(name=n, start_s=s, end_s=e) for n, s, e in phases],
                      options=options or {}, **info)
    write_run_info(run_dir, run)
    with RecordAppender(records_path(run_dir, "master")) as sink:
        for r in records:
            sink.append(r)
    if finish:
        finish_run(run_dir)
    return run_dir


def flood_run(run_dir: Path, *, flood_ttft: float, run_id: str) -> Path:
    """A victim sending one request a second through a quiet and a flood phase; its TTFT is
    0.05 s when quiet and ``flood_ttft`` in the flood."""
    records = [rec("victim", scheduled=float(i), ttft=0.05 if i < 10 else flood_ttft,
                   duration=2.0, phase="quiet" if i < 10 else "flood") for i in range(20)]
    records += [rec("flooder", scheduled=10 + i / 10, ttft=1.0, duration=3.0, phase="flood")
                for i in range(100)]
    return write_run(run_dir, records, tenants=[("victim", "standard", 1.0),
                                                ("flooder", "standard", 1.0)],
                     phases=[("quiet", 0.0, 10.0), ("flood", 10.0, 20.0)], duration=23.0,
                     options={"victim": "victim"}, run_id=run_id)
