"""The served API description (sidecar/openapi.py): the deadline header's grammar is the
file's and admits only positive finite numbers; the tier header names the configured tiers."""

from __future__ import annotations

import math
import re
from pathlib import Path

import yaml
from hypothesis import given
from hypothesis import strategies as st

from weighbridge.sidecar.openapi import DEADLINE_MS, description

FILE = yaml.safe_load(
    (Path(__file__).resolve().parents[3] / "sidecar/openapi.yaml").read_text())


def test_the_file_states_the_deadline_grammar_the_handler_checks() -> None:
    schema = FILE["components"]["parameters"]["DeadlineMs"]["schema"]
    assert schema["pattern"] == f"^{DEADLINE_MS.pattern}$"


@given(st.from_regex(DEADLINE_MS, fullmatch=True))
def test_every_deadline_the_grammar_admits_is_a_positive_finite_number(text: str) -> None:
    value = float(text)
    assert math.isfinite(value) and value > 0


@given(st.one_of(st.floats(max_value=0), st.sampled_from(["inf", "nan", "1e999", "1_000",
                                                            "0x10", "-1", "+1", "", " "])))
def test_zero_negative_and_non_decimal_values_are_not_admitted(value: float | str) -> None:
    text = value if isinstance(value, str) else repr(value)
    assert DEADLINE_MS.fullmatch(text) is None


def test_the_tier_header_names_the_configured_tiers_with_the_spaces_the_sidecar_ignores(
        ) -> None:
    spec = description(["gold", "bulk.v2"])
    header = spec["components"]["parameters"]["Tier"]
    pattern = re.compile(header["schema"]["pattern"])
    for value in ("gold", " bulk.v2 ", "bulk.v2"):
        assert pattern.search(value), value
    for value in ("", " ", "bulkXv2", "gold2", "standard"):
        assert not pattern.search(value), value
    assert "gold" in header["description"] and "bulk.v2" in header["description"]
    # The file itself is left as it is.
    assert FILE["components"]["parameters"]["Tier"]["schema"]["pattern"] == "\\S"
