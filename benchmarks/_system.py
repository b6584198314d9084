"""CPU pinning, per-process CPU time and the machine note that goes beside every result."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Pinning:
    """Which core the server under test and the load generator get (``None``: unpinned)."""

    server: int | None
    client: int | None

    def describe(self) -> str:
        if self.server is None:
            return "unpinned (fewer than 2 usable cores, or no taskset)"
        return f"server on core {self.server} (taskset), load generator on core {self.client}"


def choose_pinning(sample_s: float = 0.5) -> Pinning:
    """Two different cores when there are two: the server must not compete with its own load
    generator, or we would measure the client's cost as the server's. On a shared machine
    the server gets the core that was idlest over ``sample_s``, the client the next one."""
    if not hasattr(os, "sched_getaffinity") or shutil.which("taskset") is None:
        return Pinning(None, None)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return Pinning(None, None)
    before = _core_times()
    time.sleep(sample_s)
    after = _core_times()

    def busy(core: int) -> float:
        (b_busy, b_all), (a_busy, a_all) = before.get(core, (0, 0)), after.get(core, (0, 1))
        return (a_busy - b_busy) / max(a_all - b_all, 1)

    ranked = sorted(cores, key=busy)
    return Pinning(ranked[0], ranked[1])


def _core_times() -> dict[int, tuple[int, int]]:
    """Per core: (busy jiffies, all jiffies) from /proc/stat; empty where unavailable."""
    out: dict[int, tuple[int, int]] = {}
    with contextlib.suppress(OSError), open("/proc/stat") as f:
        for line in f:
            name, *values = line.split()
            if name.startswith("cpu") and name != "cpu":
                ticks = [int(v) for v in values[:8]]
                idle = ticks[3] + ticks[4]  # idle + iowait
                out[int(name[3:])] = (sum(ticks) - idle, sum(ticks))
    return out


def pinned_argv(argv: Sequence[str], core: int | None) -> list[str]:
    # taskset execs the command, so the child's pid is the server's own (for CPU accounting).
    return ["taskset", "-c", str(core), *argv] if core is not None else list(argv)


@contextlib.contextmanager
def pin_this_thread(core: int | None) -> Iterator[None]:
    """Pin the calling thread (the load generator's event loop) for the block."""
    if core is None or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@dataclass(frozen=True, slots=True)
class SchedTimes:
    """CPU time and run-queue wait (runnable but not running) of a process or thread."""

    cpu_s: float
    wait_s: float
    slices: int = 0  # times it was put on a core: wait_s / slices is the mean delay per wakeup

    def __sub__(self, other: SchedTimes) -> SchedTimes:
        return SchedTimes(self.cpu_s - other.cpu_s, self.wait_s - other.wait_s,
                          self.slices - other.slices)


def process_sched(pid: int) -> SchedTimes:
    """Summed over ``pid``'s threads, from Linux schedstat (nanoseconds, unlike the 10 ms
    ticks of /proc/PID/stat, which are too coarse for second-long windows). The wait tells
    a noisy neighbour from a slow server. Zeros where unavailable."""
    cpu = wait = slices = 0
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, IndexError, ValueError), \
                    open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                fields = f.read().split()
                cpu += int(fields[0])
                wait += int(fields[1])
                slices += int(fields[2])
    return SchedTimes(cpu / 1e9, wait / 1e9, slices)


def group_pids(pgid: int) -> list[int]:
    """Every process of process group ``pgid`` (a server started in its own session: vLLM's
    API server and engine core, a proxy's workers)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError), \
                open(f"/proc/{entry}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:  # after ")": state, ppid, pgrp
                pids.append(int(entry))
    return pids


def group_sched(pgid: int) -> SchedTimes:
    """``process_sched`` summed over the processes of group ``pgid``."""
    cpu = wait = 0.0
    slices = 0
    for pid in group_pids(pgid):
        t = process_sched(pid)
        cpu += t.cpu_s
        wait += t.wait_s
        slices += t.slices
    return SchedTimes(cpu, wait, slices)


def thread_sched() -> SchedTimes:
    """The calling thread's CPU time and run-queue wait."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            fields = f.read().split()
        return SchedTimes(int(fields[0]) / 1e9, int(fields[1]) / 1e9)
    except (OSError, IndexError, ValueError):
        return SchedTimes(time.thread_time(), 0.0)


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def machine_note() -> str:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"nproc {usable} ({cpu_model()}), {platform.system()} {platform.release()}, "
            f"Python {sys.version.split()[0]}")
