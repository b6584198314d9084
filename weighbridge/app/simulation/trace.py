"""Trace replay: recorded requests as the clients of a simulated run.

The formats and their rules are the load generator's (``weighbridge.loadgen.trace``):

* a table (CSV or Parquet) or a run's records names each request's tenant, a tenant of the
  sidecar config, which it is sent as (``read_trace``); a live run's ``requests.parquet``
  is such a trace, replayed at its scheduled times with the ``max_tokens`` each request
  asked for, and a request it turned away gets its tenant's median prompt (run.json's
  ``options.filled_prompts``);
* a Mooncake trace names no tenant: ``trace_clients`` assigns the tenants of a tenants file
  by a rule and builds the same plans ``locust --trace`` sends, the blocks' token ids
  included; its AIPerf sessions are conversations, each turn sent after the previous answer
  as the load generator sends it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from weighbridge import headers as headers_
from weighbridge.app.simulation.clients import ClientRequest, client_request
from weighbridge.loadgen.bodies import BodyOptions
from weighbridge.loadgen.plan import RequestPlan
from weighbridge.loadgen.tenants import TenantSpec
from weighbridge.loadgen.trace import (
    TenantRule,
    TraceError,
    TraceRows,
    read_trace_rows,
    trace_replay,
)

__all__ = ["DEFAULT_TIMEOUT_S", "Trace", "TraceError", "read_trace", "trace_clients"]

DEFAULT_TIMEOUT_S = 300.0  # the load generator's default client timeout


@dataclass(frozen=True)
class Trace:
    requests: list[ClientRequest]  # a session's: its first turn
    end_s: float  # the last send time (a session's turns: were every answer instant)
    filled_prompts: int  # rows whose prompt length was filled in (see the module doc)
    longest_session: int = 1  # turns


def read_trace(path: Path, *, run_id: str, timeout_s: float = DEFAULT_TIMEOUT_S,
               rows: TraceRows | None = None) -> Trace:
    """A trace whose rows name sidecar tenants (a table or a run's records)."""
    del run_id
    rows = rows if rows is not None else read_trace_rows(path)
    if rows.format == "mooncake":
        raise TraceError(f"{path}: a Mooncake trace names no tenants; give a tenants file "
                         "and a tenant rule")
    requests: list[ClientRequest] = []
    for i, row in enumerate(rows.rows):
        if row.tenant is None:
            raise TraceError(f"{path}: no tenant column")
        tenant = row.tenant
        assert row.t_s is not None  # a table's row has its time (read_trace_rows)
        headers = {}
        if row.deadline_ms is not None:
            headers[headers_.DEADLINE_MS] = str(row.deadline_ms)
        plan = RequestPlan(
            request_id=row.request_id if row.request_id is not None else f"{tenant}-{i}",
            tenant=tenant, tier="", phase=row.phase or "trace", user=row.user,
            endpoint=row.endpoint or "/v1/completions",
            stream=True if row.stream is None else row.stream,
            prompt_tokens=row.prompt_tokens, max_tokens=row.output_tokens,
            scheduled_s=row.t_s, content_seed=0, model=row.model)
        requests.append(ClientRequest(plan=plan, tenant=tenant, api_key=None,
                                      timeout_s=timeout_s,
                                      options=BodyOptions(priority=row.priority),
                                      headers=headers))
    if len({r.plan.request_id for r in requests}) != len(requests):
        raise TraceError(f"{path}: request ids repeat")
    return Trace(requests, max((r.plan.scheduled_s for r in requests), default=0.0),
                 rows.filled)


def trace_clients(rows: TraceRows, tenants: Sequence[TenantSpec], rule: TenantRule, *,
                  speed: float = 1.0, seed: int = 0) -> Trace:
    """A trace sent by the tenants of a tenants file, as the load generator sends it."""
    by_name = {t.name: t for t in tenants}
    replay = trace_replay(rows, tenants, rule, speed=speed, seed=seed)
    requests = [client_request(by_name[p.tenant], p) for p in replay.plans]
    requests += [client_request(session.tenant, session.first(), conversation=session)
                 for session in replay.sessions]
    return Trace(requests, rows.end_s / speed, rows.filled, rows.longest_session)
