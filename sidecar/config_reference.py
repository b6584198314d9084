"""The configuration reference, generated from the schema's own field docstrings.

``weighbridge.sidecar.config`` documents each field once, in a docstring beneath it; this module
renders the schema pydantic publishes from them (types, bounds, defaults, descriptions) as
docs/configuration.md, and each part the configuration may name (the fairness policies,
orderings, scorers and pickers of ``sidecar.plugins``) from its class docstring, so the
reference cannot drift from the code
(tests/unit/test_config_reference.py fails when the committed file differs, as vLLM's
``tools/validate_config.py`` does for its config classes). A field whose default is derived
at run time names it in ``json_schema_extra={"x-default": ...}``.

Regenerate with ``python -m weighbridge.sidecar.config_reference > docs/configuration.md``.
"""

from __future__ import annotations

import enum
import inspect
import json
import sys
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel

from weighbridge.sidecar import config
from weighbridge.sidecar.config import Config
from weighbridge.sidecar.eligibility import BACKEND_RULES, HEADROOM_RULES, OPEN_RULES
from weighbridge.sidecar.plugins import Kind, registered
from weighbridge.sidecar.routing import PRESETS

__all__ = ["render", "undocumented"]

Schema = dict[str, Any]

_INTRO = """\
# Configuration reference

<!-- Generated from sidecar/config.py by
     `python -m weighbridge.sidecar.config_reference > docs/configuration.md`; do not edit. -->

The sidecar's YAML file (`weighbridge sidecar --config FILE`, docs/sidecar.md). Models are
strict: YAML types are taken as written (a quoted number is an error), unknown keys are
errors, and every error is reported with its dotted path, all at once. "none" is YAML's
`null`, or the field left out.
"""


def _ref_name(node: Schema) -> str | None:
    ref = node.get("$ref")
    return ref.rsplit("/", 1)[-1] if isinstance(ref, str) else None


def _bounds(node: Schema) -> str:
    parts = []
    for key, sign in (("exclusiveMinimum", ">"), ("minimum", "≥"),
                      ("exclusiveMaximum", "<"), ("maximum", "≤")):
        if key in node:
            parts.append(f"{sign} {node[key]}")
    return " ".join(parts)


def _type(node: Schema, defs: dict[str, Schema]) -> str:
    """A schema node as the reference's type column reads it."""
    name = _ref_name(node)
    if name is not None:
        target = defs[name]
        if "enum" in target:
            return _type(target, defs)
        return f"[{name}](#{name.lower()})"
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        text = " or ".join(_type(o, defs) for o in options)
        return text + " or none" if len(options) < len(node["anyOf"]) else text
    if "enum" in node:
        return " | ".join(f"`{value}`" for value in node["enum"])
    kind = node.get("type")
    if kind == "object":
        value = _type(node.get("additionalProperties", {}), defs)
        least = node.get("minProperties")
        return f"map → {value}" + (f", at least {least}" if least else "")
    if kind == "array":
        least = node.get("minItems")
        return f"list of {_type(node.get('items', {}), defs)}" + (
            f", at least {least}" if least else "")
    if kind is None:
        return "any"
    bounds = _bounds(node)
    return f"{kind} {bounds}" if bounds else str(kind)


def _default(model: type[BaseModel], field: str, node: Schema) -> str:
    if "x-default" in node:
        return str(node["x-default"])
    info = model.model_fields[field]
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "its defaults"
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"`{value}`"
    return json.dumps(value, ensure_ascii=False, default=str)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _models(schema: Schema) -> Iterator[tuple[str, Schema, list[str]]]:
    """Every object model reachable from the root, breadth first, with the paths it sits at."""
    defs: dict[str, Schema] = schema.get("$defs", {})
    at: dict[str, list[str]] = {"Config": ["the top level"]}
    order = ["Config"]
    queue = [("Config", schema, "")]
    while queue:
        _, node, prefix = queue.pop(0)
        for field, sub in node.get("properties", {}).items():
            for name, path in _refs(sub, f"{prefix}{field}"):
                if "enum" in defs[name]:
                    continue
                if name not in at:
                    at[name] = []
                    order.append(name)
                    queue.append((name, defs[name], path + "."))
                at[name].append(f"`{path}`")
    for name in order:
        yield name, schema if name == "Config" else defs[name], at[name]


