"""Which agent program a request is a call of, as the sources the configuration names say
(``programs.sources``; docs/sidecar.md, "Agent programs").

A program is one task of an agent: tens of calls resending its growing context, with tool
runs between them, and subagents that fork from it and join back. A call names two things:

- its **program**, the context it continues: what session affinity keeps on one backend
  (``QueuedRequest.session``);
- its **family**, the program a person started with every subagent below it: what the
  ``program_las`` ordering counts service by (``QueuedRequest.program``), so a fork-join
  family is one program for ordering.

Sources, read in the configured order; the first present decides:

- ``agentic_context``: vllm-router's ``vllm_xargs.agentic_context`` (an object or a JSON
  string of one): ``program_id``, or ``task_id``/``session_id`` with ``agent_id``; the family
  is its ``root_program_id``, else the family of its ``parent_program_id`` (a subagent's
  parent), else the program itself;
- ``header:NAME``: a header's value names the family (Claude Code's
  ``x-claude-code-session-id`` and Codex's ``session-id`` are the same in every subagent);
  ``agent_headers`` (Claude Code's ``x-claude-code-agent-id``, Codex's ``thread-id``) name
  the program inside it when present;
- ``body:FIELD``: a top-level string field of the body.

None of these ever chooses the tenant or the tier: the tenant comes from the key
(sidecar.identity), and every per-program map is keyed by (tenant, id), so one tenant's ids
never meet another's. A client may invent ids at will, so every map here is bounded.

What vLLM 0.32 would refuse is never forwarded: it types ``vllm_xargs`` as a map of strings,
numbers and lists of them, so an object ``agentic_context`` is forwarded as its JSON string
(the form vllm-router and vLLM both take), and any other value of another shape is a 400
before the request takes a slot (``check_xargs``).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

__all__ = ["AGENTIC_CONTEXT", "DEFAULT_AGENT_HEADERS", "DEFAULT_SOURCES", "MAX_ID_CHARS",
           "MAX_PROGRAMS", "ProgramError", "ProgramId", "ProgramIdentity", "ProgramSource",
           "check_xargs"]

AGENTIC_CONTEXT = "agentic_context"
HEADER = "header"
BODY = "body"
# The headers the common agent harnesses send (weighbridge.loadgen.identity renders them):
# vllm-router's context first, for it names parents; then the headers that name the family.
DEFAULT_SOURCES = (AGENTIC_CONTEXT, "header:x-claude-code-session-id", "header:session-id",
                   "header:x-session-affinity", "header:x-session-id")
# Headers naming a subagent inside the family a source named (Claude Code, Codex).
DEFAULT_AGENT_HEADERS = ("x-claude-code-agent-id", "thread-id")
# An id longer than this is a 400: ids go into bounded maps, never into metrics or logs.
MAX_ID_CHARS = 256
# Programs whose family is remembered (parent links); the least recently seen go first.
MAX_PROGRAMS = 65_536
# An HTTP field name (RFC 9110's token), lower-cased as headers are looked up.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9a-z]+")
# Headers that are the tenant's or the protocol's, never a program's.
_RESERVED = frozenset({"authorization", "host", "content-length", "content-type"})
_XARG_SCALARS = (str, int, float)  # bool is an int, as vLLM's model reads it


class ProgramError(ValueError):
    """A request whose program identity or ``vllm_xargs`` has a shape vLLM or vllm-router
    would refuse: ``reason`` is its 400's code."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ProgramSource:
    """One place a request's program may be named: vllm-router's agentic context, a header,
    or a top-level body field."""

    kind: str
    name: str = ""

    @classmethod
    def parse(cls, text: str) -> ProgramSource:
        """``agentic_context``, ``header:NAME`` or ``body:FIELD``; ValueError otherwise."""
        kind, sep, rest = text.strip().partition(":")
        name = rest.strip()
        if kind == AGENTIC_CONTEXT and not sep:
            return cls(AGENTIC_CONTEXT)
        if kind == HEADER and sep:
            name = name.lower()
            if not _TOKEN.fullmatch(name):
                raise ValueError(f"{text!r}: not an HTTP header name")
            if name in _RESERVED:
                raise ValueError(f"{text!r}: {name} does not name a program")
            return cls(HEADER, name)
        if kind == BODY and sep and name:
            return cls(BODY, name)
        raise ValueError(f"{text!r}: a source is agentic_context, header:NAME or body:FIELD")

    def __str__(self) -> str:
        return self.kind if self.kind == AGENTIC_CONTEXT else f"{self.kind}:{self.name}"


@dataclass(frozen=True, slots=True)
class ProgramId:
    """The program a call continues, and the family it belongs to (the same for a program
    nobody forked)."""

    program: str
    family: str


