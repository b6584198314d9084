"""The one registry of the scheduling core's parts, by kind: which flow is served next
(``fairness``), a tenant's own queue order (``ordering``), what sending a request to a
backend costs (``scorer``), the choice among backends (``picker``), and the admission rules
that refine a backend's standing (``backend_rule``) or hold a tenant back on it
(``tenant_rule``; sidecar.eligibility composes both, in the order its lists state).

A part is one module in its kind's package (``sidecar/fairness/``, ``sidecar/routing/``)
whose class carries ``@register(kind, name)``; the registry imports every module of those
packages the first time it is read, so a new part is that one module. The configuration
names parts (``scheduler.policy``, ``scheduler.ordering``, ``routing``) and is validated
against the registry; the configuration reference renders each part's docstring, and the
conformance suites (tests/unit/sidecar/test_*_conformance.py) run over everything
registered.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Literal, TypeVar, get_args

__all__ = ["Kind", "UnknownPlugin", "plugin", "register", "registered"]

Kind = Literal["fairness", "ordering", "scorer", "picker", "backend_rule", "tenant_rule"]
KINDS: tuple[Kind, ...] = get_args(Kind)

# The packages whose modules hold the parts, and the modules, imported on the first read.
_PACKAGES = ("weighbridge.sidecar.fairness", "weighbridge.sidecar.routing")
_MODULES = ("weighbridge.sidecar.eligibility",)

_registry: dict[str, dict[str, Any]] = {kind: {} for kind in KINDS}
_discovered = False

_T = TypeVar("_T")


class UnknownPlugin(ValueError):
    """A configuration named a part no module registers."""


def register(kind: Kind, name: str) -> Callable[[_T], _T]:
    """Class decorator: ``name`` is a ``kind`` of part (the class sets ``name`` to it)."""
    if kind not in _registry:
        raise ValueError(f"unknown kind of part {kind!r}")

    def add(cls: _T) -> _T:
        known = _registry[kind].get(name)
        if known is not None and known is not cls:
            raise ValueError(f"two {kind} parts named {name!r}: {known!r} and {cls!r}")
        cls.name = name  # type: ignore[attr-defined]
        _registry[kind][name] = cls
        return cls

    return add


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    _discovered = True
    for package_name in _PACKAGES:
        package = importlib.import_module(package_name)
        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{package_name}.{module.name}")
    for module_name in _MODULES:
        importlib.import_module(module_name)


def registered(kind: Kind) -> Mapping[str, Any]:
    """Every registered part of ``kind``, by name, in the names' order (whatever order the
    modules were imported in)."""
    _discover()
    parts = _registry[kind]
    return MappingProxyType({name: parts[name] for name in sorted(parts)})


def plugin(kind: Kind, name: str) -> Any:
    """The part of ``kind`` registered as ``name``."""
    found = registered(kind).get(name)
    if found is None:
        known = ", ".join(sorted(registered(kind)))
        raise UnknownPlugin(f"unknown {kind} {name!r} (registered: {known})")
    return found
