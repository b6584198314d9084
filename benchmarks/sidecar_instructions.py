"""Sidecar instructions per streamed request: the CPU of issue 17's hot path, counted
deterministically, to judge a change by (docs/sidecar-performance.md).

``sidecar_overhead`` measures the sidecar's CPU per request in µs; on the shared 2-core VM
that figure moves ±20 % between runs of the same code, so a change of a few percent cannot be
told from noise. Callgrind (valgrind's instruction counter) counts the user-space
instructions a process executes, whatever else the machine is doing: four sidecar processes
of the same code gave 16-token rows within ±0.5 % and 1-token rows within ±1.5 % (a phase
holds a whole number of metrics polls, and the 1-token phases are short), so a ratio within
0.98-1.02 is no change. What it does not count: the kernel's share (the socket reads and
writes, epoll; a quarter of the sidecar's CPU on this VM), which the µs figure includes, and
the cost of a cache miss or a mispredicted branch (an instruction is an instruction).

Method, per sidecar configuration (``sidecar_overhead.CONFIGS``) and per checkout: one
emulator (``sidecar_overhead.ENGINE``), one sidecar started under ``valgrind
--tool=callgrind --instr-atstart=no`` (nothing counted until told), and for 16 then 1 output
tokens (``sidecar_overhead.BODY``'s request, ``max_tokens`` 16 or 1, streamed):

1. 20 warm-up requests (connection pools, the first scrapes, the interpreter's specialised
   code), not counted;
2. ``callgrind_control -i on``, N requests one at a time (one client connection, each
   response read to its end), ``-i off``, ``-d`` (a dump, which also zeroes the counters):
   the *requests phase*;
3. the same again for as long as the requests phase took, with no requests: the *idle phase*
   (metrics polls of the engine, the dispatch tick; under callgrind the polls are rarer than
   natively, because their period adapts to the scrape's measured duration);
4. net instructions per request = (requests phase - idle phase scaled to the same wall time)
   / N.

Per content chunk: the 16-token row minus the 1-token row, over 15. A streamed request is its
content chunks, a usage chunk (asked for by the sidecar, dropped again) and ``[DONE]``.

**A/B in the same run.** ``--against REV`` (in ``python -m benchmarks``: the environment
variable ``WEIGHBRIDGE_BENCH_AGAINST``) measures the same rows on a ``git worktree add
--detach`` of REV in a temporary directory (removed afterwards): its sidecar runs with the
worktree as its working directory and ``PYTHONPATH``, with the same interpreter, so ``python -m
weighbridge`` imports that checkout's code. The table then shows the ratio per row (this
checkout / REV). The configs, the engine and the client are this checkout's for both.

**This checkout** is a copy of the working tree taken when the run starts (tracked and
untracked files, not ignored ones; its sidecars run from the copy the same way), so a run
measures one version of the code even while someone edits or commits in the tree; the record
names it (HEAD, and the files with uncommitted changes).

``python -m benchmarks.sidecar_instructions [--quick] [--requests 100] [--against REV]
[--config NAME]`` (quick: 30 requests, the plain config only, a smoke check: same-code ratios
0.97-1.03 there; a direct run is not recorded unless ``--record``)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

from benchmarks import _results
from benchmarks._core import REPO, BenchContext, Benchmark, BenchResult, Table
from benchmarks.sidecar_overhead import BODY, CONFIGS, ENGINE, KEY, PLAIN, sidecar_config
from weighbridge.launch import ServerProcess, emulator_process, sidecar_process

REQUESTS = 100  # per row
QUICK_REQUESTS = 30
WARMUP_REQUESTS = 20  # per row, before counting
TOKENS = (16, 1)  # output tokens per request: the rows of each config
AGAINST_ENV = "WEIGHBRIDGE_BENCH_AGAINST"
# Python's start-up and the sidecar's imports run under valgrind's translation (not counted,
# but ~10x slower than natively).
STARTUP_TIMEOUT_S = 600.0
CONTROL_TIMEOUT_S = 120.0  # one callgrind_control command
REQUEST_TIMEOUT_S = 60.0
INSTALL_HINT = "apt-get install valgrind"
Log = Callable[[str], None]


def body(tokens: int) -> bytes:
    """``sidecar_overhead.BODY`` with ``max_tokens`` = ``tokens``."""
    return orjson.dumps({**orjson.loads(BODY), "max_tokens": tokens})


@dataclass(frozen=True, slots=True)
class Checkout:
    """The code a sidecar runs: a tree whose ``weighbridge`` package ``python -m weighbridge``
    imports (run from it, with it as ``PYTHONPATH``)."""

    label: str  # for the table: "this checkout" or the revision
    code: str  # which code: a commit, and any uncommitted changes
    root: Path


@dataclass(frozen=True, slots=True)
class Phase:
    instructions: int
    wall_s: float


@dataclass(frozen=True, slots=True)
class Row:
    config: str
    tokens: int
    requests: int
    busy: Phase
    idle: Phase
    content_chunks: float  # per request, as the client read them

    @property
    def idle_per_s(self) -> float:
        return self.idle.instructions / self.idle.wall_s

    @property
    def per_request(self) -> float:
        """Instructions per request, net of what the idle sidecar spends in the same time."""
        return (self.busy.instructions - self.idle_per_s * self.busy.wall_s) / self.requests


def tools() -> tuple[str, str]:
    """valgrind and callgrind_control (both in Debian's valgrind package)."""
    valgrind, control = shutil.which("valgrind"), shutil.which("callgrind_control")
    if valgrind is None or control is None:
        raise RuntimeError("sidecar_instructions needs valgrind's callgrind (valgrind and "
                           "callgrind_control on the PATH); on Debian or Ubuntu: "
                           f"{INSTALL_HINT}")
    return valgrind, control


def _version(argv: Sequence[str]) -> str:
    try:
        out = subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "version unknown"


def _git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                          check=True, timeout=120).stdout


