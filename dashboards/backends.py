"""Backends: how loaded is each vLLM engine, and what does admission control do about it?

Most panels read the sidecar's view of each backend (label ``backend``, its configured
name), which exists wherever the sidecar runs. The engine panels read vLLM's own
``/metrics`` (``vllm:*``); for ``$backend`` to select them, give each engine's scrape target
a ``backend`` label equal to its name in the sidecar's configuration, as
deploy/compose/prometheus.yml does (with All selected, they show without it).
"""

from __future__ import annotations

from weighbridge.dashboards.model import Dashboard, Panel, Query, Row, Threshold
from weighbridge.dashboards.promql import by, quantile, rate
from weighbridge.dashboards.variables import BACKEND_MATCH, STANDARD

__all__ = ["BACKENDS"]


def _gauge(metric: str) -> str:
    return by("backend", f"{metric}{{{BACKEND_MATCH}}}", "max")


RUNNING_WAITING = Panel(
    "vLLM running and waiting requests",
    "vllm:num_requests_running and vllm:num_requests_waiting of each backend, as the "
    "sidecar last scraped them. Admission keeps waiting near its target (default 2).",
    "short",
    (Query(_gauge("weighbridge_backend_running_requests"), "{{backend}} running"),
     Query(_gauge("weighbridge_backend_waiting_requests"), "{{backend}} waiting")),
    min=0)

KV_CACHE = Panel(
    "KV-cache usage",
    "Share of KV-cache blocks in use (vllm:kv_cache_usage_perc); near 1 the engine preempts.",
    "percentunit",
    (Query(_gauge("weighbridge_backend_kv_cache_usage_ratio"), "{{backend}}"),),
    min=0, max=1, thresholds=(Threshold(0.9, "orange"),))

PREEMPTIONS = Panel(
    "Preemptions",
    "Sequences preempted per second (KV cache ran out; their work is recomputed).",
    "short",
    (Query(by("backend", rate("weighbridge_backend_preemptions_total", BACKEND_MATCH)),
           "{{backend}}"),),
    min=0)

HOLDS = Panel(
    "Admission holds by reason",
    "Dispatch attempts admission control held per second: inflight_cap, fallback_cap "
    "(stale metrics), backend_waiting, decode_slow, headroom, prefill_backlog; "
    "prefill_budget and no_healthy_backend under backend 'none'.",
    "short",
    (Query(by("backend, reason", rate("weighbridge_admission_holds_total",
                                      'backend=~"$backend|none"')),
           "{{backend}} {{reason}}"),),
    min=0, stack=True)

HEALTH = Panel(
    "Health",
    "1 while the sidecar routes to the backend (health probe passing, no failure since).",
    "none",
    (Query(f"max by (backend) (weighbridge_backend_healthy{{{BACKEND_MATCH}}})",
           "{{backend}}", instant=True),),
    type="stat", width=8, height=5,
    mappings=(("0", "unhealthy", "red"), ("1", "healthy", "green")),
    thresholds=(Threshold(1, "green"),))

METRICS_AGE = Panel(
    "Age of the backend's metrics",
    "Seconds since the sidecar's last good scrape of each backend; beyond metrics_stale_ms "
    "admission falls back to a fixed concurrency cap.",
    "s",
    (Query(_gauge("weighbridge_backend_metrics_age_seconds"), "{{backend}}"),
     Query(by("backend", rate("weighbridge_backend_scrape_errors_total", BACKEND_MATCH)),
           "{{backend}} scrape errors/s")),
    width=8, height=5, min=0, thresholds=(Threshold(1, "orange"),))

INFLIGHT = Panel(
    "Sidecar requests in flight against the admission cap",
    "Requests the sidecar has in flight at each backend and the cap in force.",
    "short",
    (Query(_gauge("weighbridge_backend_inflight_requests"), "{{backend}} in flight"),
     Query(_gauge("weighbridge_backend_inflight_cap"), "{{backend}} cap")),
    width=8, height=5, min=0)

