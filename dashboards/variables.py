"""The template variables every weighbridge dashboard shares, and the label matchers panels
use to honour them.

Tenant and tier values come from the sidecar's ledger and the load generator's request
counter, so the variables fill in whether Prometheus scrapes one, the other or both. The
SLO choices are bucket bounds that the sidecar's and the load generator's latency
histograms both have (``le`` must match a bucket exactly), spelt as prometheus_client
writes them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from weighbridge.dashboards.model import Custom, DatasourceVariable, LabelVariable, Variable

__all__ = [
    "BACKEND",
    "BACKEND_MATCH",
    "DATASOURCE",
    "E2E_SLO",
    "STANDARD",
    "TENANT",
    "TENANT_MATCH",
    "TENANT_TIER",
    "TIER",
    "TIER_MATCH",
    "TTFT_SLO",
    "WINDOW",
    "interpolate",
    "references",
]

_TRAFFIC = '{__name__=~"weighbridge_requests_arrived_total|weighbridge_client_requests_total"}'

DATASOURCE = DatasourceVariable()
TENANT = LabelVariable("tenant", "Tenant", _TRAFFIC)
TIER = LabelVariable("tier", "Tier", _TRAFFIC)
BACKEND = LabelVariable("backend", "Backend", "weighbridge_backend_healthy")
TTFT_SLO = Custom(
    "ttft_slo", "TTFT SLO",
    (("500 ms", "0.5"), ("100 ms", "0.1"), ("250 ms", "0.25"), ("750 ms", "0.75"),
     ("1 s", "1.0"), ("1.5 s", "1.5"), ("5 s", "5.0")),
    "Time-to-first-token target of the interactive tier (tiers.*.ttft_slo_ms in the "
    "sidecar's configuration)")
E2E_SLO = Custom(
    "e2e_slo", "E2E SLO",
    (("10 s", "10.0"), ("5 s", "5.0"), ("15 s", "15.0"), ("30 s", "30.0"), ("60 s", "60.0")),
    "End-to-end target of the standard tier (tiers.*.e2e_slo_ms)")

STANDARD: tuple[Variable, ...] = (DATASOURCE, TENANT, TIER, BACKEND)

# Label matchers, to splice into selectors: {TENANT_TIER} -> tenant=~"$tenant", tier=~"$tier"
TENANT_MATCH = 'tenant=~"$tenant"'
TIER_MATCH = 'tier=~"$tier"'
TENANT_TIER = f"{TENANT_MATCH}, {TIER_MATCH}"
BACKEND_MATCH = 'backend=~"$backend"'
# Grafana's rate window: at least four scrape intervals, wider when zoomed out.
WINDOW = "$__rate_interval"


def interpolate(expr: str, values: Mapping[str, str]) -> str:
    """``expr`` with each ``$name`` / ``${name}`` replaced by ``values[name]``, as Grafana
    does before it sends a query (for a regex matcher, a multi-value selection is already
    ``(a|b)``). A variable not in ``values`` raises KeyError: it would reach Prometheus
    verbatim and fail there."""

    def replace(match: re.Match[str]) -> str:
        return values[match.group(1) or match.group(2)]

    return _REFERENCE.sub(replace, expr)


def references(expr: str) -> set[str]:
    """The variable names ``expr`` uses."""
    return {a or b for a, b in _REFERENCE.findall(expr)}


_REFERENCE = re.compile(r"\$\{(\w+)\}|\$(\w+)")
