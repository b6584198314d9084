"""The configuration schema shared by every weighbridge part, loaded from YAML.

The YAML layout is a contract (docs/sidecar.md, "Configuration reference"): extend it,
never rename a field. Models are strict (YAML already carries types, so a quoted number is a
mistake, not a conversion) and forbid unknown keys so that a typo fails loudly instead of
silently using a default.

Every problem is reported by ``load_config`` / ``parse_config`` as one ``ConfigError`` whose
message lists each error as ``dotted.path: message``.
"""

from __future__ import annotations

import hmac
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PlainValidator,
    PositiveInt,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic import HttpUrl as _HttpUrl
from pydantic_core import PydanticCustomError

from weighbridge.keys import ApiKey, ApiKeyField, key_digest
from weighbridge.settings_file import Issue, SettingsError, conflicts, dotted, problems, read_yaml
from weighbridge.tiers import DEFAULT_TIERS

__all__ = [
    "EMBEDDINGS",
    "Admission",
    "Backend",
    "Config",
    "ConfigError",
    "Endpoint",
    "HealthProbe",
    "Limits",
    "Model",
    "Policy",
    "PolicyTraits",
    "RateLimits",
    "Scheduler",
    "Telemetry",
    "Tenant",
    "Tier",
    "load_config",
    "parse_config",
]

CostModel = Literal["tokens", "requests"]
# The one served endpoint that generates nothing (prefill only, never streamed).
EMBEDDINGS = "/v1/embeddings"
Routing = Literal["least_tokens", "prefix_aware", "least_requests", "round_robin"]



class Policy(StrEnum):
    """The order in which the sidecar serves queued requests (docs/sidecar.md, "Egress").
    ``drr`` is the product; the others are baselines to compare it with."""

    DRR = "drr"  # deficit round robin over tenants, in tokens, weighted
    RR = "rr"  # round robin over tenants, one request a turn, unweighted
    FCFS = "fcfs"  # one queue in arrival order, through the admission gate
    PASSTHROUGH = "passthrough"  # no queue: forwarded at once, no gate

    @property
    def traits(self) -> PolicyTraits:
        return POLICY_TRAITS[self]


@dataclass(frozen=True, slots=True)
class PolicyTraits:
    holds_requests: bool  # queued and gated; False: forwarded at once
    per_tenant: bool  # picks among tenants' queues, so it can choose an under-share tenant
    # (admission headroom, fairness); False: one FIFO, headroom is ordinary capacity
    weighted: bool  # tenants' weights count
    costs_tokens: bool  # a request costs its endpoint's cost (tokens); False: one turn


POLICY_TRAITS: dict[Policy, PolicyTraits] = {
    Policy.DRR: PolicyTraits(holds_requests=True, per_tenant=True, weighted=True,
                             costs_tokens=True),
    Policy.RR: PolicyTraits(holds_requests=True, per_tenant=True, weighted=False,
                            costs_tokens=False),
    Policy.FCFS: PolicyTraits(holds_requests=True, per_tenant=False, weighted=False,
                              costs_tokens=False),
    Policy.PASSTHROUGH: PolicyTraits(holds_requests=False, per_tenant=False, weighted=False,
                                     costs_tokens=False),
}

DEFAULT_TOKEN_QUANTUM = 2048
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024

# Tenant, tier and backend names end up in HTTP headers and Prometheus label values.
_NAME = re.compile(r"[A-Za-z0-9\[][A-Za-z0-9_.:\[\]-]{0,63}")

PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegativeFloat = Annotated[float, Field(ge=0, allow_inf_nan=False)]


# --------------------------------------------------------------------------- helpers


def _check_name(value: str) -> str:
    if not _NAME.fullmatch(value):
        raise PydanticCustomError(
            "name",
            "name must be 1-64 characters of letters, digits and _ . : - [ ], "
            "starting with a letter or digit",
        )
    return value


def _expect_str(value: Any) -> str:
    if not isinstance(value, str):
        raise PydanticCustomError("string_type", "Input should be a valid string")
    return value


Name = Annotated[
    str, PlainValidator(lambda v: _check_name(_expect_str(v)), json_schema_input_type=str)
]


_http_url = TypeAdapter(_HttpUrl)


