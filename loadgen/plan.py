"""What to send and when: a tenant's schedule and each request's sizes, drawn from the seed.

Everything here is a pure function of (seed, tenant, phase, sequence number), so a run is
reproducible whatever the number of processes: every process computes the same full
schedule and keeps its share (``seq % count == index``), which splits any arrival process
exactly (the union of the shares is the original schedule), and each request's sizes come
from its own RNG, keyed by its id.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from weighbridge.loadgen.arrivals import Closed
from weighbridge.loadgen.scenario import Workload
from weighbridge.loadgen.tenants import TenantSpec

__all__ = ["Answer", "Due", "Message", "ProgramRef", "RequestPlan", "closed_users",
           "open_loop_schedule", "plan_request", "share", "system_message"]


@dataclass(frozen=True, slots=True)
class Due:
    """One open-loop request: when it is due (seconds since run start), in which phase, and
    its sequence number among the tenant's requests."""

    t: float
    phase: str
    seq: int


@dataclass(frozen=True, slots=True)
class Message:
    """One part of a prompt with prefix structure: a system prompt, a user message, an
    answer sent back, or a trace's blocks. ``tokens`` is its length; its content is drawn
    from ``content_seed`` (the first ``tokens`` of that seed's stream, so a shorter prompt of
    the same seed is a prefix of a longer one), except an answer's, which is what the server
    returned, and a trace's, whose block ``i`` comes from ``blocks[i]``."""

    role: Literal["system", "user", "assistant"]
    tokens: int
    content_seed: int = 0
    text: str | None = None  # an answer's text, as the server streamed it
    token_ids: tuple[int, ...] | None = None  # an answer's token ids, when the server sent them
    blocks: tuple[int, ...] | None = None  # a trace's block content seeds (TRACE_BLOCK tokens)


@dataclass(frozen=True, slots=True)
class ProgramRef:
    """The agent program a request is a call of (weighbridge.loadgen.programs, or a replayed
    trace's session), named as its harness names it."""

    program_id: str
    root_id: str  # the program at the top of its fork-join family (nobody forked it)
    parent_id: str | None  # the program that forked it; None for the root
    calls: int  # the calls its own thread planned (a call is a turn of its conversation)


@dataclass(frozen=True, slots=True)
class RequestPlan:
    request_id: str
    tenant: str
    tier: str
    phase: str
    user: str | None
    endpoint: str  # the API path
    stream: bool
    prompt_tokens: int  # as drawn; the server's usage is what the record keeps
    max_tokens: int
    scheduled_s: float
    content_seed: int  # varies the prompt's content so no two prompts share a prefix
    model: str | None = None  # the body's `model`; None: the request names none
    # The prompt with prefix structure (a system prompt, a session's history, a trace's
    # blocks), ``prompt_tokens`` long in all; None: prefix-free, drawn from content_seed.
    messages: tuple[Message, ...] | None = None
    session_id: str | None = None
    turn: int | None = None
    program: ProgramRef | None = None


@dataclass(frozen=True, slots=True)
class Answer:
    """What the server answered a turn: its length in tokens (usage), its text, and its
    token ids when the server returned them."""

    tokens: int
    text: str | None = None
    token_ids: tuple[int, ...] | None = None


def open_loop_schedule(tenant: TenantSpec, workload: Workload, seed: int,
                       until_s: float | None = None) -> Iterator[Due]:
    """The tenant's open-loop send times over all phases, in order, up to ``until_s``."""
    seq = 0
    for span in workload.phases:
        process = tenant.arrival_in(span.name)
        if process is None or isinstance(process, Closed):
            continue
        end = span.end_s if until_s is None else min(span.end_s, until_s)
        if span.start_s >= end:
            break
        rng = random.Random(f"{seed}/{tenant.name}/{span.name}/arrivals")
        for t in process.times(rng, span.start_s, end):
            yield Due(t, span.name, seq)
            seq += 1


def share(schedule: Iterator[Due], index: int, count: int) -> Iterator[Due]:
    """Process ``index`` of ``count``'s part of a schedule."""
    if not 0 <= index < count:
        raise ValueError(f"process index {index} not in [0, {count})")
    return (due for due in schedule if due.seq % count == index)


def closed_users(tenant: TenantSpec, workload: Workload, index: int,
                 count: int) -> Iterator[tuple[str, float, float, int, Closed]]:
    """(phase, start, end, user number, process) of every closed-loop user this process
    runs; user ``u`` of a phase belongs to process ``u % count``."""
    for span in workload.phases:
        process = tenant.arrival_in(span.name)
        if not isinstance(process, Closed):
            continue
        for user in range(index, process.users, count):
            yield span.name, span.start_s, span.end_s, user, process


def plan_request(tenant: TenantSpec, request_id: str, phase: str, scheduled_s: float,
                 seed: int, model: str | None = None) -> RequestPlan:
    """``model``: the run's model, for a tenant that names none of its own."""
    rng = random.Random(f"{seed}/{request_id}")
    prompt, output = tenant.lengths.draw(rng)
    if tenant.endpoint == "embeddings":
        output = 0  # nothing is generated (the draw is kept, so the stream of draws is too)
    user = f"{tenant.name}-u{rng.randrange(tenant.users)}" if tenant.users else None
    content_seed = rng.getrandbits(32)
    messages = None
    if (system := system_message(tenant, seed)) is not None:
        messages = (system, Message("user", prompt, content_seed))
        prompt += system.tokens
    return RequestPlan(
        request_id=request_id, tenant=tenant.name, tier=tenant.tier, phase=phase, user=user,
        endpoint=tenant.path, stream=tenant.stream, prompt_tokens=prompt, max_tokens=output,
        scheduled_s=scheduled_s, content_seed=content_seed,
        model=tenant.model or model, messages=messages,
    )


def system_message(tenant: TenantSpec, seed: int) -> Message | None:
    """The tenant's system prompt in this run: its length drawn once per tenant, its text
    from the tenant's name, or from the shared name that several tenants give."""
    spec = tenant.system_prompt
    if spec is None:
        return None
    length = spec.length.sample(random.Random(f"{seed}/{tenant.name}/system"))
    source = f"shared/{spec.shared}" if spec.shared else f"tenant/{tenant.name}"
    return Message("system", length, random.Random(f"{seed}/system/{source}").getrandbits(32))


def open_request_id(tenant: str, seq: int) -> str:
    return f"{tenant}-{seq}"


def closed_request_id(tenant: str, phase: str, user: int, n: int) -> str:
    return f"{tenant}-{phase}-u{user}-{n}"
