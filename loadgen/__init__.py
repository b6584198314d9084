"""weighbridge's Locust load generator: multi-tenant LLM traffic measured per request.

Pure parts (no I/O, seeded): :mod:`weighbridge.loadgen.lengths` (token-length distributions),
:mod:`weighbridge.loadgen.arrivals` (arrival processes), :mod:`weighbridge.loadgen.tenants` (the
tenants file), :mod:`weighbridge.loadgen.scenario` (phases, scenarios),
:mod:`weighbridge.loadgen.plan` (schedules and request sizes), :mod:`weighbridge.loadgen.sessions`
(multi-turn sessions), :mod:`weighbridge.loadgen.trace` (traces made into plans),
:mod:`weighbridge.loadgen.bodies` (request bodies), :mod:`weighbridge.loadgen.measure` (the
streaming measurement), :mod:`weighbridge.loadgen.lag` (the generator's schedule lag). Shells:
:mod:`weighbridge.loadgen.client` (geventhttpclient), :mod:`weighbridge.loadgen.driver`
(greenlets), :mod:`weighbridge.loadgen.locust_plugin` (Locust). Run it with ``locust -f
scenarios/`` (docs/loadgen.md).

The surface (``__all__``) is what the application and the other parts use, all from the pure
parts: scenarios and workloads, the plans and sessions the simulator's clients replay, traces,
request bodies and the streaming measurement. Each name is read from its module on first use
(``weighbridge.surface``), so importing one module loads neither gevent nor Locust.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weighbridge.surface import surface

if TYPE_CHECKING:
    from weighbridge.loadgen.arrivals import Closed, Poisson
    from weighbridge.loadgen.bodies import message_token_ids, prompt_token_ids
    from weighbridge.loadgen.lengths import Lengths
    from weighbridge.loadgen.measure import StreamMeter
    from weighbridge.loadgen.plan import (
        RequestPlan,
        closed_request_id,
        closed_users,
        open_loop_schedule,
        open_request_id,
        plan_request,
    )
    from weighbridge.loadgen.scenario import (
        PhaseSpan,
        Scenario,
        ScenarioError,
        Workload,
        discover_scenarios,
        load_scenario,
    )
    from weighbridge.loadgen.sessions import Answer, Session, first_turn, next_turn, sessions_of
    from weighbridge.loadgen.tenants import TenantSpec
    from weighbridge.loadgen.trace import (
        TenantRule,
        TraceError,
        TraceRows,
        read_trace_rows,
        trace_plans,
    )
else:
    __getattr__, __dir__ = surface(__name__, {
        "arrivals": ("Closed", "Poisson"),
        "bodies": ("message_token_ids", "prompt_token_ids"),
        "lengths": ("Lengths",),
        "measure": ("StreamMeter",),
        "plan": ("RequestPlan", "closed_request_id", "closed_users", "open_loop_schedule",
                 "open_request_id", "plan_request"),
        "scenario": ("PhaseSpan", "Scenario", "ScenarioError", "Workload", "discover_scenarios",
                     "load_scenario"),
        "sessions": ("Answer", "Session", "first_turn", "next_turn", "sessions_of"),
        "tenants": ("TenantSpec",),
        "trace": ("TenantRule", "TraceError", "TraceRows", "read_trace_rows", "trace_plans"),
    })

__all__ = [
    "Answer",
    "Closed",
    "Lengths",
    "PhaseSpan",
    "Poisson",
    "RequestPlan",
    "Scenario",
    "ScenarioError",
    "Session",
    "StreamMeter",
    "TenantRule",
    "TenantSpec",
    "TraceError",
    "TraceRows",
    "Workload",
    "closed_request_id",
    "closed_users",
    "discover_scenarios",
    "first_turn",
    "load_scenario",
    "message_token_ids",
    "next_turn",
    "open_loop_schedule",
    "open_request_id",
    "plan_request",
    "prompt_token_ids",
    "read_trace_rows",
    "sessions_of",
    "trace_plans",
]
