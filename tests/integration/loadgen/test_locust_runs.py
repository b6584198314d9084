"""Acceptance 3 and 4: ``locust -f scenarios/`` runs the steady scenario against the
emulator, alone and with ``--processes 2``, and leaves a complete run directory. The single
process run is scraped mid-run by its exporter too: one run for both checks."""

from __future__ import annotations

import collections
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.support import locust
from weighbridge.launch import ServerProcess, free_port
from weighbridge.loadgen.plan import plan_request
from weighbridge.loadgen.scenario import discover_scenarios
from weighbridge.records import RECORD_SCHEMA, read_parquet
from weighbridge.rundir import read_run_info

REPO = Path(__file__).resolve().parents[3]


def _run_locust(host: str, records_dir: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return locust.run(host, records_dir, "20s", *extra)


def _check_run_dir(run_dir: Path, result: subprocess.CompletedProcess[str]) -> list:
    detail = f"locust exited {result.returncode}:\n{result.stderr[-4000:]}"
    assert result.returncode == 0, detail
    assert (run_dir / "requests.parquet").is_file(), detail
    assert (run_dir / "run.json").is_file(), detail
    # Every row has the schema's fields and types.
    assert pq.read_schema(run_dir / "requests.parquet").equals(RECORD_SCHEMA,
                                                               check_metadata=False)
    records = read_parquet(run_dir / "requests.parquet")
    info = read_run_info(run_dir)
    assert info.scenario == "steady"
    assert {t.name for t in info.tenants} == {"alpha", "beta", "gamma"}
    # The run's -t 20s, give or take starting and stopping (bounded well under twice it).
    assert info.duration_s is not None and 18 < info.duration_s < 40
    assert info.generator["requests"] == len(records)
    assert info.git_commit
    assert [p.name for p in info.phases] == ["steady"]

    # ~10 req/s for ~20 s; nearly all end ok (the last few are cut off by the run's end).
    assert len(records) > 120
    statuses = collections.Counter(r.status for r in records)
    assert set(statuses) <= {"ok", "cancelled"}, statuses
    assert statuses["ok"] > 0.9 * len(records)
    assert len({r.request_id for r in records}) == len(records)

    # Requested and returned token counts match: the request's sizes are recomputed from
    # the seed, independently of the run.
    scenario = discover_scenarios(REPO / "scenarios", [REPO / "scenarios/locustfile.py"])
    tenants = {t.name: t for t in scenario["steady"].workload().tenants}
    for r in records:
        if r.status != "ok":
            continue
        plan = plan_request(tenants[r.tenant], r.request_id, r.phase, r.scheduled_s, seed=0)
        assert (r.prompt_tokens, r.output_tokens) == (plan.prompt_tokens, plan.max_tokens), r
        assert r.max_tokens == plan.max_tokens
        assert r.first_token_s is not None and r.sent_s is not None
        assert r.scheduled_s <= r.sent_s <= r.first_token_s <= r.last_token_s <= r.end_s
        assert r.chunks == r.output_tokens  # the emulator streams one token per chunk
    return records


@dataclass(frozen=True)
class SteadyRun:
    run_dir: Path
    result: subprocess.CompletedProcess[str]
    mid_run_metrics: str  # the exporter's exposition while the run went on


@pytest.fixture(scope="module")
def steady_run(emulator: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> SteadyRun:
    """One 20 s run in one process, its exporter (``--exporter-port``) scraped while it runs:
    the first scrape that shows every tenant."""
    run_dir = tmp_path_factory.mktemp("steady") / "run"
    port = free_port()
    argv = locust.argv(emulator.url, run_dir, "20s", exporter_port=port)
    result, text = locust.run_scraped(argv, port, lambda t: 'tenant="gamma"' in t)
    return SteadyRun(run_dir, result, text)


def test_steady_scenario_leaves_parquet_and_run_json(steady_run: SteadyRun) -> None:
    run_dir, result = steady_run.run_dir, steady_run.result
    records = _check_run_dir(run_dir, result)
    assert sorted(p.name for p in run_dir.glob("records-*.jsonl")) == ["records-local.jsonl"]
    # Per-tenant rows in Locust's own statistics.
    for tenant in ("alpha", "beta", "gamma"):
        assert f"TTFT     {tenant}" in result.stdout + result.stderr
    assert records


def test_distributed_run_merges_workers_with_unique_ids(emulator: ServerProcess,
                                                        tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = _run_locust(emulator.url, run_dir, "--processes", "2")
    records = _check_run_dir(run_dir, result)
    files = sorted(p.name for p in run_dir.glob("records-*.jsonl"))
    assert files == ["records-worker-0.jsonl", "records-worker-1.jsonl"]
    lines = sum(len((run_dir / f).read_text().splitlines()) for f in files)
    assert lines == len(records)
    # The workers split one schedule: together they sent every request of each tenant
    # up to the end, each exactly once.
    by_tenant: dict[str, list[int]] = collections.defaultdict(list)
    for r in records:
        tenant, _, seq = r.request_id.rpartition("-")
        by_tenant[tenant].append(int(seq))
    for tenant, seqs in by_tenant.items():
        assert sorted(seqs) == list(range(len(seqs))), tenant
    info = read_run_info(run_dir)
    assert set(info.generator["processes"]) == {"worker-0", "worker-1"}


def test_exporter_serves_per_tenant_metrics_during_a_run(steady_run: SteadyRun) -> None:
    """--exporter-port wires exporters/loadgen.py: the tenants' series are live mid-run."""
    assert steady_run.result.returncode == 0, steady_run.result.stderr[-3000:]
    text = steady_run.mid_run_metrics
    for tenant in ("alpha", "beta", "gamma"):
        assert f'weighbridge_client_requests_scheduled_total{{tenant="{tenant}"' in text, text
    assert "weighbridge_client_ttft_seconds_bucket" in text
