"""The slice of Grafana's dashboard model weighbridge uses, as frozen dataclasses, rendered to
Grafana 10+ JSON (schemaVersion 39) through grafana-foundation-sdk's typed builders.

The dataclasses are the declarative tables the dashboards are written in (and what the
panel-has-data tests read); the SDK owns the JSON model: every field name, enum and default
comes from its builders, none is spelt here. The one thing computed here is the layout:
the SDK's automatic placement lets a panel that does not fit run past the grid's right
edge, so each panel gets its gridPos from ``Dashboard.build``.

Every panel and query reads its Prometheus data source from the ``${datasource}`` template
variable, so one JSON file works after provisioning, import or ``weighbridge dashboards push``
against whatever Prometheus the Grafana instance has. Panel positions are computed from the
order of rows and panels, never written by hand.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from grafana_foundation_sdk.builders import common as common_builder
from grafana_foundation_sdk.builders import dashboard as dashboard_builder
from grafana_foundation_sdk.builders import prometheus as prometheus_builder
from grafana_foundation_sdk.builders import stat as stat_builder
from grafana_foundation_sdk.builders import timeseries as timeseries_builder
from grafana_foundation_sdk.cog import builder as cogbuilder
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as sdk_common
from grafana_foundation_sdk.models import dashboard as sdk
from grafana_foundation_sdk.models import prometheus as sdk_prometheus

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
DATASOURCE = sdk.DataSourceRef(type_val="prometheus", uid="${datasource}")

PanelType = Literal["timeseries", "stat"]


@dataclass(frozen=True)
class Query:
    """One PromQL query of a panel; ``legend`` is Grafana's legend format (``{{tenant}}``)."""

    expr: str
    legend: str = ""
    instant: bool = False

    def build(self, ref_id: str) -> prometheus_builder.Dataquery:
        query = (prometheus_builder.Dataquery().datasource(DATASOURCE).editor_mode(
            sdk_prometheus.QueryEditorMode.CODE).expr(self.expr)
                 .legend_format(self.legend or "__auto").ref_id(ref_id))
        return query.instant() if self.instant else query.range()


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

    def build(self, panel_id: int, x: int, y: int) -> cogbuilder.Builder[sdk.Panel]:
        steps = [sdk.Threshold(None, "green")]
        steps += [sdk.Threshold(t.value, t.color) for t in self.thresholds]
        mappings: list[sdk.ValueMapping] = []
        if self.mappings:
            mappings.append(sdk.ValueMap({
                value: sdk.ValueMappingResult(text=text, color=color, index=i)
                for i, (value, text, color) in enumerate(self.mappings)}))
        panel: timeseries_builder.Panel | stat_builder.Panel
        if self.type == "timeseries":
            panel = (timeseries_builder.Panel()
                     .color_scheme(dashboard_builder.FieldColor().mode(
                         sdk.FieldColorModeId.PALETTE_CLASSIC))
                     .draw_style(sdk_common.GraphDrawStyle.LINE)
                     .line_width(1)
                     .fill_opacity(10 if self.stack else 0)
                     .show_points(sdk_common.VisibilityMode.NEVER)
                     .span_nulls(False)
                     .stacking(common_builder.StackingConfig().mode(
                         sdk_common.StackingMode.NORMAL if self.stack
                         else sdk_common.StackingMode.NONE).group("A"))
                     .thresholds_style(common_builder.GraphThresholdsStyleConfig().mode(
                         sdk_common.GraphThresholdsStyleMode.DASHED if self.thresholds
                         else sdk_common.GraphThresholdsStyleMode.OFF))
                     .legend(common_builder.VizLegendOptions()
                             .display_mode(sdk_common.LegendDisplayMode.TABLE)
                             .placement(sdk_common.LegendPlacement.BOTTOM)
                             .show_legend(True).calcs(["lastNotNull", "max"]))
                     .tooltip(common_builder.VizTooltipOptions()
                              .mode(sdk_common.TooltipDisplayMode.MULTI)
                              .sort(sdk_common.SortOrder.DESCENDING)))
        else:
            panel = (stat_builder.Panel()
                     .color_scheme(dashboard_builder.FieldColor().mode(
                         sdk.FieldColorModeId.THRESHOLDS))
                     .color_mode(sdk_common.BigValueColorMode.BACKGROUND)
                     .graph_mode(sdk_common.BigValueGraphMode.NONE)
                     .justify_mode(sdk_common.BigValueJustifyMode.AUTO)
                     .orientation(sdk_common.VizOrientation.AUTO)
                     .reduce_options(common_builder.ReduceDataOptions()
                                     .calcs(["lastNotNull"]).fields("").values(False))
                     .text_mode(sdk_common.BigValueTextMode.VALUE_AND_NAME))
        panel = (panel.id(panel_id).title(self.title).description(self.description)
                 .datasource(DATASOURCE)
                 .grid_pos(sdk.GridPos(h=self.height, w=self.width, x=x, y=y))
                 .unit(self.unit).mappings(mappings)
                 .thresholds(dashboard_builder.ThresholdsConfig()
                             .mode(sdk.ThresholdsMode.ABSOLUTE).steps(steps))
                 .targets([q.build(_ref_id(i)) for i, q in enumerate(self.queries)]))
        if self.min is not None:
            panel = panel.min(self.min)
        if self.max is not None:
            panel = panel.max(self.max)
        if self.decimals is not None:
            panel = panel.decimals(self.decimals)
        return panel


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

    def build(self) -> dashboard_builder.DatasourceVariable:
        return (dashboard_builder.DatasourceVariable(self.name).label(self.label)
                .type("prometheus").hide(sdk.VariableHide.DONT_HIDE)
                .include_all(False).multi(False).regex(""))


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

    def build(self) -> dashboard_builder.QueryVariable:
        return (dashboard_builder.QueryVariable(self.name).label(self.label)
                .datasource(DATASOURCE)
                .query({"query": self.definition, "refId": "PrometheusVariableQueryEditor"})
                .current(sdk.VariableOption(selected=True, text=["All"], value=["$__all"]))
                .hide(sdk.VariableHide.DONT_HIDE).include_all(True).all_value(".*")
                .multi(True).options([]).refresh(sdk.VariableRefresh.ON_TIME_RANGE_CHANGED)
                .regex("").sort(sdk.VariableSort.ALPHABETICAL_ASC))


