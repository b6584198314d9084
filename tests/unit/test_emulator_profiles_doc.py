"""docs/emulator.md's profile tables state what emulator.profiles holds (they drifted once: a
rewrite left the step-time table without rows)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from weighbridge.emulator.profiles import PROFILES

DOC = Path(__file__).resolve().parents[2] / "docs" / "emulator.md"
UNITS = {"ms": 1e-3, "µs": 1e-6, "ns": 1e-9}
STEP_TERMS = ("t_fixed", "t_prefill_token", "t_decode_seq", "t_kv_token", "t_api_serial",
              "t_api_latency")


def seconds(cell: str) -> float:
    number, _, unit = cell.strip().partition(" ")
    return float(number) * UNITS.get(unit, 1.0)


def rows() -> dict[str, list[list[str]]]:
    """Every table row of the doc naming a profile in its first cell, by profile."""
    out: dict[str, list[list[str]]] = {}
    for line in DOC.read_text().splitlines():
        match = re.fullmatch(r"\| `([\w.-]+)` \|(.*)\|", line)
        if match and match.group(1) in PROFILES:
            out.setdefault(match.group(1), []).append(match.group(2).split("|"))
    return out


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_the_step_time_table_states_the_profile(name: str) -> None:
    profile = PROFILES[name]
    (step,) = [r for r in rows()[name] if len(r) == len(STEP_TERMS)]
    for term, cell in zip(STEP_TERMS, step, strict=True):
        assert seconds(cell) == pytest.approx(getattr(profile, term), rel=1e-9), term
    (api,) = [r for r in rows()[name] if len(r) == 3]
    assert seconds(api[0]) == pytest.approx(profile.t_api_token, rel=1e-9)
    assert seconds(api[1]) == pytest.approx(profile.t_api_contended, rel=1e-9)
    assert int(api[2].split("(")[0].replace(",", "")) == profile.kv_bytes_per_token
    (context,) = [r for r in rows()[name] if len(r) == 1]
    assert seconds(context[0]) == pytest.approx(profile.t_prefill_context, rel=1e-9)
