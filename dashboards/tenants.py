"""Tenants: does every tenant get its share of tokens, and what does each experience?

Shares come from two vantage points: the sidecar (tokens as they stream through it) and the
load generator (tokens from usage of the requests it saw end). Latency is the sidecar's
(arrival to first relayed token) and the client's (scheduled send to first token, the
user's view); for agent programs, the client's program completion time (what the person who
started one waits for) and how programs end.
"""

from __future__ import annotations

from weighbridge.dashboards.model import Dashboard, Panel, Query, Row, Threshold
from weighbridge.dashboards.promql import by, quantile, rate, selector
from weighbridge.dashboards.variables import STANDARD, TENANT_MATCH, TENANT_TIER, TIER_MATCH

__all__ = ["TENANTS"]

# A tenant's weight counts toward the entitled share while the tenant is served.
_SERVED = "sum by (tenant, tier) (tenant_tier:weighbridge_tokens_streamed:rate1m) > bool 0"


def _entitled(match: str) -> str:
    return (f"sum by (tenant) (max by (tenant, tier) ({selector('weighbridge_drr_weight', match)})"
            f" * on (tenant, tier) ({_SERVED}))")


SIDECAR_SHARE = Panel(
    "Token share at the sidecar against entitled share",
    "Each tenant's share of the tokens streamed through the sidecar over 1 m (solid) and its "
    "entitled share: its weight over the weights of the tenants served in the window "
    "(dashed legend 'entitled'). Weighted fair queueing keeps the two together while "
    "tenants are backlogged.",
    "percentunit",
    (Query(f"tenant:weighbridge_token_share:ratio_rate1m{{{TENANT_MATCH}}}",
           "{{tenant}} served"),
     Query(f"{_entitled(TENANT_MATCH)} / scalar(sum({_entitled('')}))",
           "{{tenant}} entitled")),
    min=0, max=1)

CLIENT_SHARE = Panel(
    "Token share seen by the load generator against entitled share",
    "Prompt + output tokens (from usage) of each tenant's requests that ended, as a share of "
    "all, against weight over the weights of the active tenants (load generator's rules).",
    "percentunit",
    (Query(f"tenant:weighbridge_tenant_token_share:rate1m{{{TENANT_MATCH}}}",
           "{{tenant}} served"),
     Query(f"tenant:weighbridge_tenant_entitled_share:1m{{{TENANT_MATCH}}}",
           "{{tenant}} entitled")),
    min=0, max=1)

TOKENS_PER_S = Panel(
    "Tokens served per tenant",
    "Prompt + output tokens per second streamed through the sidecar.",
    "suffix: tok/s",
    (Query(by("tenant", f"tenant_tier:weighbridge_tokens_streamed:rate1m{{{TENANT_TIER}}}"),
           "{{tenant}}"),),
    stack=True)

TTFT_P99 = Panel(
    "TTFT p99 per tenant",
    "99th percentile time to first token: at the sidecar (arrival to first relayed token) "
    "and at the client (scheduled send time to first token, no coordinated omission).",
    "s",
    (Query(quantile(0.99, "weighbridge_time_to_first_token_seconds", "tenant", TENANT_TIER),
           "{{tenant}} sidecar"),
     Query(quantile(0.99, "weighbridge_client_ttft_seconds", "tenant", TENANT_TIER),
           "{{tenant}} client")))

DECODE_TPS = Panel(
    "Per-sequence decode speed",
    "Output tokens per second of each request after its first token, as the client measured "
    "it: median and the slow 10th percentile per tenant.",
    "suffix: tok/s",
    (Query(quantile(0.5, "weighbridge_client_decode_tokens_per_second", "tenant", TENANT_TIER),
           "{{tenant}} p50"),
     Query(quantile(0.1, "weighbridge_client_decode_tokens_per_second", "tenant", TENANT_TIER),
           "{{tenant}} p10")),
    thresholds=(Threshold(7, "orange"),), min=0)

