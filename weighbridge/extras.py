"""Which of the package's extras are installed, read from its own metadata (the extras are
declared once, in pyproject.toml): the CLI names the extra a command needs instead of
failing on an import (docs/architecture.md, "Installs")."""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Callable, Iterable

DISTRIBUTION = "weighbridge"

_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_EXTRA = re.compile(r"""\s*(?:and\s+)?extra\s*==\s*["']([^"']+)["']\s*(?:and\s+)?""")


def requirements_by_extra(requires: Iterable[str]) -> dict[str, list[str]]:
    """The distributions each extra adds, from Requires-Dist lines (``pandas>=3.1; extra ==
    "analysis"``). A requirement with a further marker (uvloop's ``sys_platform !=
    "win32"``) is left out: whether it applies here would take a marker evaluator, and an
    extra has others to tell whether it is installed."""
    extras: dict[str, list[str]] = {}
    for line in requires:
        spec, _, marker = line.partition(";")
        extra = _EXTRA.search(marker)
        name = _NAME.match(spec)
        if extra is None or name is None or _EXTRA.sub("", marker).strip():
            continue
        if name.group(1).lower() != DISTRIBUTION:  # weighbridge[all] names the extras
            extras.setdefault(extra.group(1), []).append(name.group(1))
    return extras


def missing_extras(needed: Iterable[str], requires: Iterable[str],
                   installed: Callable[[str], bool]) -> list[str]:
    """The extras among ``needed`` with a distribution that is not installed, in order."""
    by_extra = requirements_by_extra(requires)
    return [extra for extra in needed
            if not all(installed(name) for name in by_extra.get(extra, []))]


def _installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def missing_here(needed: Iterable[str]) -> list[str]:
    """The extras among ``needed`` this environment lacks; none when weighbridge runs from
    sources without its metadata (then an import names what is missing)."""
    try:
        requires = importlib.metadata.requires(DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        return []
    return missing_extras(needed, requires, _installed)


def install_hint(command: str, extras: list[str]) -> str:
    """One line naming the extras and the pip command that installs them."""
    names = (extras[0] if len(extras) == 1
             else ", ".join(extras[:-1]) + " and " + extras[-1])
    noun = "extra" if len(extras) == 1 else "extras"
    return (f"{command} needs the {names} {noun}: "
            f"pip install '{DISTRIBUTION}[{','.join(extras)}]'")
