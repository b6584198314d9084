"""The emulator's Prometheus metrics, under vLLM's own names, types, labels and buckets, so a
dashboard or an admission controller cannot tell it from vLLM.

The engine's counters are the step model's own (``StepModel.counters``,
emulator/counters.py), rendered at each scrape; only the per-request and per-step latency
histograms, which the virtual-time engines do not export, are observed here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from weighbridge.emulator.counters import REQUEST_LATENCY_BUCKETS, EngineCounters
from weighbridge.emulator.engine import EngineConfig, Sequence, StepModel, StepResult

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
STEP_LAG_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


def one_two_five_buckets(maximum: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``maximum``, as vLLM's token-count histograms."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > maximum:
                return tuple(out)
            out.append(float(value))
        exponent += 1


def cache_config_labels(config: EngineConfig, kv_bytes_per_token: int,
                        num_gpu_blocks_override: int | None,
                        kv_cache_memory_bytes: int | None) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info`` that describe the KV cache's size, as vLLM
    0.32 spells them (what an admission controller reads to learn the engine's capacity).
    vLLM exports many more configuration labels; these are the ones the emulator models."""
    tokens = config.kv_capacity_tokens
    memory = kv_cache_memory_bytes
    if memory is None and kv_bytes_per_token:
        memory = tokens * kv_bytes_per_token
    return {
        "block_size": str(config.block_size),
        "num_gpu_blocks": str(config.num_kv_blocks),
        "num_gpu_blocks_override": str(num_gpu_blocks_override),
        "kv_cache_memory_bytes": str(memory),
        "kv_cache_size_tokens": str(tokens),
        # As vLLM: how many max_model_len requests the cache holds at once.
        "kv_cache_max_concurrency": str(tokens / config.max_model_len),
        "enable_prefix_caching": str(config.enable_prefix_caching),
        "cache_dtype": "auto",
    }