def _id(value: Any, field: str) -> str | None:
    """An id as a string (an integer is one, as JSON clients send them); None if absent."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ProgramError("invalid_agentic_context", f"{field} must be a string")
    text = str(value).strip()
    if len(text) > MAX_ID_CHARS:
        raise ProgramError("invalid_agentic_context",
                           f"{field} may be at most {MAX_ID_CHARS} characters")
    return text or None


def _header_id(value: str | None, name: str) -> str | None:
    if value is None:
        return None
    text = value.strip()
    if len(text) > MAX_ID_CHARS:
        raise ProgramError("invalid_program_id",
                           f"{name} may be at most {MAX_ID_CHARS} characters")
    return text or None


def _body_id(value: Any, field: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ProgramError("invalid_program_id", f"{field} must be a string")
    return _header_id(str(value), field)


def _context(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The body's ``vllm_xargs.agentic_context`` as an object (``check_xargs`` made it a
    JSON string already); None without one."""
    xargs = body.get("vllm_xargs")
    if not isinstance(xargs, dict) or AGENTIC_CONTEXT not in xargs:
        return None
    value = xargs[AGENTIC_CONTEXT]
    try:
        context = orjson.loads(value) if isinstance(value, str) else value
    except orjson.JSONDecodeError:
        context = None
    if not isinstance(context, dict):
        raise ProgramError("invalid_agentic_context",
                           "vllm_xargs.agentic_context must be an object or its JSON string")
    return context


def check_xargs(body: dict[str, Any]) -> None:
    """Make the body's ``vllm_xargs`` one vLLM takes, in place: an object (or a list)
    ``agentic_context`` becomes its JSON string; any other value that is not a string, a
    number or a flat list of them is a ``ProgramError`` (vLLM's 400, answered before the
    request takes a slot)."""
    xargs = body.get("vllm_xargs")
    if xargs is None:
        return
    if not isinstance(xargs, dict):
        raise ProgramError("invalid_vllm_xargs", "vllm_xargs must be an object")
    for key, value in xargs.items():
        if key == AGENTIC_CONTEXT and isinstance(value, dict):
            xargs[key] = orjson.dumps(value).decode()
            continue
        if isinstance(value, _XARG_SCALARS):
            continue
        if isinstance(value, list) and all(isinstance(v, _XARG_SCALARS) for v in value):
            continue
        raise ProgramError("invalid_vllm_xargs",
                           f"vllm_xargs.{key} must be a string, a number or a list of them")
    _context(body)  # a string agentic_context must hold an object


class ProgramIdentity:
    """The configured sources, and the parent links seen (bounded), per tenant."""

    def __init__(self, sources: Sequence[ProgramSource] = (),
                 agent_headers: Sequence[str] = (), max_programs: int = MAX_PROGRAMS) -> None:
        if len(set(sources)) != len(sources):
            raise ValueError("a program source is named twice")
        self.sources = tuple(sources)
        self.agent_headers = tuple(h.lower() for h in agent_headers)
        self._max = max_programs
        # (tenant, program) -> its family, as parent links said; oldest first.
        self._families: OrderedDict[tuple[str, str], str] = OrderedDict()

    @classmethod
    def of(cls, sources: Sequence[str], agent_headers: Sequence[str]) -> ProgramIdentity:
        return cls(tuple(ProgramSource.parse(s) for s in sources), agent_headers)

    def __len__(self) -> int:
        return len(self._families)

    def read(self, tenant: str, headers: Mapping[str, str], body: Mapping[str, Any]
             ) -> ProgramId | None:
        """The program ``tenant``'s request names by the first source present, or None;
        ``ProgramError`` for an id of a shape no harness sends."""
        for source in self.sources:
            if source.kind == AGENTIC_CONTEXT:
                found = self._from_context(tenant, body)
            elif source.kind == HEADER:
                found = self._from_header(headers, source.name)
            else:
                text = _body_id(body.get(source.name), source.name)
                found = None if text is None else ProgramId(text, text)
            if found is not None:
                return found
        return None

    def _from_header(self, headers: Mapping[str, str], name: str) -> ProgramId | None:
        family = _header_id(headers.get(name), name)
        if family is None:
            return None
        for agent_header in self.agent_headers:
            agent = _header_id(headers.get(agent_header), agent_header)
            if agent is not None:
                return ProgramId(f"{family}/{agent}", family)
        return ProgramId(family, family)

    def _from_context(self, tenant: str, body: Mapping[str, Any]) -> ProgramId | None:
        context = _context(body)
        if context is None:
            return None
        program = _id(context.get("program_id"), "program_id")
        task = _id(context.get("task_id"), "task_id") or _id(context.get("session_id"),
                                                              "session_id")
        agent = _id(context.get("agent_id"), "agent_id")
        if program is None and task is not None:
            program = task if agent is None else f"{task}/{agent}"
        if program is None:
            return None
        root = _id(context.get("root_program_id"), "root_program_id")
        parent = _id(context.get("parent_program_id"), "parent_program_id")
        if root is None and parent is not None:
            root = self._families.get((tenant, parent), parent)
        family = root or (task if agent is not None else None) \
            or self._families.get((tenant, program), program)
        self._remember(tenant, program, family)
        return ProgramId(program, family)

    def _remember(self, tenant: str, program: str, family: str) -> None:
        key = (tenant, program)
        self._families[key] = family
        self._families.move_to_end(key)
        if len(self._families) > self._max:
            self._families.popitem(last=False)
