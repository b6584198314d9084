"""A part's public surface: the names its ``__init__`` lists in ``__all__``, each looked up in
its module on first use.

A part's package imports none of its modules up front: importing ``weighbridge.sidecar.core``
runs ``weighbridge/sidecar/__init__.py`` first, and a package that imported its shells there
would load aiohttp, Locust or pandas for a caller that needs one pure module, in an install
without that extra (docs/architecture.md, "Installs by role"). So each name resolves through
the package's module ``__getattr__`` (PEP 562) when first read, and is kept on the package
after; type checkers read the same names from the ``if TYPE_CHECKING:`` imports beside it.
``tests/unit/test_surfaces.py`` holds the three lists (``__all__``, the imports, the table
given here) equal, and every import the application and the other parts make from a part to
its surface.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def surface(package: str, modules: Mapping[str, tuple[str, ...]]
            ) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, whose surface is ``modules``: each
    module's name (below the package) → the names read from it."""
    where = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> object:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)  # later reads find it without this call
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *where})

    return __getattr__, __dir__