def _refs(node: Schema, path: str) -> Iterator[tuple[str, str]]:
    """The models a field's schema refers to, each with the path it sits at (``.<name>``
    for a map's values, ``[]`` for a list's items); every option of a union."""
    if "anyOf" in node:
        for option in node["anyOf"]:
            yield from _refs(option, path)
    elif node.get("type") == "object" and "additionalProperties" in node:
        yield from _refs(node["additionalProperties"], path + ".<name>")
    elif node.get("type") == "array":
        yield from _refs(node.get("items", {}), path + "[]")
    elif (name := _ref_name(node)) is not None:
        yield name, path


# Each kind of part, as the reference heads it, and the field that names it.
_PARTS: tuple[tuple[Kind, str, str], ...] = (
    ("fairness", "Fairness policies", "`scheduler.policy`"),
    ("ordering", "Orderings", "`scheduler.ordering`"),
    ("scorer", "Scorers", "`routing.scorers`"),
    ("picker", "Pickers", "`routing.picker`"),
)


def _parts() -> Iterator[str]:
    """Every registered part, by kind, with its docstring; then the routing presets."""
    yield "## Parts\n"
    yield ("The parts the configuration names, as registered (`sidecar.plugins`: one module "
           "each under sidecar/fairness/ and sidecar/routing/).\n")
    for kind, title, field in _PARTS:
        yield f"### {title}\n"
        yield f"Named by {field}.\n"
        yield "| name | what it does |\n|---|---|"
        for name, part in registered(kind).items():
            yield f"| `{name}` | {_cell(inspect.getdoc(part) or '')} |"
        yield ""
    yield from _rules()
    yield "### Routing presets\n"
    yield "The names `routing` takes for a picker over weighted scorers.\n"
    yield "| name | picker | scorers (weight) |\n|---|---|---|"
    for name, (picker, scorers) in PRESETS.items():
        weighed = ", ".join(f"`{s}` ({w:g})" for s, w in scorers.items()) or "none"
        yield f"| `{name}` | `{picker}` | {weighed} |"
    yield ""


def _rules() -> Iterator[str]:
    """The admission rules, in the order sidecar.eligibility composes them."""
    yield "### Admission rules\n"
    yield ("Not named by the configuration: `admission` sets their limits. The backend rules "
           "refine each backend's gate verdict in this order; then the tenant rules hold a "
           "tenant back on an open backend, or on one in headroom.\n")
    yield "| rule | applies | what it does |\n|---|---|---|"
    names = {**{type(r): n for n, r in _named("backend_rule")},
             **{type(r): n for n, r in _named("tenant_rule")}}
    shown: set[type] = set()
    for where, rules in (("backend", BACKEND_RULES), ("open", OPEN_RULES),
                         ("headroom", HEADROOM_RULES)):
        for rule in rules:
            text = "as above" if type(rule) in shown else _cell(inspect.getdoc(rule) or "")
            shown.add(type(rule))
            yield f"| `{names[type(rule)]}` | {where} | {text} |"
    yield ""


def _named(kind: Kind) -> Iterator[tuple[str, object]]:
    for name, part in registered(kind).items():
        yield name, part()


def render() -> str:
    """docs/configuration.md's text."""
    schema = Config.model_json_schema(mode="validation")
    defs: dict[str, Schema] = schema.get("$defs", {})
    out = [_INTRO]
    for name, node, paths in _models(schema):
        out.append(f"## {name}\n")
        out.append(f"At {', '.join(paths)}.\n")
        if node.get("description"):
            out.append(_cell(node["description"]) + "\n")
        out.append("| field | type | default | meaning |\n|---|---|---|---|")
        model = getattr(config, name)
        for field, sub in node.get("properties", {}).items():
            out.append(f"| `{field}` | {_cell(_type(sub, defs))} | "
                       f"{_cell(_default(model, field, sub))} | "
                       f"{_cell(sub.get('description', ''))} |")
        out.append("")
    out.extend(_parts())
    return "\n".join(out)


def undocumented() -> list[str]:
    """Every field of the schema without a docstring, as ``Model.field``."""
    schema = Config.model_json_schema(mode="validation")
    return [f"{name}.{field}"
            for name, node, _ in _models(schema)
            for field, sub in node.get("properties", {}).items()
            if not sub.get("description")]


if __name__ == "__main__":
    missing = undocumented()
    if missing:
        sys.exit("fields without a docstring: " + ", ".join(missing))
    sys.stdout.write(render())