def _parse_http_url(value: Any) -> _HttpUrl:
    url = _expect_str(value)
    try:
        parsed = _http_url.validate_python(url)
    except ValidationError as exc:
        raise PydanticCustomError(
            "url", "must be an http(s) URL: {reason}", {"reason": exc.errors()[0]["msg"]}
        ) from None
    if parsed.query is not None or parsed.fragment is not None:
        raise PydanticCustomError("url", "base URL must not have a query or fragment")
    return parsed


def _check_base_url(value: Any) -> str:
    # Normalised (so a lenient parse like "http:/h" cannot mean different things to us and
    # to the HTTP client) but without the trailing slash, so callers append "/v1/..." as is.
    return str(_parse_http_url(value)).rstrip("/")


BaseUrl = Annotated[str, PlainValidator(_check_base_url, json_schema_input_type=str)]


def _check_path(value: Any) -> str:
    path = _expect_str(value)
    if not path.startswith("/") or any(c.isspace() for c in path):
        raise PydanticCustomError("path", "endpoint must be a URL path such as /v1/completions")
    return path


EndpointPath = Annotated[str, PlainValidator(_check_path, json_schema_input_type=str)]


def _check_model_name(value: Any) -> str:
    name = _expect_str(value)
    if not name or name != name.strip():
        raise PydanticCustomError("model_name", "a model name must be non-empty, without "
                                  "leading or trailing spaces")
    return name


# As vLLM's --served-model-name and /v1/models spell it ("org/model", "my-lora", ...).
ModelName = Annotated[str, PlainValidator(_check_model_name, json_schema_input_type=str)]

# --------------------------------------------------------------------------- schema


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, hide_input_in_errors=True)


# A tier's default vLLM priority is TIER_PRIORITY_STEP * (rank - 1): the default tiers'
# 0 / 5 / 10, and room for over_share_priority_demotion within a tier.
TIER_PRIORITY_STEP = 5


class RateLimits(_Model):
    """Rate limits; ``None`` means unlimited. Token limits count prompt + output."""

    requests_per_minute: PositiveInt | None = None
    requests_per_day: PositiveInt | None = None
    requests_per_month: PositiveInt | None = None
    tokens_per_minute: PositiveInt | None = None
    tokens_per_day: PositiveInt | None = None
    tokens_per_month: PositiveInt | None = None


class Tier(_Model):
    rank: int  # lower rank is served first, strictly
    # Sent as the request's `priority` to backends with priority_scheduling. Default: from
    # the rank, so a better tier is also served first inside the engine (with one value for
    # every tier, the engine would order a tier-1 request behind tier-2 prompts it already
    # holds).
    vllm_priority: int = 0
    ttft_slo_ms: PositiveFloat | None = None  # default deadline for time to first token
    e2e_slo_ms: PositiveFloat | None = None  # default deadline for the whole request
    # Limits on everything sent in this tier, all tenants together, beside each tenant's own:
    # what a better tier may carry, so tenants cannot all move up to it (priority
    # inflation) and starve the tiers below.
    limits: RateLimits = Field(default_factory=RateLimits)
    # Stream this tier's answers in chunks of at least this many tokens: sent as the request's
    # `stream_interval` (vLLM's, which it raises the engine's --stream-interval to), unless
    # the client asked for more. Fewer, larger chunks cost the engine's front end and the
    # sidecar less host CPU per token; None leaves each token its own chunk.
    stream_interval: PositiveInt | None = None

    @model_validator(mode="before")
    @classmethod
    def _priority_from_rank(cls, data: Any) -> Any:
        if (isinstance(data, dict) and "vllm_priority" not in data
                and isinstance(data.get("rank"), int) and not isinstance(data["rank"], bool)):
            return {**data, "vllm_priority": TIER_PRIORITY_STEP * (data["rank"] - 1)}
        return data


def default_tiers() -> dict[str, Tier]:
    return {name: Tier(rank=t.rank, vllm_priority=t.vllm_priority, ttft_slo_ms=t.ttft_slo_ms,
                       e2e_slo_ms=t.e2e_slo_ms)
            for name, t in DEFAULT_TIERS.items()}


class Limits(RateLimits):
    """Per-tenant limits: the rates, and the bounds on the tenant's queue."""

    # Queues are bounded by default: an unbounded queue only converts overload into latency.
    max_queued: PositiveInt = 1000
    max_queued_tokens: PositiveInt | None = None


