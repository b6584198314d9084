"""Tiers & SLOs: does the interactive tier keep its latency target while others flood?

SLO attainment and goodput read the latency histograms at the bucket bound the ``ttft_slo``
/ ``e2e_slo`` variables select: the share of requests at or under it, exactly, without
interpolation.
"""

from __future__ import annotations

from weighbridge.dashboards.model import Dashboard, Panel, Query, Row, Threshold
from weighbridge.dashboards.promql import by, quantile, rate
from weighbridge.dashboards.variables import E2E_SLO, STANDARD, TENANT_TIER, TIER_MATCH, TTFT_SLO

__all__ = ["TIERS"]

_SIDECAR_TTFT = "weighbridge_time_to_first_token_seconds"
_CLIENT_TTFT = "weighbridge_client_ttft_seconds"


def _within(histogram: str, slo_variable: str, labels: str = "tier") -> str:
    """Share of the observations at or under the SLO bucket bound, per ``labels``."""
    inside = by(labels, rate(f"{histogram}_bucket", f'{TENANT_TIER}, le="${slo_variable}"'))
    total = by(labels, rate(f"{histogram}_count", TENANT_TIER))
    return f"{inside} / ({total} > 0)"


TTFT = Panel(
    "TTFT p50 / p99 by tier against the SLO",
    "Time to first token at the sidecar per tier, the client's p99, and the SLO line "
    "(variable ttft_slo).",
    "s",
    (Query(quantile(0.5, _SIDECAR_TTFT, "tier", TENANT_TIER), "{{tier}} p50"),
     Query(quantile(0.99, _SIDECAR_TTFT, "tier", TENANT_TIER), "{{tier}} p99"),
     Query(quantile(0.99, _CLIENT_TTFT, "tier", TENANT_TIER), "{{tier}} p99 (client)"),
     Query("vector($ttft_slo)", "SLO")),
    width=24, min=0)

TTFT_ATTAINMENT = Panel(
    "TTFT SLO attainment",
    "Share of first tokens within the TTFT SLO per tier, at the sidecar and at the client.",
    "percentunit",
    (Query(_within(_SIDECAR_TTFT, "ttft_slo"), "{{tier}}"),
     Query(_within(_CLIENT_TTFT, "ttft_slo"), "{{tier}} (client)")),
    min=0, max=1, thresholds=(Threshold(0.99, "green"),))

ATTAINMENT_NOW = Panel(
    "TTFT SLO attainment over the time range",
    "Share of first tokens within the TTFT SLO over the whole selected range, per tier.",
    "percentunit",
    (Query(f"sum by (tier) (increase({_SIDECAR_TTFT}_bucket{{{TENANT_TIER}, "
           f'le="$ttft_slo"}}[$__range])) / (sum by (tier) (increase({_SIDECAR_TTFT}_count'
           f"{{{TENANT_TIER}}}[$__range])) > 0)", "{{tier}}", instant=True),),
    type="stat", width=6, decimals=1,
    thresholds=(Threshold(0.0, "red"), Threshold(0.95, "orange"), Threshold(0.99, "green")))

E2E_ATTAINMENT = Panel(
    "End-to-end SLO attainment",
    "Share of requests that ended (completed, cancelled or failed) within the E2E SLO "
    "(variable e2e_slo) after arriving at the sidecar, and of the client's ok requests "
    "after their scheduled send time.",
    "percentunit",
    (Query(_within("weighbridge_request_duration_seconds", "e2e_slo"), "{{tier}}"),
     Query(_within("weighbridge_client_e2e_seconds", "e2e_slo"), "{{tier}} (client)")),
    width=6, min=0, max=1)

GOODPUT = Panel(
    "Goodput",
    "Requests per second whose first token came within the TTFT SLO, against all "
    "completions per tier; and tokens per second served to each tier.",
    "reqps",
    (Query(by("tier", rate(f"{_SIDECAR_TTFT}_bucket", f'{TENANT_TIER}, le="$ttft_slo"')),
           "{{tier}} within SLO"),
     Query(by("tier", rate("weighbridge_requests_completed_total", TENANT_TIER)),
           "{{tier}} completed")),
    min=0)

TIER_TOKENS = Panel(
    "Tokens served per tier",
    "Prompt + output tokens per second streamed through the sidecar, by tier.",
    "suffix: tok/s",
    (Query(by("tier", f"tenant_tier:weighbridge_tokens_streamed:rate1m{{{TENANT_TIER}}}"),
           "{{tier}}"),),
    stack=True, min=0)

QUEUE_WAIT = Panel(
    "Queue wait p99 by tier",
    "Arrival to dispatch in the sidecar: strict tiers keep the interactive tier's wait short.",
    "s",
    (Query(quantile(0.99, "weighbridge_queue_wait_seconds", "tier", TENANT_TIER),
           "{{tier}} p99"),
     Query(quantile(0.5, "weighbridge_queue_wait_seconds", "tier", TENANT_TIER),
           "{{tier}} p50")),
    min=0)

JAIN = Panel(
    "Jain's fairness index by tier",
    "(Σx)² / (n·Σx²) of the weight-normalised token rates of a tier's active tenants: 1 = "
    "each got its weighted share, 1/n = one took everything.",
    "none",
    (Query(f"tier:weighbridge_jain_index:rate1m{{{TIER_MATCH}}}", "{{tier}} sidecar"),
     Query(f"weighbridge_tier_jain_index{{{TIER_MATCH}}}", "{{tier}} client {{instance}}")),
    min=0, max=1, decimals=3)

TIERS = Dashboard(
    uid="weighbridge-tiers",
    title="weighbridge / Tiers & SLOs",
    description="Tier-1 latency against its SLO, SLO attainment, goodput and fairness per "
                "tier.",
    variables=(*STANDARD, TTFT_SLO, E2E_SLO),
    rows=(
        Row("Latency against the SLO", (TTFT, TTFT_ATTAINMENT, ATTAINMENT_NOW, E2E_ATTAINMENT)),
        Row("Goodput and fairness", (GOODPUT, TIER_TOKENS, QUEUE_WAIT, JAIN)),
    ),
)
