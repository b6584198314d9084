"""Agent programs: a task's LLM calls, each resending the program's growing context, with
tool runs between them and subagents that fork from it and join back.

A tenant with ``programs`` starts a program at each of its open-loop arrivals
(:func:`programs_of`). A program draws its number of calls once; call ``k`` draws its
answer's length from the tenant's ``lengths`` (call 0 also its task, the first user message,
from the same draw's prompt), then what follows it, from an RNG keyed by the program and the
call, so a run is the same whatever the number of processes and whichever side (Locust or
the simulator) runs it:

* call 0's prompt is the tenant's system prompt (if any) and the task;
* after call ``k``'s answer (but the last), its tool runs ``tool_ms`` and outputs
  ``tool_output`` tokens: call ``k + 1``'s prompt is call ``k``'s, plus the answer as the
  server returned it, plus the tool's output, due when the tool ends;
* or, with ``subagents``, the call forks ``count`` subagents (chance ``probability``, down to
  ``depth`` levels): each is a program of its own ``calls`` whose first prompt is its
  parent's context (call ``k``'s prompt and answer: they share the parent's prefix) plus its
  own task, started when the parent's answer ended. The parent resumes when every one of
  them has ended, at the last end: its next prompt appends, as one tool result, the final
  answers of those that answered (when none did, the tool's own output, the failure the
  harness reports);
* a call that does not end ``ok`` ends its program (there is no answer to continue from): a
  subagent's parent resumes without its answer, and the program a person started fails.

A program's calls carry their :class:`~weighbridge.loadgen.plan.ProgramRef` (its id, the
program at the top of its family, the one that forked it), which the request names in its
tenant's harnesses (weighbridge.loadgen.identity) and its record keeps. Nothing here reads a
clock or sends anything: :class:`ProgramRun` is told how each call ended and plans what
follows; the driver and the simulator send it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from weighbridge.loadgen.plan import (
    Answer,
    Message,
    ProgramRef,
    RequestPlan,
    open_loop_schedule,
    system_message,
)
from weighbridge.loadgen.scenario import Workload
from weighbridge.loadgen.sessions import phase_at, turn_request_id
from weighbridge.loadgen.tenants import Programs, TenantSpec

__all__ = ["Program", "ProgramRun", "programs_of"]


@dataclass(frozen=True, slots=True)
class Program:
    """One program's thread of calls: a task a person started, or a subagent it forked."""

    program_id: str
    tenant: TenantSpec
    seq: int  # its family's among the tenant's programs: process ``seq % count`` runs it
    root_id: str
    parent_id: str | None
    depth: int  # 0: the program a person started; a subagent: its parent's + 1
    calls: int  # as drawn; fewer are sent when a call fails or the run ends
    user: str | None  # the `user` field of every call
    start_s: float
    context: tuple[Message, ...]  # what its first call's prompt starts with

    @property
    def ref(self) -> ProgramRef:
        return ProgramRef(self.program_id, self.root_id, self.parent_id, self.calls)


def program_id(tenant: str, seq: int) -> str:
    return f"{tenant}-p{seq}"


def subagent_id(parent: str, call: int, index: int) -> str:
    """Subagent ``index`` of those its parent forked after call ``call``."""
    return f"{parent}-c{call}.{index}"


def _spec(tenant: TenantSpec) -> Programs:
    spec = tenant.programs
    assert spec is not None
    return spec


def programs_of(tenant: TenantSpec, workload: Workload, seed: int,
                until_s: float | None = None) -> Iterator[Program]:
    """The tenant's programs (those a person starts) in the order they start, up to
    ``until_s``."""
    spec = tenant.programs
    if spec is None:
        return
    system = system_message(tenant, seed)
    for due in open_loop_schedule(tenant, workload, seed, until_s):
        pid = program_id(tenant.name, due.seq)
        rng = random.Random(f"{seed}/{pid}")
        calls = spec.calls.sample(rng)
        user = f"{tenant.name}-u{rng.randrange(tenant.users)}" if tenant.users else None
        yield Program(pid, tenant, due.seq, pid, None, 0, calls, user, due.t,
                      (system,) if system else ())


@dataclass(frozen=True, slots=True)
class _Draws:
    """What call ``k`` of a program draws: its task (used by call 0), its answer's length,
    the tool run that follows it, and whether it forks."""

    task: int
    output: int
    content_seed: int
    tool_s: float
    tool_output: int
    tool_seed: int
    subagents: int  # how many it forks; 0: its tool runs instead


def _draws(program: Program, call: int, seed: int) -> _Draws:
    spec = _spec(program.tenant)
    rng = random.Random(f"{seed}/{program.program_id}/t{call}")
    task, output = program.tenant.lengths.draw(rng)
    content_seed = rng.getrandbits(32)
    tool_output = spec.tool_output.sample(rng)
    tool_s = spec.tool_ms.sample(rng) / 1000
    tool_seed = rng.getrandbits(32)
    forks = spec.subagents
    subagents = 0
    if forks is not None and program.depth < forks.depth and rng.random() < forks.probability:
        subagents = forks.count.sample(rng)
    return _Draws(task, output, content_seed, tool_s, tool_output, tool_seed, subagents)