@dataclass(frozen=True)
class Custom:
    """A fixed list of ``(text, value)`` choices, the first one selected."""

    name: str
    label: str
    choices: tuple[tuple[str, str], ...]
    description: str = ""

    def build(self) -> dashboard_builder.CustomVariable:
        text, value = self.choices[0]
        return (dashboard_builder.CustomVariable(self.name).label(self.label)
                .description(self.description)
                .values(",".join(f"{t} : {v}" for t, v in self.choices))
                .current(sdk.VariableOption(selected=True, text=text, value=value))
                .options([sdk.VariableOption(selected=i == 0, text=t, value=v)
                          for i, (t, v) in enumerate(self.choices)])
                .hide(sdk.VariableHide.DONT_HIDE).include_all(False).multi(False))

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

    def build(self) -> dashboard_builder.Dashboard:
        board = (dashboard_builder.Dashboard(self.title).uid(self.uid)
                 .description(self.description).tags(list(self.tags)).editable()
                 .tooltip(sdk.DashboardCursorSync.CROSSHAIR)  # compare panels at one instant
                 .version(1).refresh(self.refresh).time(self.time_from, "now")
                 .timezone("browser").fiscal_year_start_month(0).live_now(False)
                 .week_start("")
                 .annotation(dashboard_builder.AnnotationQuery()
                             .name("Annotations & Alerts").built_in(1)
                             .datasource(sdk.DataSourceRef(type_val="grafana",
                                                           uid="-- Grafana --"))
                             .enable(True).hide(True).icon_color("rgba(0, 211, 255, 1)")
                             .type("dashboard"))
                 .link(dashboard_builder.DashboardLink("weighbridge")
                       .type(sdk.DashboardLinkType.DASHBOARDS).tags(["weighbridge"])
                       .as_dropdown(True).include_vars(True).keep_time(True))
                 .variables([v.build() for v in self.variables]))
        next_id, y = 1, 0
        for row in self.rows:
            board = board.with_row(dashboard_builder.Row(row.title).id(next_id).collapsed(False)
                                   .grid_pos(sdk.GridPos(h=1, w=GRID_WIDTH, x=0, y=y)))
            next_id += 1
            y += 1
            x, line_height = 0, 0
            for panel in row.panels:
                if x + panel.width > GRID_WIDTH:
                    x, y, line_height = 0, y + line_height, 0
                board = board.with_panel(panel.build(next_id, x, y))
                next_id += 1
                x += panel.width
                line_height = max(line_height, panel.height)
            y += line_height
        return board

    def to_json(self) -> dict[str, Any]:
        """The dashboard as Grafana's JSON model (what provisioning and the API read)."""
        model = self.build().build()
        model.schema_version = SCHEMA_VERSION
        return json.loads(JSONEncoder().encode(model))
