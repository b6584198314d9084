"""The dashboards as Grafana reads them: the committed JSON is what the definitions render,
every panel has a title, a unit and a query, variables resolve, layout is sound, and every
metric and recording rule a query names exists in the exporters' code and the rules files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from weighbridge.app.cli import app
from weighbridge.dashboards.generate import (
    DASHBOARDS,
    JSON_DIR,
    file_name,
    render,
    stale_files,
    write,
)
from weighbridge.dashboards.model import GRID_WIDTH, Dashboard, Panel, Query, Row
from weighbridge.dashboards.variables import STANDARD, interpolate, references

REPO = Path(__file__).resolve().parents[3]
RULES = sorted((REPO / "deploy" / "prometheus" / "rules").glob("*.yml"))
EXPORTER_SOURCES = [REPO / "sidecar" / "metrics.py", REPO / "sidecar" / "reload.py",
                    REPO / "exporters" / "loadgen.py",
                    REPO / "exporters" / "histogram.py", REPO / "emulator" / "metrics.py"]
GRAFANA_BUILTINS = {"__rate_interval", "__range", "__interval"}
PROMQL_WORDS = {"sum", "max", "min", "avg", "by", "on", "ignoring", "group_left", "bool",
                "rate", "increase", "histogram_quantile", "scalar", "vector", "le",
                "clamp_max", "count", "and", "or", "unless", "topk"}


def _committed() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(JSON_DIR.glob("*.json"))}


def test_committed_json_is_what_the_generator_renders() -> None:
    assert stale_files() == [], "run: weighbridge dashboards generate"
    assert set(_committed()) == {file_name(d) for d in DASHBOARDS}


def test_the_four_dashboards_of_the_issue() -> None:
    titles = {d["title"] for d in _committed().values()}
    assert titles == {"weighbridge / Tenants", "weighbridge / Tiers & SLOs",
                      "weighbridge / Backends", "weighbridge / Queueing theory"}


@pytest.mark.parametrize("name", sorted(p.name for p in JSON_DIR.glob("*.json")))
def test_every_panel_has_a_title_a_unit_and_a_query(name: str) -> None:
    board = _committed()[name]
    assert board["schemaVersion"] >= 39
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert panels
    for panel in panels:
        assert panel["title"].strip(), panel
        assert panel["fieldConfig"]["defaults"]["unit"], panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["datasource"]["uid"] == "${datasource}"
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])


@pytest.mark.parametrize("name", sorted(p.name for p in JSON_DIR.glob("*.json")))
def test_variables_datasource_tenant_tier_backend(name: str) -> None:
    board = _committed()[name]
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert {"datasource", "tenant", "tier", "backend"} <= set(variables)
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for label in ("tenant", "tier", "backend"):
        assert variables[label]["includeAll"] and variables[label]["allValue"] == ".*"
        assert variables[label]["datasource"]["uid"] == "${datasource}"
    # Every $reference in a query is a variable of this dashboard or one of Grafana's own.
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            unknown = references(target["expr"]) - set(variables) - GRAFANA_BUILTINS
            assert not unknown, (panel["title"], unknown)


@pytest.mark.parametrize("name", sorted(p.name for p in JSON_DIR.glob("*.json")))
def test_panel_ids_are_unique_and_the_grid_does_not_overlap(name: str) -> None:
    panels = _committed()[name]["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    _assert_no_overlap([p["gridPos"] for p in panels])


def _assert_no_overlap(positions: list[dict[str, int]]) -> None:
    cells: set[tuple[int, int]] = set()
    for pos in positions:
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= GRID_WIDTH, pos
        mine = {(pos["x"] + dx, pos["y"] + dy) for dx in range(pos["w"]) for dy in range(pos["h"])}
        assert not cells & mine, pos
        cells |= mine


def test_uids_are_unique_and_stable() -> None:
    uids = [d.uid for d in DASHBOARDS]
    assert len(set(uids)) == len(uids)
    assert all(re.fullmatch(r"[a-z0-9-]{1,40}", uid) for uid in uids)


# ----------------------------------------------------------------------------- names


def _names(expr: str) -> set[str]:
    """Metric and recording-rule names in a PromQL expression (labels, functions and
    template variables removed)."""
    expr = re.sub(r"\{[^}]*\}", "", expr)  # matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    expr = re.sub(r"\$\w+|\$\{\w+\}", "", expr)
    # label lists: by (...), on (...), ignoring (...), group_left (...)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    tokens = set(re.findall(r"[a-zA-Z_][a-zA-Z0-9_:]*", expr))
    return {t for t in tokens if t not in PROMQL_WORDS}


def _recorded() -> set[str]:
    names = set()
    for path in RULES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            names |= {rule["record"] for rule in group["rules"] if "record" in rule}
    return names


def _exported_source() -> str:
    return "\n".join(p.read_text() for p in EXPORTER_SOURCES)


def _base(name: str) -> str:
    for suffix in ("_bucket", "_count", "_sum", "_total"):
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def test_every_name_a_query_uses_is_exported_or_recorded() -> None:
    recorded, source = _recorded(), _exported_source()
    missing, checked = [], set()
    for dashboard in DASHBOARDS:
        for panel, query in dashboard.queries():
            for name in _names(query.expr):
                checked.add(name)
                if name.startswith("vllm:"):
                    # vLLM's names; the emulator builds them from the part after the prefix.
                    found = _base(name.removeprefix("vllm:")) in source
                elif ":" in name or name in recorded:
                    found = name in recorded
                else:
                    found = f'"{_base(name)}"' in source or f'"{name}"' in source
                if not found:
                    missing.append((dashboard.title, panel.title, name))
    assert not missing
    assert len(checked) >= 50  # the parser found the names (guards a vacuous pass)


def test_names_parser() -> None:
    expr = ('sum by (tenant, le) (rate(weighbridge_x_bucket{tenant=~"$tenant"}[$__rate_interval]))'
            ' / on (job) group_left () job:weighbridge_y:rate1m > bool 0')
    assert _names(expr) == {"weighbridge_x_bucket", "job:weighbridge_y:rate1m"}


# ----------------------------------------------------------------------------- variables


def test_interpolate_replaces_both_spellings_and_rejects_unknown_names() -> None:
    assert interpolate('x{a=~"$tenant", b="${tier}"}[$__range]',
                       {"tenant": ".*", "tier": "t1", "__range": "5m"}) == \
        'x{a=~".*", b="t1"}[5m]'
    with pytest.raises(KeyError):
        interpolate("$nope", {})


def test_every_query_interpolates_with_the_standard_and_slo_variables() -> None:
    values = {v.name: ".*" for v in STANDARD} | {"ttft_slo": "0.5", "e2e_slo": "10.0",
                                                 "__rate_interval": "1m", "__range": "5m"}
    for dashboard in DASHBOARDS:
        for _, query in dashboard.queries():
            assert "$" not in interpolate(query.expr, values)


# ----------------------------------------------------------------------------- layout


@given(st.lists(st.lists(st.tuples(st.integers(1, GRID_WIDTH), st.integers(1, 12)),
                         min_size=1, max_size=8), min_size=1, max_size=4))
def test_layout_never_overlaps_and_ids_are_unique(rows: list[list[tuple[int, int]]]) -> None:
    board = Dashboard("u", "t", "d", STANDARD, tuple(
        Row(f"row {i}", tuple(Panel(f"p{i}-{j}", "", "short", (Query("up"),), width=w,
                                    height=h) for j, (w, h) in enumerate(row)))
        for i, row in enumerate(rows)))
    panels = board.to_json()["panels"]
    assert len(panels) == sum(len(r) for r in rows) + len(rows)
    assert [p["id"] for p in panels] == list(range(1, len(panels) + 1))
    _assert_no_overlap([p["gridPos"] for p in panels])
    # Rows come in order, each above its own panels.
    ys = [p["gridPos"]["y"] for p in panels]
    assert ys == sorted(ys)


def test_a_panel_needs_a_query() -> None:
    with pytest.raises(ValueError, match="query"):
        Panel("empty", "", "short", ())


# ----------------------------------------------------------------------------- CLI


def test_cli_generate_writes_and_checks(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["dashboards", "generate", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.glob("*.json")) == sorted(
        file_name(d) for d in DASHBOARDS)
    assert (tmp_path / "tenants.json").read_text() == render(DASHBOARDS[0])
    assert runner.invoke(app, ["dashboards", "generate", "--out", str(tmp_path),
                               "--check"]).exit_code == 0
    (tmp_path / "tiers.json").write_text("{}")
    result = runner.invoke(app, ["dashboards", "generate", "--out", str(tmp_path), "--check"])
    assert result.exit_code == 1
    assert "tiers.json" in result.output


def test_write_is_deterministic(tmp_path: Path) -> None:
    first = {p.name: p.read_bytes() for p in write(tmp_path / "a")}
    second = {p.name: p.read_bytes() for p in write(tmp_path / "b")}
    assert first == second
