"""report.html opened as a person opens it: headless Chromium, a 1400x900 window, a file URL.

Issue 18's browser test: the headline and the first plot are inside the first viewport; the
page logs no console error; the interactive plots work offline (nothing is fetched but the
file itself and inline data, the charts render, a click on a legend entry hides that line,
hovering a point shows its values).
"""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from tests.integration.analysis.chromium import open_page
from tests.support.records import flood_run
from weighbridge.app.cli import app

VIEWPORT = (1400, 900)

# Resolves once bokeh has built every chart's view: the number of charts.
CHARTS_READY = """new Promise((done) => {
  const check = () => {
    const figures = window.Bokeh ? Bokeh.documents.flatMap((d) => d.roots()) : [];
    if (figures.length && figures.every((f) => Bokeh.index.find_one(f))) {
      done(figures.length);
    } else {
      setTimeout(check, 20);
    }
  };
  check();
})"""

BOX = "JSON.stringify(document.querySelector({selector!r}).getBoundingClientRect())"

FIGURE = """const fig = Bokeh.documents.flatMap((d) => d.roots()).find((f) => f.name == key);
  const view = Bokeh.index.find_one(fig);"""

# A chart's legend entries (page boxes) and whether each entry's lines are visible.
LEGEND = "((key) => {" + FIGURE + """
  const legend = [...fig.right, ...fig.center].find((m) => m.type == 'Legend');
  const entries = view.views.find_one(legend).entries;
  return JSON.stringify({
    boxes: entries.map((e) => e.el.getBoundingClientRect()),
    visible: legend.items.map((item) => item.renderers.map((r) => r.visible))});
})"""

# The page coordinates of a chart's last line's first point, and that line's name.
POINT = "((key) => {" + FIGURE + """
  const line = fig.renderers[fig.renderers.length - 1];
  const data = line.data_source.data;
  const i = data.y.findIndex((v) => Number.isFinite(v));
  const canvas = view.canvas_view.el.getBoundingClientRect();
  return JSON.stringify({x: canvas.left + view.frame.x_scale.compute(data.x[i]),
                         y: canvas.top + view.frame.y_scale.compute(data.y[i]),
                         name: data.name[i]});
})"""

TOOLTIP = """new Promise((done) => {
  function* walk(root) {
    for (const el of root.querySelectorAll('*')) {
      yield el;
      if (el.shadowRoot) yield* walk(el.shadowRoot);
    }
  }
  const check = () => {
    const values = [...walk(document)]
      .filter((el) => el.classList.contains('bk-tooltip-row-value'))
      .map((el) => el.textContent.trim());
    if (values.length) done(values); else setTimeout(check, 20);
  };
  check();
})"""


def _call(function: str, key: str) -> str:
    return f"{function}({json.dumps(key)})"


async def check_report_page(html: Path, tmp_path: Path, first_chart: str) -> Path:
    """Every browser check of issue 18 on one report.html; returns the first screen's
    screenshot."""
    width, height = VIEWPORT
    async with open_page(tmp_path / "chromium-profile", width, height) as page:
        await page.navigate(html.as_uri())
        assert await page.evaluate(CHARTS_READY) >= 4

        # The answer and the first plot without scrolling.
        for selector in ("#headline", f"#chart-{first_chart}"):
            box = json.loads(await page.evaluate(BOX.format(selector=selector)))
            assert box["height"] > 0, selector
            assert box["top"] >= 0 and box["bottom"] <= height, (selector, box)
            assert box["left"] >= 0 and box["right"] <= width, (selector, box)
        shot = tmp_path / "first-screen.png"  # what a reader sees first, untouched
        await page.screenshot(shot)

        # A click on the first legend entry hides its line; a second click shows it again.
        legend = json.loads(await page.evaluate(_call(LEGEND, first_chart)))
        assert all(all(v) for v in legend["visible"])
        entry = legend["boxes"][0]
        for expected in (False, True):
            await page.click(entry["x"] + entry["width"] / 2, entry["y"] + entry["height"] / 2)
            after = json.loads(await page.evaluate(_call(LEGEND, first_chart)))
            assert after["visible"][0] == [expected] * len(after["visible"][0])
            assert all(all(v) for v in after["visible"][1:])

        # Hovering a point shows its line's name and values.
        point = json.loads(await page.evaluate(_call(POINT, first_chart)))
        await page.hover(point["x"], point["y"])
        assert point["name"] in await page.evaluate(TOOLTIP)

        assert page.console_errors == []
        # Offline: the page asked for nothing but itself and inline data.
        assert [u for u in page.requests
                if not u.startswith(("data:", html.as_uri()))] == []
    return shot


async def test_report_with_a_baseline_in_chromium(tmp_path: Path) -> None:
    this = flood_run(tmp_path / "wb", flood_ttft=0.075, run_id="wb")
    base = flood_run(tmp_path / "fifo", flood_ttft=2.15, run_id="fifo")
    out = tmp_path / "report"
    result = CliRunner().invoke(app, ["report", str(this), "--baseline", str(base),
                                      "--out", str(out), "--window", "2s", "--format", "html",
                                      "--check", "isolation.flood_over_quiet<=2"])
    assert result.exit_code == 0, result.output
    shot = await check_report_page(out / "report.html", tmp_path, "victim-ttft")
    assert shot.read_bytes()[:4] == b"\x89PNG"