# What the working tree's sidecar runs: everything tracked but these (the package's folders
# are symlinks at the top level: weighbridge/sidecar -> ../sidecar).
NOT_CODE = (":!tests", ":!benchmarks", ":!docs", ":!*.md")


def code_state() -> str:
    """HEAD and the uncommitted changes to the code a sidecar of the working tree imports."""
    head = _git("rev-parse", "--short", "HEAD").strip()
    changed = _git("diff", "HEAD", "--name-only", "--", ".", *NOT_CODE).split()
    new = _git("ls-files", "--others", "--exclude-standard", "--", "*.py", *NOT_CODE).split()
    if not changed and not new:
        return head
    digest = hashlib.sha256(_git("diff", "HEAD", "--", ".", *NOT_CODE).encode()).hexdigest()
    return (head + (f" with uncommitted changes to {', '.join(changed)} (diff sha256 "
                    f"{digest[:12]})" if changed else "")
            + (f", untracked {', '.join(new)}" if new else ""))


@contextlib.contextmanager
def snapshot() -> Iterator[Checkout]:
    """This checkout: a copy of the working tree as it is now (tracked and untracked files,
    not ignored ones) in a temporary directory, removed on the way out. The run measures one
    version of the code even while the tree is being edited or committed to."""
    code = code_state()
    directory = Path(tempfile.mkdtemp(prefix="weighbridge-snapshot-"))
    try:
        listed = _git("ls-files", "-z", "--cached", "--others", "--exclude-standard")
        for name in filter(None, listed.split("\0")):
            source, target = REPO / name, directory / name
            if not source.is_symlink() and not source.is_file():
                continue  # deleted, not yet staged
            target.parent.mkdir(parents=True, exist_ok=True)
            if source.is_symlink():  # weighbridge/sidecar -> ../sidecar and the like
                target.symlink_to(os.readlink(source))
            else:
                shutil.copy2(source, target)
        yield Checkout("this checkout", code, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def worktree(rev: str) -> Iterator[Checkout]:
    """A detached worktree of ``rev`` in a temporary directory, removed on the way out."""
    sha = _git("rev-parse", "--verify", "--end-of-options", f"{rev}^{{commit}}").strip()
    directory = Path(tempfile.mkdtemp(prefix="weighbridge-against-"))
    tree = directory / "tree"
    try:
        _git("worktree", "add", "--detach", str(tree), sha)
        label = sha[:7] if rev.startswith(sha[:7]) else f"{rev} ({sha[:7]})"
        yield Checkout(label, f"{sha[:10]} ({rev})", tree)
    finally:
        if tree.exists():
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO,
                           capture_output=True, check=False, timeout=120)
        shutil.rmtree(directory, ignore_errors=True)


