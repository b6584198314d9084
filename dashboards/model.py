"""The slice of Grafana's dashboard model weighbridge uses, as frozen dataclasses that render
to Grafana 10+ JSON (schemaVersion 39).

Every panel and query reads its Prometheus data source from the ``${datasource}`` template
variable, so one JSON file works after provisioning, import or ``weighbridge dashboards push``
against whatever Prometheus the Grafana instance has. Panel positions are computed from the
order of rows and panels, never written by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "DATASOURCE",
    "GRID_WIDTH",
    "SCHEMA_VERSION",
    "Custom",
    "Dashboard",
    "DatasourceVariable",
    "LabelVariable",
    "Panel",
    "Query",
    "Row",
    "Threshold",
    "Variable",
]

SCHEMA_VERSION = 39
GRID_WIDTH = 24  # Grafana's grid is 24 columns wide
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

PanelType = Literal["timeseries", "stat"]


@dataclass(frozen=True)
class Query:
    """One PromQL query of a panel; ``legend`` is Grafana's legend format (``{{tenant}}``)."""

    expr: str
    legend: str = ""
    instant: bool = False

    def to_json(self, ref_id: str) -> dict[str, Any]:
        return {
            "datasource": DATASOURCE,
            "editorMode": "code",
            "expr": self.expr,
            "instant": self.instant,
            "legendFormat": self.legend or "__auto",
            "range": not self.instant,
            "refId": ref_id,
        }


@dataclass(frozen=True)
class Threshold:
    """A reference line (timeseries) or colour step (stat) at ``value``."""

    value: float
    color: str = "red"


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    unit: str  # a Grafana unit id: s, percentunit, reqps, short, none, "suffix: tok/s"
    queries: tuple[Query, ...]
    type: PanelType = "timeseries"
    width: int = 12
    height: int = 8
    thresholds: tuple[Threshold, ...] = ()
    min: float | None = None
    max: float | None = None
    decimals: int | None = None
    mappings: tuple[tuple[str, str, str], ...] = ()  # (value, text, color) for stat panels
    stack: bool = False

    def __post_init__(self) -> None:
        if not self.queries:
            raise ValueError(f"panel {self.title!r}: needs at least one query")
        if not 1 <= self.width <= GRID_WIDTH:
            raise ValueError(f"panel {self.title!r}: width must be 1-{GRID_WIDTH}")

    def to_json(self, panel_id: int, x: int, y: int) -> dict[str, Any]:
        defaults: dict[str, Any] = {"unit": self.unit, "color": {"mode": "palette-classic"}}
        for key in ("min", "max", "decimals"):
            if getattr(self, key) is not None:
                defaults[key] = getattr(self, key)
        steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
        steps += [{"color": t.color, "value": t.value} for t in self.thresholds]
        defaults["thresholds"] = {"mode": "absolute", "steps": steps}
        if self.type == "timeseries":
            defaults["custom"] = {
                "drawStyle": "line",
                "lineWidth": 1,
                "fillOpacity": 10 if self.stack else 0,
                "showPoints": "never",
                "spanNulls": False,
                "stacking": {"mode": "normal" if self.stack else "none", "group": "A"},
                "thresholdsStyle": {"mode": "dashed" if self.thresholds else "off"},
            }
            options: dict[str, Any] = {
                "legend": {"displayMode": "table", "placement": "bottom", "showLegend": True,
                           "calcs": ["lastNotNull", "max"]},
                "tooltip": {"mode": "multi", "sort": "desc"},
            }
        else:
            defaults["color"] = {"mode": "thresholds"}
            options = {
                "colorMode": "background",
                "graphMode": "none",
                "justifyMode": "auto",
                "orientation": "auto",
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "textMode": "value_and_name",
            }
        if self.mappings:
            defaults["mappings"] = [{
                "type": "value",
                "options": {value: {"text": text, "color": color, "index": i}
                            for i, (value, text, color) in enumerate(self.mappings)},
            }]
        else:
            defaults["mappings"] = []
        return {
            "id": panel_id,
            "type": self.type,
            "title": self.title,
            "description": self.description,
            "datasource": DATASOURCE,
            "gridPos": {"h": self.height, "w": self.width, "x": x, "y": y},
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": options,
            "targets": [q.to_json(_ref_id(i)) for i, q in enumerate(self.queries)],
        }