class Tenant(_Model):
    tier: Name  # the highest tier this tenant may use, and its default
    weight: PositiveFloat = 1.0  # share within its tier
    api_keys: list[ApiKeyField] = Field(min_length=1)
    limits: Limits = Field(default_factory=Limits)
    # Extra rate limits on one endpoint (only the rate fields apply; queues are per tenant).
    # Replaces that endpoint's `tenant_limits` default for this tenant.
    endpoint_limits: dict[EndpointPath, Limits] = Field(default_factory=dict)
    # Extra rate limits on one model (the request's `model`, or `default_model`); replaces
    # that model's `tenant_limits` default for this tenant.
    model_limits: dict[ModelName, RateLimits] = Field(default_factory=dict)


class Endpoint(_Model):
    cost: CostModel = "tokens"
    # Deficit added per DRR round, in the unit of `cost`. Defaults to 2048 tokens, or one
    # request when cost is `requests`.
    quantum: PositiveInt = DEFAULT_TOKEN_QUANTUM
    # Output estimate before any output has been observed for a tenant on this endpoint
    # (0 for an endpoint that generates nothing, as /v1/embeddings).
    initial_output_estimate: NonNegativeInt = 256
    # Every tenant's own limits on this endpoint, unless its `endpoint_limits` names it.
    tenant_limits: RateLimits = Field(default_factory=RateLimits)

    @model_validator(mode="before")
    @classmethod
    def _quantum_follows_cost(cls, data: Any) -> Any:
        if isinstance(data, dict) and "quantum" not in data and data.get("cost") == "requests":
            return {**data, "quantum": 1}
        return data


def default_endpoints() -> dict[str, Endpoint]:
    return {
        "/v1/chat/completions": Endpoint(cost="tokens", quantum=DEFAULT_TOKEN_QUANTUM),
        "/v1/completions": Endpoint(cost="tokens", quantum=DEFAULT_TOKEN_QUANTUM),
        # Prefill only: a request costs its input tokens, and nothing is generated.
        EMBEDDINGS: Endpoint(cost="tokens", quantum=DEFAULT_TOKEN_QUANTUM,
                                   initial_output_estimate=0),
    }


class Model(_Model):
    """Rules for one model name, as requests spell it in `model`."""

    # Every tenant's own limits on this model, unless its `model_limits` names it.
    tenant_limits: RateLimits = Field(default_factory=RateLimits)


