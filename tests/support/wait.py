"""Waiting on a condition with a deadline: the only way tests synchronise with processes
(never a fixed sleep)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


def wait_for(predicate: Callable[[], Any], timeout_s: float = 5.0, interval_s: float = 0.05,
             what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns something truthy (returned); bounded."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


async def await_for(predicate: Callable[[], Any], timeout_s: float = 5.0,
                    interval_s: float = 0.05, what: str = "condition") -> Any:
    """``wait_for`` for async tests (the predicate is sync and runs in a thread)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await asyncio.to_thread(predicate)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(interval_s)
