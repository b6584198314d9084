"""Reading a vLLM server's ``/metrics``: the few series admission control and routing need,
as one typed sample (``BackendSample``: the scrape contract every reader of a scrape takes,
the sidecar's admission gate, shape learner and prefix index, and the simulator's engines).

A full Prometheus parse of vLLM's exposition (≈50 KB, 200 families) costs ≈10 ms of event-loop
time; scanning lines for the handful of names we need costs a fraction of that, so the
sidecar can poll every backend several times a second without stalling its relays.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# Sample name -> field of BackendSample. Values are summed over label sets (several engines
# or models behind one server add up).
_WANTED = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:generation_tokens_total": "generation_tokens_total",
    "vllm:prompt_tokens_total": "prompt_tokens_total",
    "vllm:num_preemptions_total": "preemptions_total",
    "vllm:request_queue_time_seconds_sum": "queue_time_sum",
    "vllm:request_queue_time_seconds_count": "queue_time_count",
    "vllm:prefix_cache_queries_total": "prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits_total",
}
# An info gauge whose *labels* carry the KV cache's shape (vLLM's CacheConfig, and the
# emulator's copy of it): the blocks of the whole cache and the tokens per block.
_CACHE_INFO = "vllm:cache_config_info"
_CACHE_LABELS = {"num_gpu_blocks": "kv_blocks", "block_size": "block_size"}


class ScrapeError(ValueError):
    """The exposition lacks the series admission control needs, or is not an exposition."""


@dataclass(frozen=True, slots=True)
class BackendSample:
    """One scrape of one backend. ``at_s`` is when the scrape was *sent* (the sidecar's
    monotonic clock): dispatches after it are certainly not in it. A field the exposition
    lacks is None (a counter: 0)."""

    at_s: float
    waiting: float  # vllm:num_requests_waiting
    running: float  # vllm:num_requests_running
    kv_cache_usage: float | None = None  # vllm:kv_cache_usage_perc, 0..1
    generation_tokens_total: float | None = None  # vllm:generation_tokens_total (counter)
    prompt_tokens_total: float = 0.0
    preemptions_total: float = 0.0
    # Time requests spent in the engine's waiting queue (a histogram's sum and count): the
    # engine's own word on whether it is saturated. None when not exported.
    queue_time_sum: float | None = None
    queue_time_count: float | None = None
    # vllm:cache_config_info's num_gpu_blocks and block_size (summed blocks over engines),
    # None when the server does not export them.
    kv_blocks: int | None = None
    block_size: int | None = None
    # Its enable_prefix_caching label; None when not exported.
    prefix_caching: bool | None = None
    # The prefix cache's lookups and hits, in prompt tokens, counted when the engine admits
    # a request (vllm:prefix_cache_queries_total, _hits_total); None when not exported
    # (vLLM run with --disable-log-stats, or older than the v1 engine).
    prefix_cache_queries_total: float | None = None
    prefix_cache_hits_total: float | None = None
    # How long the scrape took, request sent to body read, on the sidecar's clock; None
    # where no one timed it. The engine's API server spends about this much serving one
    # scrape, in time it does not spend streaming tokens (sidecar.admission: the poll
    # period keeps scrapes to a small share of it).
    scrape_s: float | None = None


def _cache_labels(line: str, found: dict[str, int]) -> None:
    """Add vllm:cache_config_info's num_gpu_blocks (summed over engines) and block_size (the
    largest: one block size per server in practice) from one sample line."""
    caching = re.search(r'[{,]\s*enable_prefix_caching="(True|False)"', line)
    if caching is not None:
        found["prefix_caching"] = int(caching.group(1) == "True")
    for label, field in _CACHE_LABELS.items():
        match = re.search(r'[{,]\s*' + label + r'="(\d+)"', line)
        if match is None:
            continue
        value = int(match.group(1))
        if field == "kv_blocks":
            found[field] = found.get(field, 0) + value
        else:
            found[field] = max(found.get(field, 0), value)


def _sample_line(line: str, values: dict[str, float], cache: dict[str, int]) -> None:
    """Add one exposition line that starts with a wanted name."""
    brace = line.find("{")
    space = line.find(" ")
    if space < 0:
        return
    name = line[:brace] if 0 <= brace < space else line[:space]
    if name == _CACHE_INFO:
        _cache_labels(line, cache)
        return
    field = _WANTED.get(name)
    if field is None:
        return  # a longer name that starts with a wanted one
    # The value follows the label set (which may contain spaces inside quotes).
    rest = line[line.rfind("}") + 1:] if brace >= 0 else line[space:]
    parts = rest.split()
    if not parts:
        raise ScrapeError(f"no value on line {line[:80]!r}")
    try:
        value = float(parts[0])
    except ValueError:
        raise ScrapeError(f"bad value on line {line[:80]!r}") from None
    if math.isnan(value):
        raise ScrapeError(f"NaN on line {line[:80]!r}")
    values[field] = values.get(field, 0.0) + value


# Each wanted name is looked up with str.find (C speed over the ~30 KB exposition) instead of
# splitting its few hundred lines, then its family's lines are read from there to the next
# comment line: the exposition format keeps a family's samples together after its HELP and
# TYPE. About a tenth of the line-by-line scan's cost (docs/sidecar-performance.md: the
# sidecar scrapes each backend several times a second).
_NAMES = (*_WANTED, _CACHE_INFO)


def parse_vllm_metrics(text: str, at_s: float) -> BackendSample:
    values: dict[str, float] = {}
    cache: dict[str, int] = {}
    if "\r" in text:
        text = text.replace("\r\n", "\n")
    text = "\n" + text
    for name in _NAMES:
        key = "\n" + name
        at = text.find(key)
        # The name's own first sample, not one of a longer name it begins (name_foo).
        while at >= 0 and text[at + len(key):at + len(key) + 1] not in ("{", " "):
            at = text.find(key, at + len(key))
        while at >= 0:
            start = at + 1
            end = text.find("\n", start)
            if end < 0:
                end = len(text)
            line = text[start:end]
            if line.startswith(name):
                _sample_line(line, values, cache)
            elif line.startswith("#"):
                break  # the next family
            at = end if end < len(text) else -1
    missing = [f for f in ("waiting", "running", "generation_tokens_total") if f not in values]
    if missing:
        raise ScrapeError(f"metrics lack {', '.join(missing)}")
    return BackendSample(
        at_s=at_s,
        waiting=values["waiting"],
        running=values["running"],
        kv_cache_usage=values.get("kv_cache_usage", 0.0),
        generation_tokens_total=values["generation_tokens_total"],
        prompt_tokens_total=values.get("prompt_tokens_total", 0.0),
        preemptions_total=values.get("preemptions_total", 0.0),
        queue_time_sum=values.get("queue_time_sum"),
        queue_time_count=values.get("queue_time_count"),
        kv_blocks=cache.get("kv_blocks") or None,
        block_size=cache.get("block_size") or None,
        prefix_caching=bool(cache["prefix_caching"]) if "prefix_caching" in cache else None,
        prefix_cache_queries_total=values.get("prefix_cache_queries_total"),
        prefix_cache_hits_total=values.get("prefix_cache_hits_total"),
    )