class Backend(_Model):
    url: BaseUrl
    name: Name  # defaults to the URL's host:port; used in headers and metric labels
    priority_scheduling: bool = False  # the backend runs vLLM --scheduling-policy priority
    # The backend's vLLM --stream-interval: after the first, each streamed chunk carries this
    # many tokens (the last one the rest), which live charging counts between usages.
    stream_interval: PositiveInt = 1
    # The model names it serves (base models and adapters), when they should not be learned
    # from its /v1/models; None: learned (sidecar.catalog).
    models: list[ModelName] | None = Field(default=None, min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _name_from_url(cls, data: Any) -> Any:
        if isinstance(data, dict) and "name" not in data and "url" in data:
            try:
                url = _parse_http_url(data["url"])
            except PydanticCustomError:
                # The url field reports the problem; a placeholder avoids a second,
                # misleading "name: Field required".
                return {**data, "name": "invalid"}
            # host and port, not the netloc: a netloc may carry user:password.
            return {**data, "name": f"{url.host}:{url.port}"}
        return data


class HealthProbe(_Model):
    path: EndpointPath = "/health"
    interval_ms: PositiveInt = 1000
    timeout_ms: PositiveInt = 1000
    # Consecutive failed probes before a healthy backend is marked unhealthy (Kubernetes'
    # failureThreshold, Envoy's unhealthy_threshold). One late answer is weak evidence: the
    # probe's timer runs on the sidecar's own event loop, which a burst of arrivals can hold
    # for a second, and an engine busy with a burst answers late. A failed request (refused
    # connection, broken stream) still marks the backend at once. One 200 brings it back.
    unhealthy_threshold: PositiveInt = 3


class ModelDiscovery(_Model):
    """How the sidecar learns which models each backend serves: its /v1/models, read at
    start-up and then every ``interval_ms`` (a LoRA adapter loaded at run time appears
    within that period)."""

    interval_ms: PositiveInt = 30_000
    timeout_ms: PositiveInt = 2_000


class Scheduler(_Model):
    # Not strict: YAML gives the policy's name, a string.
    policy: Annotated[Policy, Field(strict=False)] = Policy.DRR
    # Fraction of dispatches offered to lower tiers while a higher tier is backlogged;
    # None keeps tiers strict.
    anti_starvation_weight: float | None = Field(default=None, gt=0, lt=1, allow_inf_nan=False)
    charge_streamed_tokens: bool = True  # VTC-style: charge output tokens as they stream
    repeat_demotion: bool = False  # a key's 2nd, 3rd... concurrent request gets priority 1, 2...
    # Within a tenant (after priority and deadline), shorter prompts first: the seed's
    # approximate shortest-job-first. A tenant's long prompts wait while its short ones keep
    # coming; other tenants are unaffected (DRR is between tenants).
    shortest_prompt_first: bool = False
    output_estimate_alpha: float = Field(default=0.2, gt=0, le=1, allow_inf_nan=False)


class Admission(_Model):
    """Admission control. Every field left unset (None) is derived from the backend's shape
    as the sidecar learns it from the engine's /metrics (sidecar/shape.py,
    sidecar.admission.derive_limits; docs/sidecar.md#admission-defaults); a value given here
    overrides what is learned. The derived fairness settings (headroom, pacing, backlog, KV
    watermark) apply to the tenant-aware policies only: the FIFO baselines get what is set."""

    # Hold while the backend's estimated waiting queue is above this. None: max(2, slots/8)
    # once the engine's slots are known, 8 before.
    max_backend_waiting: NonNegativeInt | None = None
    min_decode_tokens_per_s: NonNegativeFloat = 7.0
    # Scrape interval per backend, also the dispatch tick. None: about 8 engine steps,
    # within [50, 250] ms (100 ms until a step time is measured).
    metrics_poll_ms: PositiveInt | None = None
    # Metrics older than this are stale: fall back to max_inflight_per_backend.
    metrics_stale_ms: PositiveInt = 1000
    max_inflight_per_backend: PositiveInt = 64
    # The in-flight cap per backend while its metrics are fresh (about the engine's
    # max_num_seqs). None: the learned running capacity plus the waiting bound, or
    # max_inflight_per_backend until it is learned.
    max_running_per_backend: PositiveInt | None = None
    # Slots per backend only under-share tenants may use: a well-behaved tenant then never
    # waits for a flood's slot turnover (vLLM does not preempt to admit a waiting request).
    # None: enough that a lone tenant runs at most slots - max(1, slots/8); 0: none.
    headroom_slots: NonNegativeInt | None = None
    # Prompt tokens a backend may have dispatched and still prefilling (no first token yet)
    # before it takes more: the gate otherwise counts free *slots*, and on an idle engine it
    # would hand over a slot's worth of long prompts that the engine can only prefill a
    # step budget at a time, so its waiting queue would overshoot max_backend_waiting.
    # None: two step budgets (tenant-aware policies); 0: no limit.
    max_backend_prefill_tokens: NonNegativeInt | None = None
    # Prompt tokens one tenant may have dispatched and still prefilling (no first token yet)
    # before its next request waits: a flood's long prompts then enter the engines a few at
    # a time instead of all at once, so they neither fill the engine's waiting queue (which
    # closes the gate for everyone) nor every step's budget. drr and rr only.
    # None: one step budget; 0: no limit.
    max_prefill_tokens_inflight: NonNegativeInt | None = None
    # The engine's step budget (vLLM --max-num-batched-tokens), which the two prefill limits
    # above derive from. vLLM does not export it; None: 2048 (vLLM's default for serving).
    step_budget_tokens: PositiveInt | None = None
    # KV-aware admission (drr and rr): an over-share tenant's requests are dispatched only
    # while what the sidecar has in flight on the backend will hold fewer KV blocks, at its
    # largest, than the cache minus kv_reserve_blocks; the reserve is for the others.
    kv_aware: bool = True
    # The engine's KV cache in blocks and tokens per block. None: vllm:cache_config_info's
    # num_gpu_blocks and block_size (KV-aware admission is off while neither is known).
    kv_cache_blocks: PositiveInt | None = None
    kv_block_size: PositiveInt | None = None
    # KV blocks per backend kept for under-share tenants. None: the same fraction of the
    # cache as the headroom's max(1, slots/8) of the slots (1/8 before slots are known).
    kv_reserve_blocks: NonNegativeInt | None = None
    # Added to the vLLM priority of over-share requests on priority-scheduling backends, so
    # the engine preempts them first under KV pressure.
    over_share_priority_demotion: NonNegativeInt = 1

    @model_validator(mode="after")
    def _stale_after_poll(self) -> Admission:
        issues: list[Issue] = []
        if self.metrics_poll_ms is not None and self.metrics_stale_ms < self.metrics_poll_ms:
            issues.append((("metrics_stale_ms",), "must be at least metrics_poll_ms"))
        smallest = min(self.max_inflight_per_backend,
                       self.max_running_per_backend or self.max_inflight_per_backend)
        if self.headroom_slots is not None and self.headroom_slots >= smallest:
            issues.append((("headroom_slots",), f"must be below the in-flight caps ({smallest})"
                           ", or a lone tenant could never be served"))
        if (self.kv_cache_blocks is not None and self.kv_reserve_blocks is not None
                and self.kv_reserve_blocks >= self.kv_cache_blocks):
            issues.append((("kv_reserve_blocks",), f"must be below kv_cache_blocks "
                           f"({self.kv_cache_blocks}), or a lone tenant could never be served"))
        if issues:
            raise conflicts(issues)
        return self


class Telemetry(_Model):
    """OpenTelemetry export; off unless ``otlp_endpoint`` is set."""

    # Base URL of an OTLP/HTTP receiver (a collector's :4318); spans go to <url>/v1/traces
    # as http/protobuf, like OTEL_EXPORTER_OTLP_ENDPOINT. None: no tracing at all.
    otlp_endpoint: BaseUrl | None = None
    service_name: Name = "weighbridge-sidecar"
    # Fraction of requests traced (parent-based: a caller's sampled trace is always kept).
    sample_ratio: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)

    @property
    def traces_url(self) -> str | None:
        return None if self.otlp_endpoint is None else self.otlp_endpoint + "/v1/traces"