class EngineMetrics:
    def __init__(self, model: StepModel, model_name: str, engine: str = "0", *,
                 num_gpu_blocks_override: int | None = None,
                 kv_cache_memory_bytes: int | None = None,
                 max_loras: int | None = None) -> None:
        """``max_loras``: LoRA is enabled (vLLM's --enable-lora), with this --max-loras."""
        self.registry = CollectorRegistry(auto_describe=True)
        self._model = model
        config: EngineConfig = model.config
        labels = ("model_name", "engine")
        values = (model_name, engine)
        r = self.registry

        def gauge(name: str, doc: str, fn: Callable[[], float]) -> None:
            Gauge(name, doc, labels, registry=r).labels(*values).set_function(fn)

        gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
              lambda: model.num_running)
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
              lambda: model.num_waiting)
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
              lambda: model.kv_cache_usage)
        cache = cache_config_labels(config, model.profile.kv_bytes_per_token,
                                    num_gpu_blocks_override, kv_cache_memory_bytes)
        info = Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                     (*cache, "engine"), registry=r)
        info.labels(*cache.values(), engine).set(1)

        r.register(_CounterCollector(model.counters, values))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        token_buckets = one_two_five_buckets(config.max_model_len)
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.",
                                      REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.",
                                     REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.",
                                        REQUEST_LATENCY_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.",
                              ITL_BUCKETS)
        self.request_preemptions = histogram(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            tuple(float(b) for b in PREEMPTION_BUCKETS))
        self.request_prompt_tokens = histogram("vllm:request_prompt_tokens",
                                               "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.",
                                                   token_buckets)
        self.iteration_tokens = histogram("vllm:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.",
                                          tuple(float(b) for b in ITERATION_TOKEN_BUCKETS))
        # The emulator's own health: how far the wall-clock step runs behind the model's.
        self.step_lag = Histogram(
            "weighbridge_emulator_step_lag_seconds",
            "Wall-clock step duration minus the step model's duration.",
            labels, buckets=STEP_LAG_BUCKETS, registry=r)
        # Model time of all steps, so wall-clock lag can be read for any profile:
        # rate(wall time) / rate(this) - 1.
        self.step_model_seconds = Counter(
            "weighbridge_emulator_step_model_seconds",
            "Sum of the step model's step durations.", labels, registry=r)
        # As vLLM with --enable-lora: one series per state of the adapters seen after a
        # step, its value the (wall) time that state was last seen; no model_name or engine
        # label. vLLM's two adapter labels both list every adapter with a request in the
        # engine, waiting or running, in the order they came (vllm/v1/metrics/stats.py).
        self.lora_info: Gauge | None = None
        self._max_lora = str(max_loras)
        self._lora_state: tuple[str | int, ...] | None = None
        self._lora_child: Gauge | None = None
        if max_loras is not None:
            self.lora_info = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                                   ("max_lora", "waiting_lora_adapters",
                                    "running_lora_adapters"), registry=r)
        self._values = values
        self._bind(values)

    def _bind(self, values: tuple[str, str]) -> None:
        self._ttft = self.ttft.labels(*values)
        self._itl = self.itl.labels(*values)
        self._e2e = self.e2e.labels(*values)
        self._req_prompt = self.request_prompt_tokens.labels(*values)
        self._req_gen = self.request_generation_tokens.labels(*values)
        self._iteration = self.iteration_tokens.labels(*values)
        self._lag = self.step_lag.labels(*values)
        self._model_seconds = self.step_model_seconds.labels(*values)
        self._prefill = self.prefill_time.labels(*values)
        self._decode = self.decode_time.labels(*values)
        self._inference = self.inference_time.labels(*values)
        self._tpot = self.tpot.labels(*values)
        self._req_preemptions = self.request_preemptions.labels(*values)

    def on_step(self, result: StepResult, lag_s: float) -> None:
        batch, emitted = result.batch, result.emitted
        if self.lora_info is not None:
            self._lora_step()
        self._iteration.observe(batch.num_tokens)
        self._model_seconds.inc(batch.duration_s)
        self._lag.observe(max(lag_s, 0.0))
        for seq in emitted:
            if seq.output_tokens == 1 and seq.first_token_s is not None:
                self._ttft.observe(seq.first_token_s - seq.arrival_s)
        for gap in result.token_gaps:
            self._itl.observe(gap)

    def _lora_step(self) -> None:
        state = tuple(self._model.lora_requests)
        if self._lora_child is None or state != self._lora_state:
            names = ",".join(map(str, state))
            assert self.lora_info is not None
            self._lora_child = self.lora_info.labels(self._max_lora, names, names)
            self._lora_state = state
        self._lora_child.set_to_current_time()

    def on_finish(self, seq: Sequence) -> None:
        """The request histograms of a request the engine finished (vLLM observes none for
        a client's abort); its counters are the step model's."""
        if seq.finish_reason in (None, "abort"):
            return
        if seq.finished_s is not None:
            self._e2e.observe(seq.finished_s - seq.arrival_s)
        # A pooling request's one output is no generated token.
        generated = 0 if seq.pooling else seq.output_tokens
        if (seq.first_scheduled_s is not None and seq.first_token_s is not None
                and seq.last_token_s is not None):
            self._prefill.observe(seq.first_token_s - seq.first_scheduled_s)
            decode = seq.last_token_s - seq.first_token_s
            self._decode.observe(decode)
            self._inference.observe(seq.last_token_s - seq.first_scheduled_s)
            # As vLLM: every finished request's mean, 0 without two generated tokens.
            self._tpot.observe(decode / (generated - 1) if generated > 1 else 0.0)
        self._req_preemptions.observe(seq.num_preemptions)
        self._req_prompt.observe(seq.prompt_tokens)
        self._req_gen.observe(generated)


class _CounterCollector(Collector):
    """The step model's counters (``EngineCounters``) as vLLM exports them, read at each
    scrape: its counters, ``vllm:request_success`` by reason (the ``abort`` series exists and
    stays 0: vLLM counts no client abort), and the queue-time histogram."""

    _DOCS = (
        ("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
         "preemptions"),
        ("vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
        ("vllm:generation_tokens", "Number of generation tokens processed.",
         "generation_tokens"),
        ("vllm:prefix_cache_queries",
         "Prefix cache queries, in terms of number of queried tokens.",
         "prefix_cache_queries"),
        ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
         "prefix_cache_hits"),
        ("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
         "prompt_tokens_cached"),
    )

    def __init__(self, counters: EngineCounters, values: tuple[str, str]) -> None:
        self._counters = counters
        self._values = list(values)
        self._created = time.time()

    def collect(self) -> Iterator[Metric]:
        counters, values, created = self._counters, self._values, self._created
        labels = ["model_name", "engine"]
        for name, doc, field in self._DOCS:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, getattr(counters, field), created=created)
            yield family
        success = CounterMetricFamily("vllm:request_success",
                                      "Count of successfully processed requests.",
                                      labels=[*labels, "finished_reason"])
        for reason in ("stop", "length", "abort"):
            success.add_metric([*values, reason], counters.finished.get(reason, 0),
                               created=created)
        yield success
        queue = counters.queue_time
        histogram = HistogramMetricFamily(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.", labels=labels)
        bounds = [*map(str, map(float, queue.bounds)), "+Inf"]
        histogram.add_metric(values, list(zip(bounds, queue.cumulative(), strict=True)),
                             queue.sum)
        yield histogram