DECODE_SPEED = Panel(
    "Per-sequence decode speed",
    "Generation tokens per second per running sequence between the sidecar's last two "
    "scrapes; admission holds new work below min_decode_tokens_per_s (default 7).",
    "suffix: tok/s",
    (Query(_gauge("weighbridge_backend_decode_tokens_per_second_per_sequence"), "{{backend}}"),),
    min=0, thresholds=(Threshold(7, "orange"),))

THROUGHPUT = Panel(
    "Token throughput per backend",
    "Prompt and generation tokens per second each backend processed.",
    "suffix: tok/s",
    (Query(by("backend", rate("weighbridge_backend_prompt_tokens_total", BACKEND_MATCH)),
           "{{backend}} prompt"),
     Query(by("backend", rate("weighbridge_backend_generation_tokens_total", BACKEND_MATCH)),
           "{{backend}} generation")),
    min=0, stack=True)

ENGINE_TTFT = Panel(
    "Engine TTFT and queue time p99 (vLLM's own histograms)",
    "Arrival at the engine to first token and time waiting in the engine's queue, from "
    "vllm:time_to_first_token_seconds and vllm:request_queue_time_seconds. The difference "
    "to the sidecar's TTFT is the wait the sidecar moved upstream, where it can be ordered.",
    "s",
    (Query(quantile(0.99, "vllm:time_to_first_token_seconds", "backend, instance",
                    BACKEND_MATCH), "{{backend}}{{instance}} TTFT"),
     Query(quantile(0.99, "vllm:request_queue_time_seconds", "backend, instance",
                    BACKEND_MATCH), "{{backend}}{{instance}} queue")),
    min=0)

ENGINE_BATCH = Panel(
    "Engine batch (vLLM's own gauges)",
    "vllm:num_requests_running and vllm:num_requests_waiting straight from each engine's "
    "/metrics, at Prometheus' scrape interval.",
    "short",
    (Query(by("backend, instance", f"vllm:num_requests_running{{{BACKEND_MATCH}}}"),
           "{{backend}}{{instance}} running"),
     Query(by("backend, instance", f"vllm:num_requests_waiting{{{BACKEND_MATCH}}}"),
           "{{backend}}{{instance}} waiting")),
    min=0)

CONFIG_VERSIONS = Panel(
    "Configuration version by sidecar",
    "The version (a content hash) of the configuration each sidecar replica runs "
    "(weighbridge_config_info); after a reload every replica should show the same one.",
    "none",
    (Query("max by (instance, version) (weighbridge_config_info)", "{{instance}} {{version}}",
           instant=True),),
    type="stat", width=8, height=5)

CONFIG_SKEW = Panel(
    "Configuration versions in force",
    "Distinct configuration versions across the sidecar replicas: 1 when they agree, more "
    "while a reload is rolling through them or one was refused (reloads refused, beside it).",
    "none",
    (Query("count(count by (version) (weighbridge_config_info))", "versions", instant=True),
     Query('sum(increase(weighbridge_config_reloads_total{result="refused"}[$__range]))',
           "reloads refused", instant=True)),
    type="stat", width=8, height=5, thresholds=(Threshold(2, "orange"),))

CONFIG_LOADED = Panel(
    "Configuration loaded at",
    "When each sidecar replica put its configuration in force (start-up or the last "
    "reload; weighbridge_config_loaded_timestamp_seconds).",
    "dateTimeAsIso",
    (Query("max by (instance) (weighbridge_config_loaded_timestamp_seconds) * 1000",
           "{{instance}}", instant=True),),
    type="stat", width=8, height=5)

BACKENDS = Dashboard(
    uid="weighbridge-backends",
    title="weighbridge / Backends",
    description="vLLM load (running, waiting, KV cache, preemptions), admission holds and "
                "health, per backend.",
    variables=STANDARD,
    rows=(
        Row("Health", (HEALTH, METRICS_AGE, INFLIGHT)),
        Row("Configuration", (CONFIG_VERSIONS, CONFIG_SKEW, CONFIG_LOADED)),
        Row("Engine load", (RUNNING_WAITING, KV_CACHE, PREEMPTIONS, DECODE_SPEED)),
        Row("Admission and throughput", (HOLDS, THROUGHPUT)),
        Row("Engines' own metrics", (ENGINE_TTFT, ENGINE_BATCH)),
    ),
)