def _check_redis_url(value: Any) -> str:
    url = _expect_str(value)
    parsed = urlsplit(url)
    if parsed.scheme not in ("redis", "rediss", "unix") or (
            parsed.scheme != "unix" and not parsed.hostname):
        raise PydanticCustomError("redis_url", "a Redis URL: redis://host:port/db, "
                                  "rediss://... (TLS) or unix:///path/to/socket")
    return url


RedisUrl = Annotated[str, PlainValidator(_check_redis_url, json_schema_input_type=str)]


class SharedState(_Model):
    """Where the state several sidecar replicas share lives (docs/sidecar.md, "Several
    replicas"): ``local`` keeps everything in this process (one replica); ``redis`` shares
    the rate-limit buckets, the tenants' served-token counters and the output estimates."""

    backend: Literal["local", "redis"] = "local"
    url: RedisUrl | None = None
    # One round trip on the admission path; a slower answer counts as Redis being down,
    # and the replica falls back to its share of the limits until it answers again.
    timeout_ms: PositiveFloat = 5.0
    # How often each replica publishes its load (per tenant: in flight, backlogged) and reads
    # the others' (never per streamed chunk; service, estimates and settlements go every
    # 30 ms). Shares across replicas are judged on what the others held at the last
    # exchange: two tenants, one behind one replica of three, got Jain about 0.97 at 25 ms
    # and 0.98-1.00 at 10 ms (docs/sidecar.md).
    sync_ms: PositiveInt = 10
    # A replica registers every heartbeat_ms; one silent for 3 beats no longer counts
    # towards the N that fallback limits are divided by.
    heartbeat_ms: PositiveInt = 1000
    key_prefix: Name = "weighbridge"

    @model_validator(mode="after")
    def _url_for_redis(self) -> SharedState:
        if self.backend == "redis" and self.url is None:
            raise PydanticCustomError("missing_url", "url is required with backend redis "
                                      "(redis://host:port/db)")
        return self


