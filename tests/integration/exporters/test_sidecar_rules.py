"""deploy/prometheus/rules/sidecar.yml's utilisation rules evaluated by Prometheus' own rule
engine (``promtool test rules``): the replicas' rho summed per pool and per backend, and
WeighbridgeUtilisationHigh on a pool's rho averaged over 2m above 0.9 for 1m (issue 41,
point 3; the ramp that chose it is tests/unit/simulation/test_utilisation_ramp.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[3]
RULES = REPO / "deploy" / "prometheus" / "rules" / "sidecar.yml"
POOL = "engine-0,engine-1"
GROUP_ORDER = ["weighbridge-sidecar", "weighbridge-sidecar-alerts"]  # records, then alerts


def promtool_test(tmp_path: Path, tests: list[dict[str, Any]]) -> None:
    """Run ``promtool test rules``; a missing promtool fails the test (it is a CI package)."""
    path = tmp_path / "rules_test.yml"
    # Without an order promtool evaluates the groups of one instant in a random order, and
    # an alert that ran before the recording group saw the last instant's rho (2 runs of 15
    # failed): the figures below are for the rho recorded at the same instant.
    path.write_text(yaml.safe_dump({"rule_files": [str(RULES)], "evaluation_interval": "15s",
                                    "group_eval_order": GROUP_ORDER, "tests": tests},
                                   sort_keys=False))
    result = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def pool_rho(values: str, instance: str = "a") -> dict[str, str]:
    return {"series": f'weighbridge_pool_utilisation_ratio{{job="sidecar",'
                      f'instance="{instance}",pool="{POOL}"}}', "values": values}


def alert_at(at: str, firing: bool, value: float | None = None) -> dict[str, Any]:
    alerts = []
    if firing:
        alerts.append({"exp_labels": {"severity": "warning", "job": "sidecar", "pool": POOL},
                       "exp_annotations": {"summary": f"Pool {POOL} is offered "
                                           f"{value:.4g}% of its capacity B / t_step; at 100 % "
                                           "its backlog grows"}})
    return {"eval_time": at, "alertname": "WeighbridgeUtilisationHigh", "exp_alerts": alerts}


def test_the_replicas_add_up_per_pool_and_per_backend(tmp_path: Path) -> None:
    """Each replica counts its own arrivals against the whole pool's capacity."""
    backend = 'weighbridge_backend_utilisation_ratio{{job="sidecar",instance="{}",' \
              'backend="engine-0"}}'
    promtool_test(tmp_path, [{
        "interval": "15s",
        "input_series": [pool_rho("0.4x10", "a"), pool_rho("0.5x10", "b"),
                         {"series": backend.format("a"), "values": "0.3x10"},
                         {"series": backend.format("b"), "values": "0.25x10"}],
        "promql_expr_test": [
            {"expr": "pool:weighbridge_utilisation_ratio:sum", "eval_time": "1m",
             "exp_samples": [{"labels": f'pool:weighbridge_utilisation_ratio:sum{{job="sidecar",'
                                        f'pool="{POOL}"}}', "value": 0.9}]},
            {"expr": "backend:weighbridge_utilisation_ratio:sum", "eval_time": "1m",
             "exp_samples": [{"labels": 'backend:weighbridge_utilisation_ratio:sum{'
                                        'backend="engine-0",job="sidecar"}', "value": 0.55}]},
        ],
    }])


def test_the_alert_fires_on_rho_held_above_the_threshold(tmp_path: Path) -> None:
    """rho 0.5 for 5 min, then 0.95 (samples every 15 s). The 2-minute average passes 0.9
    once every sample of its window is 0.95: Prometheus 2's window [t - 2m, t] holds nine,
    the last 0.5 at 4m45s leaves it at 7m (eight of 0.95 and that one average exactly 0.9).
    Held for a minute, the alert fires at 8m, not before."""
    promtool_test(tmp_path, [{
        "interval": "15s",
        "input_series": [pool_rho("0.5x19 0.95x60")],
        "alert_rule_test": [alert_at("6m45s", False), alert_at("7m45s", False),
                            alert_at("8m", True, 95)],
    }])


def test_the_alert_stays_quiet_below_the_threshold_and_on_a_short_burst(
        tmp_path: Path) -> None:
    """A steady 0.87 (a pool at 85 % of capacity, as the ramp test reads it) never fires
    it; nor does a 30 s burst to 1.15 over a pool at 0.8 (two samples: the 2-minute average
    tops out at (7 x 0.8 + 2 x 1.15) / 9 = 0.88). Over a pool at 0.87 the same burst would
    (0.94): the average has 0.03 to spare there."""
    quiet = [alert_at(at, False) for at in ("5m", "11m", "12m", "20m")]
    promtool_test(tmp_path, [
        {"interval": "15s", "input_series": [pool_rho("0.87x80")], "alert_rule_test": quiet},
        {"interval": "15s", "input_series": [pool_rho("0.8x39 1.15x1 0.8x40")],
         "promql_expr_test": [
             {"expr": "max_over_time(avg_over_time(pool:weighbridge_utilisation_ratio:sum[2m])"
                      "[20m:15s])", "eval_time": "20m",
              "exp_samples": [{"labels": f'{{job="sidecar",pool="{POOL}"}}',
                               "value": (7 * 0.8 + 2 * 1.15) / 9}]}],
         "alert_rule_test": quiet},
        {"interval": "15s", "input_series": [pool_rho("0.87x39 1.15x1 0.87x40")],
         "alert_rule_test": [alert_at("12m", True, (7 * 0.87 + 2 * 1.15) / 9 * 100)]},
    ])
