"""PromQL builders for the shapes the dashboards repeat: rates and histogram quantiles over
Grafana's rate window, with label matchers spliced in."""

from __future__ import annotations

from weighbridge.dashboards.variables import WINDOW

__all__ = ["by", "quantile", "rate", "selector"]


def selector(metric: str, match: str = "") -> str:
    return f"{metric}{{{match}}}" if match else metric


def rate(metric: str, match: str = "", window: str = WINDOW) -> str:
    return f"rate({selector(metric, match)}[{window}])"


def by(labels: str, expr: str, op: str = "sum") -> str:
    """``sum by (labels) (expr)``; ``labels`` empty aggregates everything."""
    return f"{op} by ({labels}) ({expr})" if labels else f"{op}({expr})"


def quantile(q: float, histogram: str, labels: str, match: str = "") -> str:
    """The ``q`` quantile of a classic histogram per ``labels`` over the rate window."""
    group = f"{labels}, le" if labels else "le"
    return (f"histogram_quantile({q}, "
            f"{by(group, rate(histogram + '_bucket', match))})")