class Config(_Model):
    tiers: dict[Name, Tier] = Field(default_factory=default_tiers, min_length=1)
    tenants: dict[Name, Tenant] = Field(default_factory=dict)
    # Merged over the defaults: every served endpoint always has a cost model.
    endpoints: dict[EndpointPath, Endpoint] = Field(default_factory=default_endpoints)
    backends: list[Backend] = Field(min_length=1)
    models: dict[ModelName, Model] = Field(default_factory=dict)
    # The model a request without `model` is served as: routed to its backends and charged
    # to by per-model limits. None: routing uses the first model the first backend lists
    # (what vLLM serves such a request with), and such requests meet no model limit.
    default_model: ModelName | None = None
    scheduler: Scheduler = Field(default_factory=Scheduler)
    admission: Admission = Field(default_factory=Admission)
    routing: Routing = "least_tokens"
    health_probe: HealthProbe = Field(default_factory=HealthProbe)
    model_discovery: ModelDiscovery = Field(default_factory=ModelDiscovery)
    admin_api_keys: list[ApiKeyField] = Field(default_factory=list)
    max_body_bytes: PositiveInt = DEFAULT_MAX_BODY_BYTES  # larger bodies get 413
    max_tokens_limit: PositiveInt | None = None  # requests asking for more are rejected
    # A client gets this long to send a request's headers, from connecting or from the end of
    # its previous request (also the idle keep-alive timeout); slower ones are disconnected.
    client_timeout_ms: PositiveInt = 60_000
    # A request's body must arrive within this of its headers (HAProxy's `timeout
    # http-request` is 10 s too): a dribbled body gets 408 before it is ever admitted.
    client_body_timeout_ms: PositiveInt = 10_000
    # Open client connections per sidecar process; one accepted beyond it is answered 503
    # too_many_connections (each connection costs a descriptor and an upstream one).
    max_client_connections: PositiveInt = 4096
    telemetry: Telemetry = Field(default_factory=Telemetry)
    state: SharedState = Field(default_factory=SharedState)

    _warnings: list[str] = PrivateAttr(default_factory=list)
    _tenant_by_digest: dict[str, str] = PrivateAttr(default_factory=dict)
    _admin_digests: frozenset[str] = PrivateAttr(default_factory=frozenset)

    @field_validator("endpoints", mode="after")
    @classmethod
    def _merge_default_endpoints(cls, value: dict[str, Endpoint]) -> dict[str, Endpoint]:
        return {**default_endpoints(), **value}

    @model_validator(mode="after")
    def _cross_check(self) -> Config:
        issues: list[Issue] = []

        rank_owner: dict[int, str] = {}
        for name, tier in self.tiers.items():
            if tier.rank in rank_owner:
                issues.append(
                    (
                        ("tiers", name, "rank"),
                        f"rank {tier.rank} is also used by tier "
                        f"'{rank_owner[tier.rank]}'; ranks must be unique",
                    )
                )
            rank_owner.setdefault(tier.rank, name)

        for name, tenant in self.tenants.items():
            if tenant.tier not in self.tiers:
                issues.append(
                    (
                        ("tenants", name, "tier"),
                        f"unknown tier '{tenant.tier}'; defined tiers: " + ", ".join(self.tiers),
                    )
                )

        # Keys are compared by digest, so 'plain:k' and 'sha256:<sha of k>' are one key.
        key_owner: dict[str, tuple[str | int, ...]] = {}
        by_digest: dict[str, str] = {}
        owners: list[tuple[tuple[str | int, ...], ApiKey, str | None]] = [
            (("tenants", name, "api_keys", i), key, name)
            for name, tenant in self.tenants.items()
            for i, key in enumerate(tenant.api_keys)
        ]
        owners += [(("admin_api_keys", i), key, None) for i, key in enumerate(self.admin_api_keys)]
        for loc, key, tenant_name in owners:
            if key.digest in key_owner:
                issues.append(
                    (
                        loc,
                        f"same key as {dotted(key_owner[key.digest])}; "
                        "a key may belong to one tenant (or admin) only",
                    )
                )
                continue
            key_owner[key.digest] = loc
            if tenant_name is not None:
                by_digest[key.digest] = tenant_name
            if key.source == "plain":
                self._warnings.append(
                    f"{dotted(loc)}: plain-text API key; store its sha256 digest "
                    "(or use env:VAR) outside tests and demos"
                )

        first_with: dict[str, int] = {}
        for i, backend in enumerate(self.backends):
            for attr in ("name", "url"):
                value = getattr(backend, attr)
                seen = first_with.setdefault(f"{attr}={value}", i)
                if seen != i:
                    issues.append(
                        (
                            ("backends", i, attr),
                            f"duplicate backend {attr} '{value}' (also backends.{seen}.{attr})",
                        )
                    )

        if issues:
            raise conflicts(issues)
        has_model_limits = any(t.model_limits for t in self.tenants.values()) or any(
            m.tenant_limits != RateLimits() for m in self.models.values())
        if has_model_limits and self.default_model is None:
            self._warnings.append(
                "default_model: not set, so a request without `model` meets no per-model "
                "limit; set it to the model the backends serve such requests with")
        if not self.tenants:
            self._warnings.append("tenants: no tenants defined; every request will get 401")
        self._tenant_by_digest = by_digest
        self._admin_digests = frozenset(d for d, loc in key_owner.items() if loc[0] != "tenants")
        return self

    # ----------------------------------------------------------------- lookups

    @property
    def warnings(self) -> tuple[str, ...]:
        """Non-fatal problems found at load time, as ``dotted.path: message``."""
        return tuple(self._warnings)

    def resolve_key_digests(self) -> dict[str, str]:
        """sha256 hex digest of every tenant key → tenant name."""
        return dict(self._tenant_by_digest)

    def tenant_for_digest(self, digest: str) -> str | None:
        """The tenant owning a key, given its digest (hex, or ``sha256:<hex>``)."""
        digest = digest.removeprefix("sha256:").lower()
        # The dict lookup is on a SHA-256 digest, so its timing reveals nothing usable
        # about a stored key; the final comparison is constant time all the same. A linear
        # scan with compare_digest would cost O(tenants) on every request.
        # pydantic's store of private values, read directly: ``self._tenant_by_digest``
        # reaches it only through BaseModel.__getattr__ after a failed lookup, 2.9 µs on
        # every request (docs/sidecar-performance.md).
        private = self.__pydantic_private__
        assert private is not None
        tenant = private["_tenant_by_digest"].get(digest)
        if tenant is None:
            return None
        for stored in self.tenants[tenant].api_keys:
            if hmac.compare_digest(stored.digest, digest):
                return tenant
        return None  # pragma: no cover - the index is built from these keys

    def tenant_for_key(self, key: str) -> str | None:
        """The tenant owning a raw bearer key, or None."""
        return self.tenant_for_digest(key_digest(key))

    def is_admin_key(self, key: str) -> bool:
        digest = key_digest(key)
        # Few admin keys: a full constant-time scan is affordable and leaks nothing.
        found = False
        for stored in self._admin_digests:
            found |= hmac.compare_digest(stored, digest)
        return found

    def tiers_by_rank(self) -> list[tuple[str, Tier]]:
        """(name, tier) pairs, highest priority (lowest rank) first."""
        return sorted(self.tiers.items(), key=lambda item: item[1].rank)

    def tier_allowed(self, tenant: str, tier: str) -> bool:
        """Whether ``tenant`` may send at ``tier``: its own tier or any lower one."""
        own = self.tiers[self.tenants[tenant].tier]
        wanted = self.tiers.get(tier)
        return wanted is not None and wanted.rank >= own.rank


# --------------------------------------------------------------------------- loading


class ConfigError(SettingsError):
    """Every problem with a configuration, each as ``(dotted.path, message)``."""

    what = "configuration"


def parse_config(
    data: Mapping[str, Any],
    *,
    environ: Mapping[str, str] | None = None,
    source: str = "<config>",
) -> Config:
    """Validate a parsed mapping; ``environ`` (default ``os.environ``) resolves env: keys."""
    if not isinstance(data, Mapping):
        raise ConfigError(source, [("(top level)", "must be a mapping of settings")])
    context = {"environ": os.environ if environ is None else environ}
    try:
        return Config.model_validate(dict(data), context=context)
    except ValidationError as exc:
        raise ConfigError(source, problems(exc)) from None


def load_config(
    path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None
) -> Config:
    """Load and validate a YAML config file; raises ``ConfigError`` naming the file."""
    data = read_yaml(path, ConfigError)
    return parse_config(data, environ=environ, source=os.fspath(path))