PROGRAM_COMPLETION = Panel(
    "Agent program completion time per tenant",
    "p50 and p90 of the time from an agent program's first call (scheduled) to its last "
    "call's end, tool runs and subagents included: what the person who started it waited. "
    "Programs the load generator saw complete.",
    "s",
    (Query(quantile(0.5, "weighbridge_client_program_seconds", "tenant", TENANT_TIER),
           "{{tenant}} p50"),
     Query(quantile(0.9, "weighbridge_client_program_seconds", "tenant", TENANT_TIER),
           "{{tenant}} p90")),
    min=0)

PROGRAM_OUTCOMES = Panel(
    "Agent programs started and ended",
    "Programs started per second per tenant, and those that ended: completed (the last "
    "call answered) or failed (a call ended otherwise).",
    "short",
    (Query(by("tenant", rate("weighbridge_client_programs_started_total", TENANT_TIER)),
           "{{tenant}} started"),
     Query(by("tenant, outcome", rate("weighbridge_client_programs_total", TENANT_TIER)),
           "{{tenant}} {{outcome}}")),
    min=0)

REJECTIONS = Panel(
    "Rejections by reason",
    "Requests the sidecar turned away per second, by tenant and reason (rate_limited, "
    "queue_full, deadline_unmeetable, unauthorized, invalid_*), and the requests the client "
    "saw rejected.",
    "reqps",
    (Query(by("tenant, reason",
              rate("weighbridge_requests_rejected_total", TENANT_TIER)),
           "{{tenant}} {{reason}}"),
     Query(by("tenant", rate("weighbridge_client_requests_total",
                             f'{TENANT_TIER}, status="rejected"')),
           "{{tenant}} rejected (client)")),
    min=0)

QUEUE_DEPTH = Panel(
    "Queue depth",
    "Requests waiting in the sidecar's queues and in flight at a backend, per tenant.",
    "short",
    (Query(by("tenant", f"weighbridge_requests_queued{{{TENANT_TIER}}}"), "{{tenant}} queued"),
     Query(by("tenant", f"weighbridge_requests_dispatched{{{TENANT_TIER}}}"),
           "{{tenant}} dispatched")),
    min=0)

QUEUED_TOKENS = Panel(
    "Queued tokens",
    "Estimated tokens (prompt + expected output) waiting in each tenant's queues: the "
    "backlog deficit round robin works through.",
    "short",
    (Query(by("tenant", f"weighbridge_queued_tokens{{{TENANT_MATCH}}}"), "{{tenant}}"),),
    min=0)

OUTCOMES = Panel(
    "Request outcomes",
    "Arrivals, completions, cancellations and failures per second at the sidecar.",
    "reqps",
    tuple(Query(by("tenant", rate(f"weighbridge_requests_{kind}_total", TENANT_TIER)),
                f"{{{{tenant}}}} {kind}")
          for kind in ("arrived", "completed", "cancelled", "failed")),
    min=0)

DEFICIT = Panel(
    "Deficit round robin credit",
    "Each tenant's deficit in its tier, in quanta (negative: it has been served ahead of "
    "its share and pays the debt back).",
    "short",
    (Query(f"max by (tenant, tier) (weighbridge_drr_deficit_quanta{{{TENANT_MATCH}, "
           f"{TIER_MATCH}}})", "{{tenant}} ({{tier}})"),))

TENANTS = Dashboard(
    uid="weighbridge-tenants",
    title="weighbridge / Tenants",
    description="Per-tenant token share against entitlement, latency, decode speed, agent "
                "program completion, rejections and queues.",
    variables=STANDARD,
    rows=(
        Row("Fair share", (SIDECAR_SHARE, CLIENT_SHARE, TOKENS_PER_S, DEFICIT)),
        Row("What each tenant experiences", (TTFT_P99, DECODE_TPS, PROGRAM_COMPLETION,
                                             PROGRAM_OUTCOMES)),
        Row("Admission and queues", (REJECTIONS, OUTCOMES, QUEUE_DEPTH, QUEUED_TOKENS)),
    ),
)
