"""How a request names the agent program it is a call of, as each harness sends it.

Harnesses disagree, on the header and on what a subagent is called (llm-d's issue #2794),
so a tenant names the harnesses its traffic imitates (``identity`` in its tenants file):

* ``claude_code``: ``x-claude-code-session-id`` names the program a person started, the
  same in every subagent; a subagent adds ``x-claude-code-agent-id`` (itself) and, below the
  first level, ``x-claude-code-parent-agent-id`` (the subagent that forked it);
* ``opencode``: ``x-session-id`` and ``x-session-affinity``, both the program itself (an
  OpenCode subagent is a session of its own);
* ``codex``: ``session-id`` names the program a person started, ``thread-id`` the program
  itself;
* ``agentic_context``: vllm-router's program-scheduling context in the body,
  ``vllm_xargs.agentic_context``: ``program_id``, ``root_program_id``, a subagent's
  ``parent_program_id`` with ``blocks_parent`` (its parent waits for it: fork-join), and
  ``step_id``, the call's index in its program. vLLM 0.32 types ``vllm_xargs`` as a map of
  scalars and lists of scalars, so the context travels as a JSON string, the form both
  vllm-router and vLLM take.

Pure functions of the plan: the load generator and the simulator send the same.
"""

from __future__ import annotations

from typing import Any

import orjson

from weighbridge.loadgen.plan import ProgramRef, RequestPlan
from weighbridge.loadgen.tenants import TenantSpec

__all__ = ["AGENTIC_CONTEXT", "agentic_context", "identity_headers", "request_headers"]

AGENTIC_CONTEXT = "agentic_context"  # the harness that speaks in the body, not in headers


def identity_headers(program: ProgramRef, harnesses: tuple[str, ...]) -> dict[str, str]:
    """The headers naming ``program`` for each harness in ``harnesses``."""
    out: dict[str, str] = {}
    forked = program.parent_id is not None
    if "claude_code" in harnesses:
        out["x-claude-code-session-id"] = program.root_id
        if forked:
            out["x-claude-code-agent-id"] = program.program_id
            if program.parent_id != program.root_id:
                out["x-claude-code-parent-agent-id"] = str(program.parent_id)
    if "opencode" in harnesses:
        out["x-session-id"] = program.program_id
        out["x-session-affinity"] = program.program_id
    if "codex" in harnesses:
        out["session-id"] = program.root_id
        out["thread-id"] = program.program_id
    return out


def request_headers(plan: RequestPlan, tenant: TenantSpec) -> dict[str, str]:
    """The headers of ``plan``'s request besides its authorization: the tenant's own, and
    its program's identity in the tenant's harnesses."""
    out = tenant.request_headers
    if plan.program is not None and tenant.identity:
        out.update(identity_headers(plan.program, tenant.identity))
    return out


def agentic_context(plan: RequestPlan) -> str | None:
    """vllm-router's ``vllm_xargs.agentic_context`` of ``plan``, as a JSON string; None
    outside programs."""
    program = plan.program
    if program is None:
        return None
    context: dict[str, Any] = {"program_id": program.program_id,
                               "root_program_id": program.root_id}
    if program.parent_id is not None:
        context.update(parent_program_id=program.parent_id, blocks_parent=True)
    if plan.turn is not None:
        context["step_id"] = plan.turn
    return orjson.dumps(context).decode()
