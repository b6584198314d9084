"""Sidecar replicas sharing their state through Redis, as the affinity tests drive them
(tests/integration/sidecar/test_replicas_prefix.py, test_replicas_programs.py): rounds of
calls, each round once every replica has heard of the last, and how many later calls went
back to the backend of their first."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from tests.support.ledger import admin_state
from tests.support.wait import wait_for

Served = dict[tuple[int, int], str]  # (conversation or program, round) -> its backend


def learned_everything(urls: Sequence[str], sent: str, learned: str) -> bool:
    """Every replica has learned everything the others sent (the stream read to its end):
    ``sent`` and ``learned`` name the counters in each replica's /admin/state."""
    states = [admin_state(url)["state"] for url in urls]
    counts = [s[sent] for s in states]
    return all(s[learned] == sum(counts) - counts[r] for r, s in enumerate(states))


Round = Callable[[int], Coroutine[Any, Any, dict[int, str]]]  # who was served, by which backend


def play_rounds(urls: Sequence[str], rounds: int, round_: Round, grow: Callable[[int], None],
                sent: str, learned: str) -> Served:
    """``rounds`` rounds of ``round_`` (each: who was served, and by which backend), each
    once every replica has learned the last (what a client's think time gives them; a sync
    is 50 ms); ``grow`` each served one's prompt after its answer, as the next call
    resends the whole history."""
    served: Served = {}
    for k in range(rounds):
        wait_for(lambda: learned_everything(urls, sent, learned) or None, 10,
                 what="every replica learned what the others sent")
        for who, backend in asyncio.run(round_(k)).items():
            served[(who, k)] = backend
            grow(who)
    return served


def at_home(served: Served, count: int, rounds: int) -> tuple[int, int]:
    """How many of the later calls went to their first call's backend, of how many."""
    later = [(who, k) for who in range(count) for k in range(1, rounds)]
    return sum(served[(who, k)] == served[(who, 0)] for who, k in later), len(later)
