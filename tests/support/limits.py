"""Limits and shares judged through several front replicas: a hammer that sends a tenant's
requests at a rate, round robin over the fronts' URLs, the bound a global bucket allows over
the window it measured, and a closed-loop client that keeps a tenant backlogged."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import Counter
from dataclasses import dataclass

import httpx

from tests.support.ledger import Ledger
from tests.support.stack import auth, completion


def figures(test: str, **values: object) -> None:
    """The test's measured figures, one line for the benchmarks that repeat it to collect
    (benchmarks/replicas.py's FIGURES)."""
    print("\nFIGURES " + json.dumps({"test": test, **values}))


def ledger_figures(ledgers: list[Ledger]) -> list[dict[str, int]]:
    """Each front's ledger (cumulative over the module's tests) and what does not add up
    (``settled`` has asserted 0)."""
    return [{"arrived": lg.arrived, "completed": lg.completed, "rejected": lg.rejected_total,
             "cancelled": lg.cancelled, "failed": lg.failed,
             "unbalanced": lg.arrived - (lg.completed + lg.rejected_total + lg.cancelled
                                         + lg.failed + lg.queued + lg.dispatched)}
            for lg in ledgers]


@dataclass(frozen=True)
class Window:
    """When a hammer's requests can have been admitted, as the client saw it."""

    send_s: float  # first send to last send
    first_answer_s: float  # first send to the first answer: the latest the first arrived
    drain_s: float  # last send to the last answer: the latest the last was admitted

    def refill_s(self) -> tuple[float, float]:
        """The least and the most time the limits refilled while requests arrived: the
        replicas saw the first request at most ``first_answer_s`` after it was sent and the
        last at the earliest when it was sent; they admitted the last at the latest by its
        answer. On a quiet machine both are the send window."""
        return max(0.0, self.send_s - self.first_answer_s), self.send_s + self.drain_s


async def hammer(urls: list[str], key: str, rate: float, duration_s: float,
                 body: dict[str, object]) -> tuple[Counter[int], Window]:
    """``rate`` requests a second for ``duration_s``, round-robin over ``urls``; the statuses,
    and when they were sent and answered."""
    statuses: Counter[int] = Counter()
    answered: list[float] = []
    targets = itertools.cycle(urls)
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=200)) as c:
        async def one(url: str) -> None:
            response = await c.post(url + "/v1/completions", json=body, headers=auth(key))
            answered.append(time.monotonic())
            statuses[response.status_code] += 1

        start = time.monotonic()
        tasks = []
        n = int(rate * duration_s)
        for i in range(n):
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(next(targets))))
        last_send = time.monotonic()
        await asyncio.gather(*tasks)
    return statuses, Window(last_send - start, min(answered) - start, max(answered) - last_send)


def assert_within_the_limit(admitted: int, capacity: float, per_s: float,
                            window: Window) -> None:
    """The bucket's whole ``capacity`` at once, then its refill at ``per_s`` while requests
    arrived: once, not per replica. 2% of slack beyond the window's bounds for the replicas'
    sync (every 50 ms, so a refill step or two)."""
    least, most = window.refill_s()
    low, high = capacity + per_s * least, capacity + per_s * most
    assert low * 0.98 <= admitted <= high * 1.02, (admitted, low, high, window)


async def closed_loop(client: httpx.AsyncClient, url: str, key: str, until: float,
                      served: list[tuple[float, int]], output: int, prompt_tokens: int
                      ) -> None:
    """One client: a request, its answer, the next, until ``until``; (end time, output
    tokens) of each answer."""
    while time.monotonic() < until:
        response = await client.post(url + "/v1/completions", headers=auth(key),
                                     json=completion(output, prompt_tokens=prompt_tokens))
        if response.status_code == 200:
            served.append((time.monotonic(), response.json()["usage"]["completion_tokens"]))