def _imports_from(checkout: Checkout) -> None:
    """Check that a sidecar started for ``checkout`` imports that checkout's code (and not the
    editable install's, which points at this repository)."""
    env = {**os.environ, "PYTHONPATH": str(checkout.root)}
    out = subprocess.run([sys.executable, "-c", "import weighbridge.sidecar.app as m; "
                          "print(m.__file__)"], cwd=checkout.root, env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.strip()
    if not Path(out).resolve().is_relative_to(checkout.root.resolve()):
        raise RuntimeError(f"a sidecar run from {checkout.root} would import {out}")


def callgrind_sidecar(checkout: Checkout, engine_url: str, overlay: dict[str, object],
                      directory: Path, valgrind: str) -> ServerProcess:
    """``launch.sidecar_process`` for ``overlay`` run under callgrind, counting nothing until
    switched on, from ``checkout``; its dumps go to ``directory``."""
    plain = sidecar_process(sidecar_config(engine_url, overlay), name="instructions-sidecar",
                            config_dir=directory)
    return dataclasses.replace(
        plain,
        argv=[valgrind, "--tool=callgrind", "--instr-atstart=no",
              f"--callgrind-out-file={directory / 'callgrind.out'}", *plain.argv],
        cwd=checkout.root, env={"PYTHONPATH": str(checkout.root)},
        startup_timeout_s=STARTUP_TIMEOUT_S)


def _control(control: str, pid: int, *args: str) -> None:
    subprocess.run([control, *args, str(pid)], check=True, capture_output=True,
                   timeout=CONTROL_TIMEOUT_S)


def _dump_total(path: Path) -> int:
    """The instruction count of one callgrind dump (its ``totals:`` line, else
    ``summary:``)."""
    found: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("totals", "summary") and rest.split():
                found[key] = int(rest.split()[0])
    if not found:
        raise RuntimeError(f"no totals in callgrind dump {path}")
    return found.get("totals", found.get("summary", 0))


def phase(control: str, pid: int, directory: Path, action: Callable[[], None]) -> Phase:
    """Count ``action``'s instructions in the sidecar: instrumentation on, the action,
    instrumentation off, a dump (which zeroes the counters), its total."""
    before = set(directory.glob("callgrind.out*"))
    _control(control, pid, "-i", "on")
    start = time.monotonic()
    action()
    wall = time.monotonic() - start
    _control(control, pid, "-i", "off")
    _control(control, pid, "-d")
    dumps = sorted(set(directory.glob("callgrind.out*")) - before)
    if len(dumps) != 1:
        raise RuntimeError(f"expected one new callgrind dump in {directory}, found {dumps}")
    return Phase(_dump_total(dumps[0]), wall)


def send(client: httpx.Client, url: str, payload: bytes, n: int) -> int:
    """``n`` streamed requests one at a time, each read to its end; the content chunks (SSE
    events with generated text) read in all."""
    headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    chunks = 0
    for _ in range(n):
        response = client.post(url + "/v1/completions", content=payload, headers=headers)
        text = response.read()
        if response.status_code != 200 or not text.rstrip().endswith(b"data: [DONE]"):
            raise RuntimeError(f"request failed: {response.status_code} {text[:300]!r}")
        chunks += sum(1 for line in text.splitlines()
                      if line.startswith(b"data: {") and b'"text":""' not in line
                      and b'"choices":[]' not in line)
    return chunks


def measure_checkout(checkout: Checkout, config: str, engine_url: str, requests: int,
                     valgrind: str, control: str, log: Log) -> list[Row]:
    """The rows of one config (16 and 1 output tokens) in one sidecar process of
    ``checkout``."""
    _imports_from(checkout)
    directory = Path(tempfile.mkdtemp(prefix="weighbridge-callgrind-"))
    rows = []
    try:
        with callgrind_sidecar(checkout, engine_url, CONFIGS[config], directory,
                               valgrind) as sidecar, \
                httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
            assert sidecar.pid is not None
            log(f"  {checkout.label}: sidecar up under callgrind in {sidecar.startup_s:.0f} s")
            for tokens in TOKENS:
                payload = body(tokens)
                send(client, sidecar.url, payload, WARMUP_REQUESTS)
                chunks = 0

                def requests_phase(payload: bytes = payload) -> None:
                    nonlocal chunks
                    chunks = send(client, sidecar.url, payload, requests)

                busy = phase(control, sidecar.pid, directory, requests_phase)
                idle = phase(control, sidecar.pid, directory,
                             functools.partial(time.sleep, busy.wall_s))
                row = Row(config, tokens, requests, busy, idle, chunks / requests)
                rows.append(row)
                log(f"  {checkout.label}, {tokens} tokens: {row.per_request / 1e3:,.0f}k "
                    f"instructions per request (requests phase {busy.instructions / 1e6:.1f}M "
                    f"in {busy.wall_s:.1f} s, idle {idle.instructions / 1e6:.1f}M in "
                    f"{idle.wall_s:.1f} s)")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return rows


def _k(x: float) -> str:
    return f"{x / 1e3:,.0f}"


def per_chunk(rows: Sequence[Row], config: str) -> float:
    by = {r.tokens: r for r in rows if r.config == config}
    hi, lo = max(TOKENS), min(TOKENS)
    return (by[hi].per_request - by[lo].per_request) / (hi - lo)


def measure(configs: Sequence[str], requests: int, against: str | None, log: Log) -> BenchResult:
    valgrind, control = tools()
    mine: list[Row] = []
    other: list[Row] = []
    with contextlib.ExitStack() as stack:
        ours = stack.enter_context(snapshot())
        log(f"callgrind: {len(configs)} config(s) x {TOKENS} output tokens, {requests} "
            f"requests per row, on {ours.code}" + (f" against {against}" if against else ""))
        theirs = stack.enter_context(worktree(against)) if against else None
        flags: dict[str, Any] = dict(ENGINE)  # the emulator's options, of mixed types
        engine = stack.enter_context(emulator_process(name="instructions-engine", **flags))
        for config in configs:
            log(f"{config}:")
            mine += measure_checkout(ours, config, engine.url, requests, valgrind, control,
                                     log)
            if theirs is not None:
                other += measure_checkout(theirs, config, engine.url, requests, valgrind,
                                          control, log)
    return result(ours, mine, (theirs, other) if theirs else None, configs, requests,
                  valgrind)


def result(ours: Checkout, mine: list[Row], against: tuple[Checkout, list[Row]] | None,
           configs: Sequence[str], requests: int, valgrind: str) -> BenchResult:
    theirs, other = against if against else (None, None)
    summary = []
    for config in configs:
        by = {r.tokens: r for r in mine if r.config == config}
        line = (f"`{config}`: **{_k(by[16].per_request)}k instructions per streamed request** "
                f"of 16 tokens, {_k(by[1].per_request)}k of 1 token: "
                f"**{_k(per_chunk(mine, config))}k per content chunk**")
        if theirs is not None and other is not None:
            line += f" ({theirs.label}: {_k(per_chunk(other, config))}k per chunk)"
        summary.append(line + ".")
    columns = ["config", "output tokens", "requests"]
    rows: list[tuple[str, ...]] = []
    if theirs is None or other is None:
        columns += ["k instructions / request (net of idle)", "idle k instructions / s",
                    "content chunks / request"]
        rows = [(r.config, str(r.tokens), str(r.requests), f"**{_k(r.per_request)}**",
                 _k(r.idle_per_s), f"{r.content_chunks:g}") for r in mine]
    else:
        columns += [f"k instructions / request, {ours.label}", f"same, {theirs.label}",
                    "ratio (this / that)", f"idle k instructions / s, {ours.label}",
                    f"same, {theirs.label}"]
        for a, b in zip(mine, other, strict=True):
            rows.append((a.config, str(a.tokens), str(a.requests), _k(a.per_request),
                         _k(b.per_request), f"**{a.per_request / b.per_request:.3f}**",
                         _k(a.idle_per_s), _k(b.idle_per_s)))
        ratios = ", ".join(f"{a.config} {a.tokens} tok {a.per_request / b.per_request:.3f}"
                           for a, b in zip(mine, other, strict=True))
        summary.append(f"This checkout against {theirs.label}, instructions per request "
                       f"(this / that): {ratios}.")
    return BenchResult(
        summary=summary,
        tables=[Table(tuple(columns), rows)],
        notes=[
            "User-space instructions of the sidecar's process (all threads) counted by "
            "callgrind while the client sends the requests one at a time, minus what the "
            "same process spends idle for the same wall time just after; warm-up requests "
            "not counted. The machine's load does not move them: four sidecar processes of "
            "the same code gave 16-token rows within ±0.5 %, 1-token rows within ±1.5 % "
            "(whole metrics polls per phase; the 1-token phases are short), so read a ratio "
            "within 0.98-1.02 as no change. The kernel's share of the sidecar's CPU (socket "
            "reads and writes, epoll: about a quarter of it on this VM) is not counted, so "
            "this is not the µs figure of sidecar_overhead.",
            "Idle instructions per second are under callgrind's slowdown: the metrics poll's "
            "period adapts to the scrape's measured duration (up to 500 ms), so natively the "
            "sidecar polls more often than here.",
            f"Per content chunk: (16-token row - 1-token row) / 15. A request is "
            f"sidecar_overhead's (32-token prompt, ignore_eos, stream) with max_tokens 16 or "
            f"1; {WARMUP_REQUESTS} warm-up requests per row; engine "
            f"sidecar_overhead.ENGINE.",
            f"{_version([valgrind, '--version'])}, run as `valgrind --tool=callgrind "
            "--instr-atstart=no`.",
        ],
        passed=None,
        setup=[f"this checkout: {ours.code}"
               + (f"; against: {theirs.code}" if theirs else "")
               + f"; {requests} requests per row"],
    )


def run(ctx: BenchContext) -> BenchResult:
    configs = [PLAIN] if ctx.quick else list(CONFIGS)
    requests = QUICK_REQUESTS if ctx.quick else REQUESTS
    return measure(configs, requests, os.environ.get(AGAINST_ENV) or None, ctx.log)


BENCHMARK = Benchmark("sidecar_instructions",
                      "sidecar: instructions per streamed request (callgrind)", run)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sidecar_instructions",
                                     description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_REQUESTS} requests per row, the plain config only")
    parser.add_argument("--requests", type=int, default=None,
                        help=f"requests per row (default {REQUESTS}; quick {QUICK_REQUESTS})")
    parser.add_argument("--against", metavar="REV", default=None,
                        help="also measure git revision REV (a temporary worktree) and show "
                             "the ratio per row")
    parser.add_argument("--config", choices=list(CONFIGS), action="append", default=None,
                        help="a sidecar config (repeatable; default: all, quick: the plain "
                             "config)")
    parser.add_argument("--record", action="store_true",
                        help="write the result into benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    configs = args.config or ([PLAIN] if args.quick else list(CONFIGS))
    requests = args.requests or (QUICK_REQUESTS if args.quick else REQUESTS)
    standalone = _results.StandaloneRun([os.path.relpath(sys.executable, REPO), "-m",
                                         "benchmarks.sidecar_instructions", *argv])
    result = measure(configs, requests, args.against,
                     lambda line: print(line, file=sys.stderr, flush=True))
    section = standalone.section(BENCHMARK, result)
    print(section)
    if args.record:
        _results.write_section(BENCHMARK.name, section)
        print(f"recorded in {_results.RESULTS_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
