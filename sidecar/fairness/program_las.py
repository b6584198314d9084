"""Program-level least attained service inside a tenant (Autellix's PLAS), with aging.

A tenant whose traffic is agent programs feels each program's end, not each call's first
token; ordering its calls first-come first-served shares the engines among all its programs
at once, so every program is late. Counting the service each program (each fork-join
family: sidecar.programs) has received and serving the least-served first finishes the
short programs without waiting for the long ones, as least attained service approximates
shortest-remaining-first when program lengths are not known in advance.

Aging bounds the wait: a call is ordered as if it had arrived ``delay_s`` later, growing
with its program's attained service and never reaching ``PROGRAM_MAX_DELAY_S``. So within a
tenant, priority and deadline alike, a call is never passed by one that arrives
``PROGRAM_MAX_DELAY_S`` or more after it, whatever either program has received: a long
program always progresses (tests/unit/sidecar/test_program_las.py states it in virtual
time). Across tenants nothing changes: the fairness policy (DRR) picks the tenant first,
so one tenant's many programs never take another tenant's share.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from weighbridge.sidecar.plugins import register

if TYPE_CHECKING:
    from weighbridge.sidecar.request import QueuedRequest

__all__ = [
    "PROGRAMS",
    "PROGRAM_HALF_TOKENS",
    "PROGRAM_MAX_DELAY_S",
    "ProgramLas",
    "program_delay_s",
]

# The starvation bound: a call is never passed by one arriving this long after it. Longer
# than the waits of a saturated queue, so least attained service decides there
# (benchmarks/RESULTS.md, program_ordering: 10 s left program completion where FIFO had it).
PROGRAM_MAX_DELAY_S = 30.0
# The attained service (computed tokens) delayed half the bound: an agent's first few calls
# (a system prompt the cache holds, tool outputs, answers) are told apart from long runs.
PROGRAM_HALF_TOKENS = 2048
# Programs whose service is remembered per scheduler; the least recently served go first (a
# forgotten program starts again at no service, as a client inventing ids would anyway:
# it is its own tenant's order that changes, never another's share).
PROGRAMS = 65_536


def program_delay_s(attained: int, max_delay_s: float = PROGRAM_MAX_DELAY_S,
                    half: int = PROGRAM_HALF_TOKENS) -> float:
    """How much later than its arrival a call of a program that has received ``attained``
    computed tokens is ordered: ``max_delay_s * a / (a + half)``, 0 for a new program and
    never ``max_delay_s`` or more."""
    if attained <= 0:
        return 0.0
    return max_delay_s * attained / (attained + half)


@register("ordering", "program_las")
class ProgramLas:
    """Least attained service per agent program (`programs.sources` names it; a fork-join
    family is one program), after priority and deadline: a tenant's calls of the programs
    that have received the fewest computed tokens (the prompt its engine computed, and the
    output) go first, so a tenant's short programs finish without waiting behind its long
    ones. Aged: a call is never passed by one of its tenant's that arrives 30 s or more
    after it (`PROGRAM_MAX_DELAY_S`), so every program progresses. A call naming no program
    is a program of one call. Tenants' shares are the fairness policy's, unchanged."""

    def __init__(self) -> None:
        # (tenant, program) -> computed tokens it has received; least recently served first.
        self._attained: OrderedDict[tuple[str, str], int] = OrderedDict()

    @staticmethod
    def rank(request: QueuedRequest) -> int:
        del request
        return 0

    def attained(self, tenant: str, program: str) -> int:
        return self._attained.get((tenant, program), 0)

    def delay_s(self, request: QueuedRequest) -> float:
        """The call's delay in its tenant's order: its program's service so far, aged."""
        if request.program is None:
            return 0.0
        return program_delay_s(self.attained(request.tenant, request.program))

    def served(self, request: QueuedRequest, tokens: int) -> None:
        """The call ended having cost its engine ``tokens`` computed tokens."""
        if request.program is None or tokens <= 0:
            return
        key = (request.tenant, request.program)
        self._attained[key] = self._attained.get(key, 0) + tokens
        self._attained.move_to_end(key)
        if len(self._attained) > PROGRAMS:
            self._attained.popitem(last=False)

    def __len__(self) -> int:
        return len(self._attained)
