"""A YAML settings file (the sidecar's config, a stack file) read strictly, and every problem
with it reported at once, each as ``dotted.path: message``.

Strict means: a repeated mapping key is an error (YAML would let the last one win silently:
a tenant defined twice), and the file must be readable UTF-8 holding a mapping. The schemas
themselves are pydantic models (``weighbridge.sidecar.config``, ``weighbridge.app.stack``); this
module turns their validation errors into the one report format both use.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import ValidationError
from pydantic_core import PydanticCustomError

__all__ = ["Issue", "SettingsError", "conflicts", "dotted", "problems", "read_yaml"]

# A model validator's cross-field problem: a path relative to the model, and a message.
Issue = tuple[tuple[str | int, ...], str]
_CONFLICTS = "config_conflicts"


class SettingsError(Exception):
    """Every problem with one settings file, each as ``(dotted.path, message)``."""

    # What the file is, for the first line of the report ("cannot load <what>").
    what = "settings"

    def __init__(self, source: str, errors: Sequence[tuple[str, str]]) -> None:
        self.source = source
        self.errors: list[tuple[str, str]] = list(errors)
        count = len(self.errors)
        lines = [f"{source}: cannot load {self.what} ({count} error{'s' * (count != 1)})"]
        lines += [f"  {path}: {message}" for path, message in self.errors]
        super().__init__("\n".join(lines))


def dotted(loc: Sequence[str | int]) -> str:
    return ".".join(str(part) for part in loc) or "(top level)"


def conflicts(issues: Sequence[Issue]) -> PydanticCustomError:
    """One validation error carrying several cross-field problems, each at its own path
    relative to the model: a model validator only gets the model's own location, and
    :func:`problems` unpacks them so every problem is still reported where it is."""
    return PydanticCustomError(
        _CONFLICTS, "{count} conflicting settings", {"count": len(issues), "issues": tuple(issues)}
    )


def problems(exc: ValidationError) -> list[tuple[str, str]]:
    """A pydantic validation error as ``(dotted.path, message)`` pairs (never the input: a
    value may be a secret)."""
    out: list[tuple[str, str]] = []
    for err in exc.errors(include_url=False, include_input=False):
        loc = tuple(err["loc"])
        if err["type"] == _CONFLICTS:
            issues: tuple[Issue, ...] = err["ctx"]["issues"]
            out += [(dotted(loc + rel), message) for rel, message in issues]
        else:
            out.append((dotted(loc), err["msg"]))
    return out


# libyaml's parser where PyYAML was built with it: about 4x faster on a large config
# (benchmarks/RESULTS.md, "reload_ttft"), with the same safe constructors.
if TYPE_CHECKING:
    _SafeLoader = yaml.SafeLoader
else:
    _SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _UniqueKeyLoader(_SafeLoader):
    """SafeLoader that rejects duplicate mapping keys."""


def _construct_unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
        except TypeError:  # unhashable key: construct_mapping reports it properly
            break
        if duplicate:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"duplicate key {key!r}",
                key_node.start_mark,
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping
)


def read_yaml(path: str | os.PathLike[str], error: type[SettingsError]) -> Any:
    """The parsed content of a YAML file (not yet validated); raises ``error`` naming the
    file, with the line and column of a syntax problem."""
    source = os.fspath(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise error(source, [(source, reason)]) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        where = source
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f"{source}:{mark.line + 1}:{mark.column + 1}"
        problem = getattr(exc, "problem", None) or str(exc)
        raise error(source, [(where, problem)]) from None
    if data is None:
        raise error(source, [(source, "file is empty")])
    return data