def _ref_id(index: int) -> str:
    return chr(ord("A") + index) if index < 26 else f"Q{index}"


@dataclass(frozen=True)
class Row:
    """A collapsible heading followed by its panels, laid out left to right."""

    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class DatasourceVariable:
    name: str = "datasource"
    label: str = "Data source"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "label": self.label, "type": "datasource",
                "query": "prometheus", "current": {}, "hide": 0, "includeAll": False,
                "multi": False, "options": [], "refresh": 1, "regex": "",
                "skipUrlSync": False}


@dataclass(frozen=True)
class LabelVariable:
    """Values of ``label`` on the series ``selector`` selects; multi-select with an All that
    is the regex ``.*`` (which also matches series without the label)."""

    name: str
    label: str
    selector: str

    @property
    def definition(self) -> str:
        return f"label_values({self.selector}, {self.name})"

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "label": self.label, "type": "query",
                "datasource": DATASOURCE, "definition": self.definition,
                "query": {"query": self.definition, "refId": "PrometheusVariableQueryEditor"},
                "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
                "hide": 0, "includeAll": True, "allValue": ".*", "multi": True,
                "options": [], "refresh": 2, "regex": "", "sort": 1, "skipUrlSync": False}


@dataclass(frozen=True)
class Custom:
    """A fixed list of ``(text, value)`` choices, the first one selected."""

    name: str
    label: str
    choices: tuple[tuple[str, str], ...]
    description: str = ""

    def to_json(self) -> dict[str, Any]:
        options = [{"selected": i == 0, "text": text, "value": value}
                   for i, (text, value) in enumerate(self.choices)]
        text, value = self.choices[0]
        return {"name": self.name, "label": self.label, "type": "custom",
                "description": self.description,
                "query": ",".join(f"{t} : {v}" for t, v in self.choices),
                "current": {"selected": True, "text": text, "value": value},
                "options": options, "hide": 0, "includeAll": False, "multi": False,
                "skipUrlSync": False}

    @property
    def default(self) -> str:
        return self.choices[0][1]


Variable = DatasourceVariable | LabelVariable | Custom


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    variables: tuple[Variable, ...]
    rows: tuple[Row, ...]
    tags: tuple[str, ...] = ("weighbridge",)
    refresh: str = "10s"
    time_from: str = "now-30m"

    def panels(self) -> list[Panel]:
        return [panel for row in self.rows for panel in row.panels]

    def queries(self) -> list[tuple[Panel, Query]]:
        return [(panel, query) for panel in self.panels() for query in panel.queries]

    def to_json(self) -> dict[str, Any]:
        panels: list[dict[str, Any]] = []
        next_id, y = 1, 0
        for row in self.rows:
            panels.append({"id": next_id, "type": "row", "title": row.title, "collapsed": False,
                           "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y}, "panels": []})
            next_id += 1
            y += 1
            x, line_height = 0, 0
            for panel in row.panels:
                if x + panel.width > GRID_WIDTH:
                    x, y, line_height = 0, y + line_height, 0
                panels.append(panel.to_json(next_id, x, y))
                next_id += 1
                x += panel.width
                line_height = max(line_height, panel.height)
            y += line_height
        return {
            "uid": self.uid,
            "title": self.title,
            "description": self.description,
            "tags": list(self.tags),
            "editable": True,
            "graphTooltip": 1,  # shared crosshair: compare panels at one instant
            "schemaVersion": SCHEMA_VERSION,
            "version": 1,
            "refresh": self.refresh,
            "time": {"from": self.time_from, "to": "now"},
            "timepicker": {},
            "timezone": "browser",
            "fiscalYearStartMonth": 0,
            "liveNow": False,
            "weekStart": "",
            "annotations": {"list": [{
                "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                "name": "Annotations & Alerts", "type": "dashboard"}]},
            "links": [{"type": "dashboards", "tags": ["weighbridge"], "asDropdown": True,
                       "title": "weighbridge", "includeVars": True, "keepTime": True}],
            "templating": {"list": [v.to_json() for v in self.variables]},
            "panels": panels,
        }
