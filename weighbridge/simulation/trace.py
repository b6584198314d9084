"""Trace replay: recorded requests as the clients of a simulated run.

A trace is CSV or Parquet with one row per request and these columns (aliases in brackets):

* ``scheduled_s`` [``arrival_s``, ``t``]: when the request was sent, seconds from the start;
* ``tenant``: a tenant of the sidecar config;
* ``prompt_tokens``;
* ``output_tokens`` [``max_tokens``]: tokens it generates (sent as ``max_tokens`` with
  ``ignore_eos``);
* optional: ``endpoint`` (API path or ``chat``/``completions``), ``priority`` (the body's vLLM
  priority), ``deadline_ms`` (the deadline header), ``stream`` (default true),
  ``request_id``, ``phase``, ``user``, ``model`` (kept in the replayed records).

A live run's ``requests.parquet`` is a trace: its ``max_tokens`` is what each request asked
for, and a request the run turned away has no ``prompt_tokens`` (no usage came back): it is
replayed with its tenant's median prompt (the count of such rows is in run.json).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from weighbridge import headers as headers_
from weighbridge.loadgen.plan import RequestPlan
from weighbridge.loadgen.tenants import ENDPOINT_PATHS
from weighbridge.records import ADDED_FIELDS, FIELD_NAMES
from weighbridge.simulation.clients import ClientRequest

__all__ = ["DEFAULT_TIMEOUT_S", "Trace", "TraceError", "read_trace"]

_TIME = ("scheduled_s", "arrival_s", "t")
_OUTPUT = ("output_tokens", "max_tokens")
DEFAULT_TIMEOUT_S = 300.0  # the load generator's default client timeout


class TraceError(ValueError):
    pass


@dataclass(frozen=True)
class Trace:
    requests: list[ClientRequest]
    end_s: float  # the last send time
    filled_prompts: int  # rows whose prompt length was filled in (see the module doc)


def _column(table: pa.Table, names: tuple[str, ...], path: Path) -> list[Any]:
    for name in names:
        if name in table.column_names:
            return table.column(name).to_pylist()
    raise TraceError(f"{path}: no {' / '.join(names)} column")


def _optional(table: pa.Table, name: str) -> list[Any] | None:
    return table.column(name).to_pylist() if name in table.column_names else None


def read_trace(path: Path, *, run_id: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Trace:
    if path.suffix.lower() == ".csv":
        table = pacsv.read_csv(path)
    elif path.suffix.lower() in (".parquet", ".pq"):
        table = pq.read_table(path)
    else:
        raise TraceError(f"{path}: a trace is .csv or .parquet")
    times = _column(table, _TIME, path)
    tenants = [str(t) for t in _column(table, ("tenant",), path)]
    prompts = _column(table, ("prompt_tokens",), path)
    # A run's records: max_tokens is what each request asked for (output_tokens is the
    # usage, absent for requests that were turned away or cut off). Records of an older
    # schema lack the fields added since.
    is_records = set(FIELD_NAMES) - set(ADDED_FIELDS) <= set(table.column_names)
    outputs = _column(table, ("max_tokens",) if is_records else _OUTPUT, path)
    endpoints = _optional(table, "endpoint")
    priorities = _optional(table, "priority")
    deadlines = _optional(table, "deadline_ms")
    streams = _optional(table, "stream")
    ids = _optional(table, "request_id")
    phases = _optional(table, "phase")
    users = _optional(table, "user")
    models = _optional(table, "model")
    known: dict[str, list[int]] = defaultdict(list)
    for tenant, prompt in zip(tenants, prompts, strict=True):
        if prompt is not None:
            known[tenant].append(int(prompt))
    median = {t: max(1, round(statistics.median(v))) for t, v in known.items()}
    requests: list[ClientRequest] = []
    filled = 0
    for i, (t, tenant) in enumerate(zip(times, tenants, strict=True)):
        if t is None or not math.isfinite(float(t)) or float(t) < 0:
            raise TraceError(f"{path}: row {i}: bad send time {t!r}")
        prompt, output = prompts[i], outputs[i]
        if prompt is None:
            if tenant not in median:
                raise TraceError(f"{path}: row {i}: no prompt_tokens, and tenant {tenant!r} "
                                 "has none to fill it from")
            prompt = median[tenant]
            filled += 1
        if output is None or int(output) < 1:
            raise TraceError(f"{path}: row {i}: output tokens must be >= 1, got {output!r}")
        endpoint = str(endpoints[i]) if endpoints and endpoints[i] else "/v1/completions"
        endpoint = ENDPOINT_PATHS.get(endpoint, endpoint)
        headers = {}
        if deadlines and deadlines[i] is not None:
            headers[headers_.DEADLINE_MS] = str(deadlines[i])
        plan = RequestPlan(
            request_id=str(ids[i]) if ids and ids[i] is not None else f"{tenant}-{i}",
            tenant=tenant, tier="", phase=str(phases[i]) if phases and phases[i] else "trace",
            user=users[i] if users else None, endpoint=endpoint,
            stream=bool(streams[i]) if streams and streams[i] is not None else True,
            prompt_tokens=int(prompt), max_tokens=int(output), scheduled_s=float(t),
            content_seed=0, model=str(models[i]) if models and models[i] else None)
        requests.append(ClientRequest(
            plan=plan, tenant=tenant, api_key=None, timeout_s=timeout_s,
            priority=int(priorities[i]) if priorities and priorities[i] is not None else None,
            headers=headers))
    if len({r.plan.request_id for r in requests}) != len(requests):
        raise TraceError(f"{path}: request ids repeat")
    return Trace(requests, max((r.plan.scheduled_s for r in requests), default=0.0), filled)