@dataclass(slots=True)
class _Join:
    """A parent waiting for the subagents it forked after one of its calls."""

    parent: Program
    call: int  # the call it resumes with
    context: tuple[Message, ...]  # its prompt and answer at the fork
    children: tuple[str, ...]
    tool: Message  # the tool output it resumes with when no subagent answered
    ended: dict[str, tuple[Answer | None, float]] = field(default_factory=dict)


def _results(answers: Sequence[Answer], content_seed: int) -> Message:
    """The subagents' final answers as one tool result: their text and token ids in order
    (ids drawn from ``content_seed`` when an answer came without them)."""
    texts = [a.text for a in answers]
    ids = [a.token_ids for a in answers]
    return Message(
        "user", sum(a.tokens for a in answers), content_seed,
        text="".join(t for t in texts if t is not None) if None not in texts else None,
        token_ids=tuple(i for part in ids if part is not None for i in part)
        if None not in ids else None)


class ProgramRun:
    """One program a person started and every subagent it forks, as a conversation
    (weighbridge.loadgen.conversations): :meth:`first`, then :meth:`ended` with each call's
    end gives the calls that follow it."""

    def __init__(self, root: Program, workload: Workload, seed: int,
                 model: str | None = None) -> None:
        """``model``: the run's, for a tenant naming none."""
        self.root = root
        self.workload = workload
        self.seed = seed
        self.model = model
        self.done = False  # the root program has ended
        self._programs = {root.program_id: root}
        self._joins: dict[str, _Join] = {}  # parent program id -> the fork it waits on

    def first(self) -> RequestPlan:
        return self._call(self.root, 0, self.root.context, self.root.start_s)

    def ended(self, plan: RequestPlan, answer: Answer | None, end_s: float
              ) -> list[RequestPlan]:
        assert plan.program is not None and plan.turn is not None \
            and plan.messages is not None
        program = self._programs[plan.program.program_id]
        if answer is None or plan.turn + 1 >= program.calls:
            return self._program_ended(program, answer, end_s)
        draws = _draws(program, plan.turn, self.seed)
        reply = Message("assistant", answer.tokens, text=answer.text,
                        token_ids=answer.token_ids)
        context = (*plan.messages, reply)
        tool = Message("user", draws.tool_output, draws.tool_seed)
        if not draws.subagents:
            return [self._call(program, plan.turn + 1, (*context, tool),
                               max(end_s, plan.scheduled_s) + draws.tool_s)]
        spec = _spec(program.tenant).subagents
        assert spec is not None
        children = []
        for index in range(draws.subagents):
            cid = subagent_id(program.program_id, plan.turn, index)
            calls = spec.calls.sample(random.Random(f"{self.seed}/{cid}"))
            children.append(Program(cid, program.tenant, program.seq, program.root_id,
                                    program.program_id, program.depth + 1, calls,
                                    program.user, end_s, context))
        self._programs.update((child.program_id, child) for child in children)
        self._joins[program.program_id] = _Join(
            program, plan.turn + 1, context, tuple(c.program_id for c in children), tool)
        return [self._call(child, 0, child.context, end_s) for child in children]

    def _program_ended(self, program: Program, answer: Answer | None, end_s: float
                       ) -> list[RequestPlan]:
        del self._programs[program.program_id]
        if program.parent_id is None:
            self.done = True
            return []
        join = self._joins[program.parent_id]
        join.ended[program.program_id] = (answer, end_s)
        if len(join.ended) < len(join.children):
            return []
        del self._joins[program.parent_id]
        answers = [a for child in join.children if (a := join.ended[child][0]) is not None]
        result = _results(answers, join.tool.content_seed) if answers else join.tool
        due = max(end for _, end in join.ended.values())
        return [self._call(join.parent, join.call, (*join.context, result), due)]

    def _call(self, program: Program, call: int, history: tuple[Message, ...],
              scheduled_s: float) -> RequestPlan:
        """Call ``call`` of ``program``, due at ``scheduled_s``: ``history`` is its prompt,
        to which call 0 adds its task."""
        draws = _draws(program, call, self.seed)
        messages = history if call else (*history, Message("user", draws.task,
                                                           draws.content_seed))
        tenant = program.tenant
        return RequestPlan(
            request_id=turn_request_id(program.program_id, call), tenant=tenant.name,
            tier=tenant.tier, phase=phase_at(self.workload, scheduled_s), user=program.user,
            endpoint=tenant.path, stream=tenant.stream,
            prompt_tokens=sum(m.tokens for m in messages), max_tokens=draws.output,
            scheduled_s=scheduled_s, content_seed=draws.content_seed,
            model=tenant.model or self.model, messages=messages,
            session_id=program.program_id, turn=call, program=program.ref)
