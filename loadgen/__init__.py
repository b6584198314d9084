"""weighbridge's Locust load generator: multi-tenant LLM traffic measured per request.

Pure parts (no I/O, seeded): :mod:`weighbridge.loadgen.lengths` (token-length distributions),
:mod:`weighbridge.loadgen.arrivals` (arrival processes), :mod:`weighbridge.loadgen.tenants` (the
tenants file), :mod:`weighbridge.loadgen.scenario` (phases, scenarios),
:mod:`weighbridge.loadgen.plan` (schedules and request sizes), :mod:`weighbridge.loadgen.sessions`
(multi-turn sessions), :mod:`weighbridge.loadgen.programs` (agent programs),
:mod:`weighbridge.loadgen.trace` (traces made into plans and sessions),
:mod:`weighbridge.loadgen.conversations` (requests that follow answers),
:mod:`weighbridge.loadgen.identity` (how a request names its program),
:mod:`weighbridge.loadgen.bodies` (request bodies), :mod:`weighbridge.loadgen.measure` (the
streaming measurement), :mod:`weighbridge.loadgen.lag` (the generator's schedule lag). Shells:
:mod:`weighbridge.loadgen.client` (geventhttpclient), :mod:`weighbridge.loadgen.driver`
(greenlets), :mod:`weighbridge.loadgen.locust_plugin` (Locust). Run it with ``locust -f
scenarios/`` (docs/loadgen.md).

The surface (``__all__``) is what the application and the other parts use, all from the pure
parts: scenarios and workloads, the plans and conversations the simulator's clients replay,
traces, request bodies and headers, and the streaming measurement. Each name is read from
its module on first use (``weighbridge.surface``), so importing one module loads neither
gevent nor Locust.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weighbridge.surface import surface

if TYPE_CHECKING:
    from weighbridge.loadgen.arrivals import Closed, Poisson
    from weighbridge.loadgen.bodies import (
        BodyOptions,
        message_token_ids,
        prompt_fields,
        prompt_token_ids,
        request_fields,
    )
    from weighbridge.loadgen.conversations import Conversation, conversations_of
    from weighbridge.loadgen.identity import request_headers
    from weighbridge.loadgen.lengths import Lengths
    from weighbridge.loadgen.measure import StreamMeter
    from weighbridge.loadgen.plan import (
        Answer,
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
    from weighbridge.loadgen.sessions import Session, first_turn, next_turn, sessions_of
    from weighbridge.loadgen.tenants import TenantSpec
    from weighbridge.loadgen.trace import (
        TenantRule,
        TraceError,
        TraceRows,
        read_trace_rows,
        trace_plans,
        trace_replay,
    )
else:
    __getattr__, __dir__ = surface(__name__, {
        "arrivals": ("Closed", "Poisson"),
        "bodies": ("BodyOptions", "message_token_ids", "prompt_fields", "prompt_token_ids",
                   "request_fields"),
        "conversations": ("Conversation", "conversations_of"),
        "identity": ("request_headers",),
        "lengths": ("Lengths",),
        "measure": ("StreamMeter",),
        "plan": ("Answer", "RequestPlan", "closed_request_id", "closed_users",
                 "open_loop_schedule", "open_request_id", "plan_request"),
        "scenario": ("PhaseSpan", "Scenario", "ScenarioError", "Workload", "discover_scenarios",
                     "load_scenario"),
        "sessions": ("Session", "first_turn", "next_turn", "sessions_of"),
        "tenants": ("TenantSpec",),
        "trace": ("TenantRule", "TraceError", "TraceRows", "read_trace_rows", "trace_plans",
                  "trace_replay"),
    })

__all__ = [
    "Answer",
    "BodyOptions",
    "Closed",
    "Conversation",
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
    "conversations_of",
    "discover_scenarios",
    "first_turn",
    "load_scenario",
    "message_token_ids",
    "next_turn",
    "open_loop_schedule",
    "open_request_id",
    "plan_request",
    "prompt_fields",
    "prompt_token_ids",
    "read_trace_rows",
    "request_fields",
    "request_headers",
    "sessions_of",
    "trace_plans",
    "trace_replay",
]
