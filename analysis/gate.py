"""``--check`` expressions: ``<dotted path into summary.json> <op> <number>``, parsed without
eval, e.g. ``fairness.jain_index>=0.95`` or ``tiers.interactive.ttft_p99_s <= 0.5``.

Path segments are matched against the keys of summary.json level by level, longest first,
so a tenant or tier name that contains a dot still resolves. A path that names nothing, or a
value that is null (not measured, or unbounded), fails the check with a message saying so.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

OPERATORS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge, "<=": operator.le, "==": operator.eq, ">": operator.gt, "<": operator.lt,
}
_EXPRESSION = re.compile(
    r"^\s*(?P<path>[\w.\-/:@]+)\s*(?P<op>>=|<=|==|>|<)\s*"
    r"(?P<number>[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|[-+]?inf)\s*$")


@dataclass(frozen=True, slots=True)
class Check:
    path: str
    op: str
    number: float

    def __str__(self) -> str:
        return f"{self.path} {self.op} {self.number:g}"


@dataclass(frozen=True, slots=True)
class Verdict:
    check: Check
    passed: bool
    value: float | None
    message: str


def parse_check(expression: str) -> Check:
    match = _EXPRESSION.match(expression)
    if match is None:
        raise ValueError(
            f"bad check {expression!r}: expected PATH OP NUMBER with OP one of "
            f"{', '.join(OPERATORS)} (e.g. 'fairness.jain_index>=0.95')")
    return Check(match["path"].strip(), match["op"], float(match["number"]))


def resolve(summary: Mapping[str, Any], path: str) -> Any:
    """The value at a dotted ``path``; ``KeyError`` naming what exists where it stopped."""
    node: Any = summary
    parts = path.split(".")
    i = 0
    while i < len(parts):
        if not isinstance(node, Mapping):
            raise KeyError(f"{'.'.join(parts[:i])} is a value, not a section")
        for j in range(len(parts), i, -1):  # the longest key first: names may hold dots
            key = ".".join(parts[i:j])
            if key in node:
                node, i = node[key], j
                break
        else:
            where = ".".join(parts[:i]) or "summary.json"
            known = ", ".join(sorted(map(str, node))) or "nothing"
            raise KeyError(f"{where} has no {parts[i]!r} (it has: {known})")
    return node


def evaluate(check: Check, summary: Mapping[str, Any]) -> Verdict:
    try:
        value = resolve(summary, check.path)
    except KeyError as e:
        return Verdict(check, False, None, f"FAIL {check}: {e.args[0]}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        shown = "null (not measured or unbounded)" if value is None else type(value).__name__
        return Verdict(check, False, None, f"FAIL {check}: {check.path} is {shown}")
    number = float(value)
    passed = not math.isnan(number) and OPERATORS[check.op](number, check.number)
    word = "ok  " if passed else "FAIL"
    return Verdict(check, passed, number, f"{word} {check}: {check.path} = {number:.6g}")
