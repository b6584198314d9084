"""Each part's public surface (``__all__`` in its ``__init__``, weighbridge/surface.py): the
three lists of it agree, every name resolves to its module's object, the application and the
other parts import from a part only what its surface names, and importing a part's package
loads none of its modules."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PARTS = ["sidecar", "emulator", "loadgen", "analysis", "exporters", "dashboards"]


def declared(part: str) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """From the part's ``__init__.py``: module → names, as the ``if TYPE_CHECKING:`` imports
    give them, and as the table passed to ``surface`` does."""
    tree = ast.parse((REPO / part / "__init__.py").read_text())
    guard = next(n for n in tree.body if isinstance(n, ast.If))
    imports: dict[str, set[str]] = {}
    for node in guard.body:
        assert isinstance(node, ast.ImportFrom) and node.module is not None
        prefix = f"weighbridge.{part}."
        assert node.module.startswith(prefix), node.module
        imports.setdefault(node.module.removeprefix(prefix), set()).update(
            a.name for a in node.names)
    (assign,) = guard.orelse
    assert isinstance(assign, ast.Assign) and isinstance(assign.value, ast.Call)
    table = ast.literal_eval(assign.value.args[1])
    return imports, {module: set(names) for module, names in table.items()}


def submodules(part: str) -> set[str]:
    return {m.name for m in pkgutil.iter_modules([str(REPO / part)])}


@pytest.mark.parametrize("part", PARTS)
def test_the_surface_is_listed_alike_and_resolves(part: str) -> None:
    imports, table = declared(part)
    assert imports == table
    package = importlib.import_module(f"weighbridge.{part}")
    assert package.__doc__
    named = {name for names in table.values() for name in names}
    assert set(package.__all__) == named and len(package.__all__) == len(named)
    # A name a submodule has too would be that module once the submodule is imported.
    assert not named & submodules(part)
    for module, names in table.items():
        source = importlib.import_module(f"weighbridge.{part}.{module}")
        for name in names:
            assert getattr(package, name) is getattr(source, name)
    assert named <= set(dir(package))
    with pytest.raises(AttributeError):
        _ = package.no_such_name


def imports_across_parts() -> set[tuple[str, str, str, str]]:
    """(importer's file, part, module, name) of every ``from weighbridge.<part>.<module>
    import name`` in the application and in the other parts."""
    files = [(p, "app") for p in (REPO / "weighbridge" / "app").rglob("*.py")]
    for part in PARTS:  # the folders, not weighbridge/<part>: rglob does not follow links
        files += [(p, part) for p in (REPO / part).rglob("*.py")]
    found = set()
    for path, owner in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                if len(parts) > 2 and parts[0] == "weighbridge" and parts[1] in PARTS \
                        and parts[1] != owner:
                    found |= {(str(path.relative_to(REPO)), parts[1], parts[2], a.name)
                              for a in node.names}
    return found


def test_parts_and_the_application_import_only_the_surface() -> None:
    found = imports_across_parts()
    assert found  # the scan sees the imports it checks
    outside = []
    for path, part, module, name in sorted(found):
        _, table = declared(part)
        # A name its module shares (analysis.summary.summary) is read from that module.
        if name not in table.get(module, ()) and name != module:
            outside.append(f"{path}: weighbridge.{part}.{module}.{name}")
    assert not outside, "not in the part's __all__ (its __init__.py):\n" + "\n".join(outside)


def test_importing_a_part_loads_none_of_its_modules() -> None:
    code = ("import sys\n"
            f"for part in {PARTS!r}:\n"
            "    __import__('weighbridge.' + part)\n"
            "print(sorted(m for m in sys.modules if m.count('.') > 1 and any("
            f"m.startswith('weighbridge.' + p + '.') for p in {PARTS!r})))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, cwd=REPO, timeout=60)
    assert done.stdout.strip() == "[]"
