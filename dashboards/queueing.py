"""Queueing theory: is the system stable, and does every request that entered leave?

Little's Law (L = λW) checks the accounting: the time-average number in the system over
the completion rate times the mean time in system is 1 when nothing is lost or counted
twice. The stability margin compares the offered token load with what the engines process:
held above 1, the backlog and every latency grow without bound. Utilisation rho puts the
offered load against the engines' capacity B / t_step (step budget over the time of a full
step): it grows with the load and warns before the backlog does.
"""

from __future__ import annotations

from weighbridge.dashboards.model import Dashboard, Panel, Query, Row, Threshold
from weighbridge.dashboards.promql import by
from weighbridge.dashboards.variables import BACKEND_MATCH, STANDARD, TENANT_MATCH, TENANT_TIER

__all__ = ["QUEUEING"]

LITTLE_RATIO = Panel(
    "Little's Law ratio L / λW",
    "Near 1 when every request that entered is accounted for (over windows much longer than "
    "a request): the sidecar's (requests queued or dispatched) and the load generator's per "
    "tenant, at the request and the declared-token level, and of agent programs (each from "
    "its start to its end; a minute holds few of them, so its edges weigh more).",
    "none",
    (Query("job:weighbridge_sidecar_littles_law_ratio:rate1m", "sidecar {{job}}"),
     Query(f"tenant_level:weighbridge_littles_law_ratio:rate1m{{{TENANT_MATCH}}}",
           "{{tenant}} {{level}} (client)")),
    decimals=3, thresholds=(Threshold(1, "blue"),))

LITTLE_TERMS = Panel(
    "Little's Law terms: L and λW",
    "L: the time-average number of requests (or agent programs) in the system; λW: seconds "
    "spent in it per second by those that ended.",
    "short",
    (Query("job:weighbridge_requests_in_system:rate1m", "sidecar L"),
     Query("job:weighbridge_request_duration_seconds:rate1m", "sidecar λW"),
     Query(f'tenant_level:weighbridge_littles_law_l:rate1m{{{TENANT_MATCH}, level="request"}}',
           "{{tenant}} L (client)"),
     Query(f"tenant_level:weighbridge_littles_law_lambda_w:rate1m{{{TENANT_MATCH}, "
           'level="request"}', "{{tenant}} λW (client)"),
     Query(f'tenant_level:weighbridge_littles_law_l:rate1m{{{TENANT_MATCH}, level="program"}}',
           "{{tenant}} L programs (client)"),
     Query(f"tenant_level:weighbridge_littles_law_lambda_w:rate1m{{{TENANT_MATCH}, "
           'level="program"}', "{{tenant}} λW programs (client)")),
    min=0)

OFFERED_VS_CAPACITY = Panel(
    "Offered token load against capacity",
    "Tokens per second arriving (prompt + expected output) against tokens per second the "
    "healthy backends process (a saturated fleet's throughput is its capacity).",
    "suffix: tok/s",
    (Query("job:weighbridge_offered_tokens:rate1m", "offered (sidecar)"),
     Query("job:weighbridge_backend_processed_tokens:rate1m", "processed by backends"),
     Query("sum(weighbridge_stability_capacity_tokens_per_second)",
           "capacity (sidecar's 10 s window)"),
     Query("weighbridge_offered_tokens_per_second:rate1m", "offered (client)")),
    min=0)

STABILITY = Panel(
    "Stability margin: offered over capacity",
    "Offered token load over processed tokens. About 1 while the system keeps up; above 1 "
    "(and staying there) the backlog grows.",
    "none",
    (Query("job:weighbridge_stability_ratio:rate1m", "sidecar 1m"),
     Query("weighbridge_stability_ratio", "sidecar 10s {{instance}}"),
     Query("weighbridge_offered_token_load_ratio:rate1m", "client 1m")),
    min=0, decimals=2, thresholds=(Threshold(1, "orange"), Threshold(1.1, "red")))

