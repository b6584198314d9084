"""The sidecar's OpenAPI description as a running sidecar serves it (``GET /openapi.json``,
where vLLM's own server serves its description).

The description is sidecar/openapi.yaml (package data). ``DEADLINE_MS`` is the grammar of
``x-weighbridge-deadline-ms`` that the request handler checks; the file states the same
pattern (tests/unit/sidecar/test_openapi_description.py holds them equal). One thing
depends on the config: which tier names ``x-weighbridge-tier`` accepts. The file can only
say "a tier the config defines" (pattern ``\\S``, and 400 ``unknown_tier`` otherwise); the
served copy narrows the header to the configured names, with the surrounding spaces and
tabs the sidecar ignores, so that a client, a code generator or a fuzzer knows exactly
which values are valid (tests/integration/sidecar/test_openapi_fuzz.py runs schemathesis
against it).
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Iterable
from importlib import resources
from typing import Any

import orjson
import yaml

__all__ = ["DEADLINE_MS", "description", "description_json"]

# A positive, finite decimal number of milliseconds between HTTP's optional spaces and tabs:
# a nonzero digit in the integer part or the fraction, at most 15 digits in each and a
# two-digit exponent, so every match parses to a float above zero and below infinity (no
# "inf", "nan", "1_000", hex or signs).
DEADLINE_MS = re.compile(
    r"[ \t]*(?:0*[1-9][0-9]{0,14}(?:\.[0-9]{0,15})?|0*\.[0-9]{0,14}[1-9][0-9]{0,14})"
    r"(?:[eE][+-]?[0-9]{1,2})?[ \t]*")


@functools.cache
def _file() -> dict[str, Any]:
    text = resources.files(__package__).joinpath("openapi.yaml").read_text(encoding="utf-8")
    loaded: dict[str, Any] = yaml.safe_load(text)
    return loaded


def description(tiers: Iterable[str]) -> dict[str, Any]:
    """sidecar/openapi.yaml with the tier header narrowed to ``tiers``."""
    spec = copy.deepcopy(_file())
    names = sorted(tiers)
    header = spec["components"]["parameters"]["Tier"]
    # The sidecar strips surrounding spaces and tabs (HTTP's optional whitespace; sidecar/
    # app.py); the value is otherwise compared exactly.
    alternatives = "|".join(re.escape(name) for name in names)
    header["schema"] = {"type": "string", "pattern": rf"^[ \t]*(?:{alternatives})[ \t]*$"}
    header["description"] = (f"{header['description'].rstrip()} This sidecar's tiers: "
                              f"{', '.join(names)}.")
    return spec


def description_json(tiers: Iterable[str]) -> bytes:
    return orjson.dumps(description(tiers))