UTILISATION = Panel(
    "Utilisation rho: offered over B / t_step",
    "Offered tokens per second over the engines' capacity, the step budget B over the time "
    "of a full step (learned from their scrapes): per pool (what arrives for the model's "
    "backends, summed over the sidecar's replicas) and per backend (what the sidecar routes "
    "there). It grows with the load; WeighbridgeUtilisationHigh fires on a pool held above "
    "0.9, before the backlog grows. Absent while no step time is known.",
    "none",
    (Query("pool:weighbridge_utilisation_ratio:sum", "pool {{pool}}"),
     Query(f"backend:weighbridge_utilisation_ratio:sum{{{BACKEND_MATCH}}}", "{{backend}}")),
    min=0, decimals=2, thresholds=(Threshold(0.9, "orange"), Threshold(1, "red")))

STEP_TIME = Panel(
    "Full-step time t_step",
    "Each backend's time for a step that fills the step budget (weighbridge_step_budget_"
    "tokens), fitted over the sidecar's 10 s window: the t_step of rho.",
    "s",
    (Query(by("backend", f"weighbridge_backend_step_seconds{{{BACKEND_MATCH}}}", "max"),
           "{{backend}}"),),
    min=0)

INFLIGHT_TOKENS = Panel(
    "In-flight tokens",
    "Prompt + expected remaining output the sidecar has in flight per backend (what "
    "least_tokens routing balances), prompt tokens still prefilling, and the declared "
    "tokens of the load generator's requests in flight per tenant.",
    "short",
    (Query(by("backend", f"weighbridge_backend_outstanding_tokens{{{BACKEND_MATCH}}}"),
           "{{backend}} outstanding"),
     Query(by("backend", f"weighbridge_backend_prefill_tokens{{{BACKEND_MATCH}}}"),
           "{{backend}} prefilling"),
     Query(by("tenant", f"weighbridge_client_in_flight_tokens{{{TENANT_TIER}}}"),
           "{{tenant}} (client)")),
    min=0)

IN_SYSTEM = Panel(
    "Requests in the system",
    "Requests queued or dispatched at the sidecar per tenant, and in flight at the client.",
    "short",
    (Query(f"sum by (tenant) (weighbridge_requests_queued{{{TENANT_TIER}}}) + sum by (tenant) "
           f"(weighbridge_requests_dispatched{{{TENANT_TIER}}})", "{{tenant}} sidecar"),
     Query(by("tenant", f"weighbridge_client_in_flight_requests{{{TENANT_TIER}}}"),
           "{{tenant}} client")),
    min=0, stack=True)

UNACCOUNTED = Panel(
    "Unaccounted requests",
    "Arrived - ended - in system at the sidecar: always 0 (anything else is a ledger bug).",
    "short",
    (Query("sum(job:weighbridge_requests_unaccounted:sum)", "unaccounted", instant=True),),
    type="stat", width=6, height=5,
    thresholds=(Threshold(1, "red"),))

SERVED_RATE = Panel(
    "Measured throughput used for early rejection",
    "Tokens per second the sidecar's wait predictor measured while requests waited: it "
    "divides a tenant's backlog by this to predict waits.",
    "suffix: tok/s",
    (Query("weighbridge_predictor_tokens_per_second", "predictor {{instance}}"),),
    width=6, height=5, min=0)

QUEUEING = Dashboard(
    uid="weighbridge-queueing",
    title="weighbridge / Queueing theory",
    description="Little's Law checks, offered load against capacity (the stability margin), "
                "utilisation rho and in-flight work.",
    variables=STANDARD,
    rows=(
        Row("Stability", (OFFERED_VS_CAPACITY, STABILITY, UTILISATION, STEP_TIME)),
        Row("Little's Law", (LITTLE_RATIO, LITTLE_TERMS)),
        Row("Work in the system", (INFLIGHT_TOKENS, IN_SYSTEM, UNACCOUNTED, SERVED_RATE)),
    ),
)
