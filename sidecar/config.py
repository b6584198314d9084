"""The sidecar's configuration schema, loaded from YAML (the application's stack files and
simulator read it too, through the sidecar's surface).

The YAML layout is a contract: extend it, never rename a field. Each field's docstring is
its documentation, rendered as docs/configuration.md by
``weighbridge.sidecar.config_reference``.
Models are strict (YAML already carries types, so a quoted number is a mistake, not a
conversion) and forbid unknown keys so that a typo fails loudly instead of silently using a
default.

Every problem is reported by ``load_config`` / ``parse_config`` as one ``ConfigError`` whose
message lists each error as ``dotted.path: message``.
"""

from __future__ import annotations

import hmac
import importlib.util
import os
import re
from collections.abc import Mapping
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

from weighbridge.endpoints import EndpointKind
from weighbridge.hf_tokenizer import MODULES
from weighbridge.keys import ApiKey, ApiKeyField, key_digest
from weighbridge.redaction import redact_url
from weighbridge.settings_file import Issue, SettingsError, conflicts, dotted, problems, read_yaml
from weighbridge.tiers import DEFAULT_TIERS

__all__ = [
    "EMBEDDINGS",
    "FAIRNESS_ADMISSION",
    "Admission",
    "Backend",
    "Config",
    "ConfigError",
    "Endpoint",
    "HealthProbe",
    "Limits",
    "Model",
    "RateLimits",
    "Routing",
    "Scheduler",
    "Telemetry",
    "Tenant",
    "Tier",
    "Tokenization",
    "load_config",
    "parse_config",
    "request_level_baseline",
]

CostModel = Literal["tokens", "requests"]
# The one served endpoint that generates nothing (prefill only, never streamed).
EMBEDDINGS = "/v1/embeddings"
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
    # A kind's other paths (/v1/rerank, ...) name its own: one limit holds on all of them.
    kind = EndpointKind.of_path(path)
    return path if kind is None else kind.value


EndpointPath = Annotated[str, PlainValidator(_check_path, json_schema_input_type=str)]


def _check_model_name(value: Any) -> str:
    name = _expect_str(value)
    if not name or name != name.strip():
        raise PydanticCustomError("model_name", "a model name must be non-empty, without "
                                  "leading or trailing spaces")
    return name


# As vLLM's --served-model-name and /v1/models spell it ("org/model", "my-lora", ...).
ModelName = Annotated[str, PlainValidator(_check_model_name, json_schema_input_type=str)]


def _part(kind: Literal["fairness", "ordering", "scorer", "picker"]) -> Any:
    """A validator of a name of a registered part of ``kind`` (sidecar.plugins)."""

    def check(value: Any) -> str:
        name = _expect_str(value)
        # The parts' modules import this one: the registry is read when a value is checked.
        from weighbridge.sidecar.plugins import registered

        known = registered(kind)
        if name not in known:
            raise PydanticCustomError("plugin", "unknown {kind} {name}: one of {known}",
                                      {"kind": "fairness policy" if kind == "fairness" else kind,
                                       "name": repr(name), "known": ", ".join(known)})
        return name

    return PlainValidator(check, json_schema_input_type=str)


PolicyName = Annotated[str, _part("fairness")]
OrderingName = Annotated[str, _part("ordering")]
ScorerName = Annotated[str, _part("scorer")]
PickerName = Annotated[str, _part("picker")]

# --------------------------------------------------------------------------- schema


class _Model(BaseModel):
    # Each field's docstring is its description: the one text docs/configuration.md is
    # generated from (weighbridge.sidecar.config_reference), as vLLM's config classes do.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, hide_input_in_errors=True,
                              use_attribute_docstrings=True)


# A tier's default vLLM priority is TIER_PRIORITY_STEP * (rank - 1): the default tiers'
# 0 / 5 / 10, and room for over_share_priority_demotion within a tier.
TIER_PRIORITY_STEP = 5


class RateLimits(_Model):
    """Rate limits, each a bucket refilled continuously over its period (or, with `windows:
    calendar`, the day and month ones reset at the start of each UTC day and month); none
    means unlimited. A request over one gets 429 `rate_limited` with `Retry-After`."""

    requests_per_minute: PositiveInt | None = None
    """A bucket of this many requests, refilled over a minute."""
    requests_per_day: PositiveInt | None = None
    """The same over 86,400 s."""
    requests_per_month: PositiveInt | None = None
    """The same over 30 days: a monthly request budget, refilled continuously."""
    tokens_per_minute: PositiveInt | None = None
    """Prompt + output tokens: the estimate is charged at admission and settled with the
    answer's usage at the end."""
    tokens_per_day: PositiveInt | None = None
    """The same over 86,400 s."""
    tokens_per_month: PositiveInt | None = None
    """The same over 30 days."""
    windows: Literal["rolling", "calendar"] = "rolling"
    """How the day and month limits count (docs/sidecar.md, "Rate limits"). `rolling`: a
    bucket refilled continuously, a month being 30 days, so a tenant that spent it recovers
    it gradually; up to twice the limit fits in one window's length. `calendar`: full again
    at the start of each UTC day and month (a debt carries over), so each calendar month
    holds at most its limit; twice the limit fits across a reset. Minute limits always
    roll."""


class Tier(_Model):
    """A service tier. Without `tiers`, three are defined: `interactive` (rank 1,
    `ttft_slo_ms` 500, `vllm_priority` 0), `standard` (rank 2, `e2e_slo_ms` 10000,
    `vllm_priority` 5) and `batch` (rank 3, `vllm_priority` 10)."""

    rank: int
    """Lower rank is served first, strictly; unique among the tiers."""
    vllm_priority: int = Field(default=0, json_schema_extra={"x-default": "5 * (rank - 1)"})
    """The `priority` sent to backends with `priority_scheduling` (lower is served first, as
    the rank). Derived from the rank so that a better tier is also ahead inside the engine
    (with one value for every tier, the engine would order a tier-1 request behind tier-2
    prompts it already holds), with room for `over_share_priority_demotion` between tiers."""
    ttft_slo_ms: PositiveFloat | None = None
    """The default deadline for time to first token of requests in this tier."""
    e2e_slo_ms: PositiveFloat | None = None
    """The default deadline for the whole request, where there is no `ttft_slo_ms`; early
    rejection compares it with the predicted wait to the first token."""
    limits: RateLimits = Field(default_factory=RateLimits)
    """Rate limits on everything sent in this tier, all tenants together, beside each
    tenant's own: what a better tier may carry, so tenants cannot all move up to it
    (priority inflation) and starve the tiers below. A lower tier is not affected."""
    stream_interval: PositiveInt | None = None
    """Stream this tier's answers in chunks of at least this many tokens: sent as the
    request's `stream_interval` (vLLM's, which raises the engine's `--stream-interval` for
    that request) unless the client asked for more. Fewer chunks cost the engine's API server
    and the sidecar less CPU per token (docs/sidecar-performance.md) and make each client read
    coarser; none sends each token as it comes."""
    cached_prompt_token_weight: float | None = Field(default=None, ge=0, le=1)
    """What a prompt token the engine found in its prefix cache counts in this tier's
    requests' token rate limits (every bucket they are charged to), 0-1, as providers bill
    cached input; replaces the endpoint's `cached_prompt_token_weight`. None: the
    endpoint's."""

    @model_validator(mode="before")
    @classmethod
    def _priority_from_rank(cls, data: Any) -> Any:
        if (isinstance(data, dict) and "vllm_priority" not in data
                and isinstance(data.get("rank"), int) and not isinstance(data["rank"], bool)):
            return {**data, "vllm_priority": TIER_PRIORITY_STEP * (data["rank"] - 1)}
        return data

    def deadline(self, now: float, requested_ms: float | None = None) -> float | None:
        """The absolute deadline of a request in this tier: the client's relative one if
        given, else the TTFT SLO, else the end-to-end SLO, else none."""
        if requested_ms is not None:
            return now + requested_ms / 1000
        slo = self.ttft_slo_ms if self.ttft_slo_ms is not None else self.e2e_slo_ms
        return None if slo is None else now + slo / 1000

    def deadline_covers_output(self, requested_ms: float | None = None) -> bool:
        """Whether ``deadline``'s deadline is for the whole answer (the end-to-end SLO), not
        for its first token (a client's deadline or a TTFT SLO)."""
        return requested_ms is None and self.ttft_slo_ms is None and self.e2e_slo_ms is not None


def default_tiers() -> dict[str, Tier]:
    return {name: Tier(rank=t.rank, vllm_priority=t.vllm_priority, ttft_slo_ms=t.ttft_slo_ms,
                       e2e_slo_ms=t.e2e_slo_ms)
            for name, t in DEFAULT_TIERS.items()}


class Limits(RateLimits):
    """A tenant's limits: the rates, and the bounds on its queue in the sidecar."""

    max_queued: PositiveInt = 1000
    """Requests queued in the sidecar at once; one more gets 429 `queue_full`. Bounded by
    default: an unbounded queue only converts overload into latency."""
    max_queued_tokens: PositiveInt | None = None
    """Tokens queued at once, as the backlog counts them: the prompt its engine is predicted
    to compute (the cached part free) plus the expected output."""


class Tenant(_Model):
    """A customer: its keys, tier, weight and limits. Names are 1-64 of letters, digits and
    `_ . : - [ ]`, as they appear in headers and metric labels."""

    tier: Name
    """The highest tier the tenant may use, and its default."""
    weight: PositiveFloat = 1.0
    """Its share within its tier: DRR turns per round, and its share of the headroom."""
    api_keys: list[ApiKeyField] = Field(min_length=1)
    """`sha256:<64 hex>`, `env:VAR` or `plain:<key>` (docs/sidecar.md, "API keys"); a key
    belongs to one tenant or admin only."""
    limits: Limits = Field(default_factory=Limits)
    """Its rate limits and queue bounds."""
    endpoint_limits: dict[EndpointPath, Limits] = Field(default_factory=dict)
    """Endpoint path → rate limits on that endpoint only (only the rate fields apply; queues
    are per tenant); replaces that endpoint's `tenant_limits` for this tenant."""
    model_limits: dict[ModelName, RateLimits] = Field(default_factory=dict)
    """Model name → rate limits on requests for that model only (the request's `model`, or
    `default_model`); replaces that model's `tenant_limits` for this tenant."""


class Endpoint(_Model):
    """How requests of one served kind are costed, keyed by its path (`/v1/completions`,
    `/v1/chat/completions`, `/v1/embeddings`, `/pooling`, `/classify`, `/score`, `/rerank`;
    a kind's other paths, such as `/v1/rerank`, name it too). Given ones are merged over the
    defaults of every kind."""

    cost: CostModel = "tokens"
    """The DRR cost model: `tokens` (prompt + estimated output) or `requests` (1 each)."""
    quantum: PositiveInt = Field(default=DEFAULT_TOKEN_QUANTUM,
                                 json_schema_extra={"x-default": "2048; 1 with cost requests"})
    """Deficit added per DRR round, in the unit of `cost`: a tenant's share of a round
    (times its weight), and so the price of this endpoint's unit against the others' (a
    tenant's endpoints share one ring, charged in quanta). How tenants interleave is
    `turn`."""
    turn: PositiveInt | None = None
    """What one visit of the DRR ring may spend of a tenant's credit on this endpoint per
    unit of its weight, in the unit of `cost`, before the next backlogged tenant's visit:
    the tenant keeps the rest of its round's credit and is visited again in the same round,
    so its share and the price stay `quantum`'s, and tenants interleave in the ratio of
    their weights. Unset: one request per unit of weight on the generating kinds (a request
    is one sequence the engine batches with others: about one request a tenant in turn, as
    seed 001 rotates streaming endpoints), `quantum` on the pooling kinds (a batch of
    inputs)."""
    initial_output_estimate: NonNegativeInt = Field(
        default=256, json_schema_extra={"x-default": "256; 0 for the pooling kinds"})
    """The output estimate before any output has been observed for a tenant on this
    endpoint (0 for an endpoint that generates nothing)."""
    tenant_limits: RateLimits = Field(default_factory=RateLimits)
    """Rate limits every tenant gets on this endpoint, each in its own buckets, unless its
    `endpoint_limits` names the endpoint."""
    cached_prompt_token_weight: float = Field(default=1.0, ge=0, le=1)
    """What a prompt token the engine found in its prefix cache counts in the token rate
    limits of requests to this endpoint, 0-1: 1 (rate limits are contracts: every prompt
    token counts), 0.5 to bill cached input at half, as providers do. Settled when the
    request ends, with what the engine reported cached
    (`usage.prompt_tokens_details.cached_tokens`); nothing reported, nothing is discounted.
    The DRR charge counts cached tokens free whatever this says."""

    @model_validator(mode="before")
    @classmethod
    def _quantum_follows_cost(cls, data: Any) -> Any:
        if isinstance(data, dict) and "quantum" not in data and data.get("cost") == "requests":
            return {**data, "quantum": 1}
        return data


def default_endpoints() -> dict[str, Endpoint]:
    # The pooling kinds are prefill only: a request costs its input tokens, and nothing is
    # generated.
    return {kind.value: Endpoint(cost="tokens", quantum=DEFAULT_TOKEN_QUANTUM)
            if kind.generates else
            Endpoint(cost="tokens", quantum=DEFAULT_TOKEN_QUANTUM, initial_output_estimate=0)
            for kind in EndpointKind}


def _check_tokenizer(value: Any) -> str:
    directory = _expect_str(value)
    if not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        raise PydanticCustomError("tokenizer", "no tokenizer.json in directory '{directory}'",
                                  {"directory": directory})
    missing = [name for name in MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise PydanticCustomError(
            "tokenizer", "needs the {missing} packages: pip install 'weighbridge[tokenizer]'",
            {"missing": " and ".join(missing)})
    return directory


TokenizerDirectory = Annotated[str, PlainValidator(_check_tokenizer, json_schema_input_type=str)]


class Model(_Model):
    """Rules for one model name, as requests spell it in `model`."""

    tenant_limits: RateLimits = Field(default_factory=RateLimits)
    """Rate limits every tenant gets on this model, each in its own buckets, unless its
    `model_limits` names the model."""
    tokenizer: TokenizerDirectory | None = None
    """A Hugging Face model directory whose tokenizer counts this model's text prompts in the
    engine's own tokens (as vLLM's `--tokenizer`: its `tokenizer.json`, and the chat
    template of `chat_template.jinja` or `tokenizer_config.json`; a relative path is the
    sidecar's working directory's). A completion's string prompt, and a chat whose messages
    are role and string content only, are then counted exactly for rate limits, DRR and
    the prefix index, which cuts them in the engine's own blocks; other prompts, and any
    over `tokenization`'s bounds, are estimated. Tokenizing runs on a thread of its own
    (`tokenization`). Needs the `tokenizer` extra. None: text is estimated at 4 bytes a
    token, and the prefix index prices matched text at each backend's learned bytes per
    token (docs/sidecar.md, "Counting text in the engine's tokens")."""


class Backend(_Model):
    """One engine the sidecar forwards to: a vLLM OpenAI-compatible server."""

    url: BaseUrl
    """Its base URL (`http://host:port`, no query)."""
    name: Name = Field(json_schema_extra={"x-default": "the URL's host:port"})
    """Used in `x-weighbridge-backend` and metric labels; unique."""
    priority_scheduling: bool = False
    """The backend runs vLLM `--scheduling-policy priority`."""
    stream_interval: PositiveInt = 1
    """The backend's vLLM `--stream-interval N`: each streamed chunk after the first carries
    N tokens (the last one the rest), which live charging counts by. Left at 1 on such an
    engine, charging lags a stream by up to N - 1 tokens per chunk until its usage settles
    it."""
    models: list[ModelName] | None = Field(default=None, min_length=1,
                                           json_schema_extra={"x-default": "learned"})
    """The model names it serves (base models and adapters); unset, they are learned from its
    `/v1/models` (`model_discovery`), and when set never re-read."""

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
    """The active health check of every backend."""

    path: EndpointPath = "/health"
    """Probed with GET; 200 is healthy."""
    interval_ms: PositiveInt = 1000
    """The probe interval per backend."""
    timeout_ms: PositiveInt = 1000
    """The probe's timeout."""
    unhealthy_threshold: PositiveInt = 3
    """Consecutive failed probes before a healthy backend is marked unhealthy (Kubernetes'
    `failureThreshold`, Envoy's `unhealthy_threshold`). One late answer is weak evidence: the
    probe's timer runs on the sidecar's own event loop, which a burst of arrivals can hold
    for a second, and an engine busy with a burst answers late. A failed request (refused
    connection, broken stream) still marks the backend at once; one 200 brings it back."""


class ModelDiscovery(_Model):
    """How the sidecar learns which models each backend serves: its `/v1/models`, read at
    start-up and then every `interval_ms` (a LoRA adapter loaded at run time appears
    within that period)."""

    interval_ms: PositiveInt = 30_000
    """How often each backend's `/v1/models` is read again."""
    timeout_ms: PositiveInt = 2_000
    """The timeout of one read; a failed read keeps what was known."""


class Scheduler(_Model):
    """The order in which queued requests are served (docs/sidecar.md, "Egress")."""

    policy: PolicyName = "drr"
    """The fairness policy, by its registered name ("Fairness policies" below): `drr`
    (deficit round robin over tenants, in tokens, weighted), or the baselines `rr` (one
    request a turn, unweighted), `fcfs` (one queue in arrival order, through the admission
    gate) and `passthrough` (no queue, no gate)."""
    ordering: OrderingName = "shortest_prompt_first"
    """A tenant's own queue order after priority and deadline, by its registered name
    ("Orderings" below): by default the shorter prompt first among requests arriving within
    2 s of each other, so a long prompt is passed only by requests that arrive less than
    2 s after it (decision 0019 (c)); `fifo` for arrival order. `shortest_prompt_first:
    true` takes that ordering whatever this says."""
    anti_starvation_weight: float | None = Field(default=None, gt=0, lt=1, allow_inf_nan=False)
    """In (0, 1): the fraction of dispatches a backlogged tier yields to the tiers below;
    none keeps tiers strict."""
    charge_streamed_tokens: bool = True
    """Charge streamed output beyond the estimate as it passes, as VTC does (`drr`,
    token-cost endpoints)."""
    repeat_demotion: bool = False
    """An API key's 2nd, 3rd… concurrent request is ordered at priority +1, +2… (by key, not
    the body's `user`)."""
    shortest_prompt_first: bool | None = None
    """The older switch for `ordering`'s `shortest_prompt_first`: true takes it whatever
    `ordering` says; false, where `ordering` is not given, takes `fifo`; unset, `ordering`
    decides (`drr`, `rr`)."""
    output_estimate_alpha: float = Field(default=0.2, gt=0, le=1, allow_inf_nan=False)
    """The EMA weight of each new output observation, in (0, 1]."""
    service_cost: bool = False
    """Charge a token at what it costs the engine (`drr`): its (endpoint, model,
    prompt-length band)'s engine seconds per computed token over the mean's, learned from
    each completed request's share of its engine's time (decision 0026). Off: every token
    costs 1."""

    @model_validator(mode="before")
    @classmethod
    def _older_switch(cls, data: Any) -> Any:
        """`shortest_prompt_first: false` alone still means arrival order, as it did when
        `fifo` was the default ordering."""
        if isinstance(data, dict) and data.get("shortest_prompt_first") is False \
                and "ordering" not in data:
            return {**data, "ordering": "fifo"}
        return data


def _check_program_sources(value: Any) -> list[str]:
    if not isinstance(value, list | tuple):
        raise PydanticCustomError("program_sources", "a list of sources")
    from weighbridge.sidecar.programs import ProgramSource

    try:
        parsed = [ProgramSource.parse(_expect_str(v)) for v in value]
    except ValueError as e:
        raise PydanticCustomError("program_sources", "{why}", {"why": str(e)}) from None
    if len(set(parsed)) != len(parsed):
        raise PydanticCustomError("program_sources", "a source is named twice")
    return [str(s) for s in parsed]


def _check_header_name(value: Any) -> str:
    from weighbridge.sidecar.programs import ProgramSource

    try:
        return ProgramSource.parse(f"header:{_expect_str(value)}").name
    except ValueError as e:
        raise PydanticCustomError("header_name", "{why}", {"why": str(e)}) from None


HeaderName = Annotated[str, PlainValidator(_check_header_name, json_schema_input_type=str)]
ProgramSources = Annotated[list[str], PlainValidator(
    _check_program_sources, json_schema_input_type=list[str])]


class Programs(_Model):
    """How a request names the agent program it is a call of (docs/sidecar.md, "Agent
    programs"): what the `program_las` ordering counts service by and `session_affinity`
    routes by. Never the tenant or the tier, which come from the key."""

    sources: ProgramSources = Field(default_factory=lambda: [
        "agentic_context", "header:x-claude-code-session-id", "header:session-id",
        "header:x-session-affinity", "header:x-session-id"])
    """Where the program is read, in order; the first present decides: `agentic_context`
    (vllm-router's `vllm_xargs.agentic_context`, an object or its JSON string: `program_id`,
    or `task_id`/`session_id` with `agent_id`; `root_program_id` or `parent_program_id`
    makes a subagent one program with its family), `header:NAME` (the header names the
    family), `body:FIELD` (a top-level field). Empty: no program is read."""
    agent_headers: list[HeaderName] = Field(
        default_factory=lambda: ["x-claude-code-agent-id", "thread-id"])
    """Headers naming a subagent inside the family a `header:` source named (Claude Code's
    agent id, Codex's thread id): its own context, which `session_affinity` keeps on one
    backend, while ordering counts the family as one program."""
    affinity_ttl_s: PositiveFloat = 600.0
    """How long a program stays bound to the backend its last call went to
    (`session_affinity`); after it, the next call is routed afresh."""


class Routing(_Model):
    """A route by its parts: a picker choosing among the backends that may take a request,
    by the scorers' costs summed with their weights ("Pickers" and "Scorers" below)."""

    picker: PickerName
    """The picker, by its registered name."""
    scorers: dict[ScorerName, PositiveFloat] = Field(default_factory=dict)
    """Scorer name → its weight: what a token of its cost counts against a token of the
    others'."""


def _check_route(value: Any) -> str | Routing:
    if isinstance(value, Routing):
        return value
    if isinstance(value, Mapping):
        return Routing.model_validate(value)
    name = _expect_str(value)
    from weighbridge.sidecar.routing import PRESETS  # the routing modules import this one

    if name not in PRESETS:
        raise PydanticCustomError("routing", "unknown routing {name}: one of {known}, or a "
                                  "picker and scorers", {"name": repr(name),
                                                         "known": ", ".join(PRESETS)})
    return name


RouteField = Annotated[str | Routing,
                       PlainValidator(_check_route, json_schema_input_type=str | Routing)]


class Admission(_Model):
    """Admission control: when a backend takes the next request. Every field left unset is
    derived from the engine's shape as the sidecar learns it from its /metrics
    (docs/sidecar.md, "Admission defaults: learned from each engine"); a value given here
    overrides what is learned. The derived fairness settings (headroom, pacing, backlog, KV
    watermark) apply to the tenant-aware policies only: the FIFO baselines get what is set."""

    max_backend_waiting: NonNegativeInt | None = Field(
        default=None, json_schema_extra={"x-default": "derived: max(2, slots/8); 8 before"})
    """Hold while the backend's estimated waiting queue is above this."""
    min_decode_tokens_per_s: NonNegativeFloat = 7.0
    """Hold while the engine's per-sequence decode speed is below this (0 disables)."""
    metrics_poll_ms: PositiveInt | None = Field(
        default=None,
        json_schema_extra={"x-default": "derived: about 8 engine steps in [50, 250] ms"})
    """The scrape interval per backend, also the dispatch tick: about 8 engine steps within
    [50, 250] ms (100 ms until a step time is measured), and at least 50 scrape durations, up
    to 500 ms."""
    metrics_stale_ms: PositiveInt = 1000
    """A scrape older than this is stale, and the gate falls back to
    `max_inflight_per_backend`; at least `metrics_poll_ms`."""
    max_inflight_per_backend: PositiveInt = 64
    """The in-flight cap per backend with stale or missing metrics (the fallback), and with
    fresh ones until its slots are learned."""
    max_running_per_backend: PositiveInt | None = Field(
        default=None, json_schema_extra={"x-default": "derived: slots + max_backend_waiting"})
    """The in-flight cap per backend while its metrics are fresh (about the engine's
    `max_num_seqs`): the learned running capacity plus the waiting bound. When set, also the
    slots the other defaults derive from."""
    headroom_slots: NonNegativeInt | None = Field(
        default=None, json_schema_extra={"x-default": "derived: work-conserving"})
    """Slots per backend only under-share tenants may use (below both caps): a well-behaved
    tenant then never waits for a flood's slot turnover, since vLLM does not preempt to admit
    a waiting request. Derived: enough that a lone tenant runs at most
    slots - max(1, slots/8); 0: none. A configured value is always kept."""
    max_backend_prefill_tokens: NonNegativeInt | None = Field(
        default=None, json_schema_extra={"x-default": "derived: two step budgets"})
    """Prompt tokens a backend may have dispatched and still prefilling (no first token yet)
    before it takes more: the gate otherwise counts free slots, and an idle engine would be
    handed a slot's worth of long prompts that it can only prefill a step budget at a time,
    so its waiting queue would overshoot `max_backend_waiting`. Derived for `drr` and `rr`;
    0: no limit."""
    max_prefill_tokens_inflight: NonNegativeInt | None = Field(
        default=None, json_schema_extra={"x-default": "derived: one step budget"})
    """Prompt tokens one tenant may have dispatched to a backend and still prefilling there
    before that backend takes its next request (another backend may): a flood's long prompts
    then enter each engine a few at a time, so they neither fill the engine's waiting queue
    (which closes the gate for everyone) nor every step's budget. Per backend, like the step
    budget it derives from. `drr` and `rr` only; 0: no limit."""
    step_budget_tokens: PositiveInt | None = Field(default=None,
                                                   json_schema_extra={"x-default": "2048"})
    """The engines' step budget (vLLM `--max-num-batched-tokens`), which the two prefill
    limits derive from. vLLM does not export it; unset: 2048, vLLM's default for serving."""
    kv_aware: bool = True
    """KV-aware admission (`drr`, `rr`): an over-share tenant's requests are dispatched only
    while what the sidecar has in flight on the backend will hold fewer KV blocks, at its
    largest, than the cache minus `kv_reserve_blocks`; the reserve is for the others."""
    kv_cache_blocks: PositiveInt | None = Field(
        default=None, json_schema_extra={"x-default": "learned: num_gpu_blocks"})
    """The engine's KV cache in blocks: `vllm:cache_config_info`'s `num_gpu_blocks` unless
    set. KV-aware admission is off while it is unknown."""
    kv_block_size: PositiveInt | None = Field(
        default=None, json_schema_extra={"x-default": "learned: block_size"})
    """Tokens per KV block: `vllm:cache_config_info`'s `block_size` unless set."""
    kv_reserve_blocks: NonNegativeInt | None = Field(
        default=None, json_schema_extra={"x-default": "derived: the headroom's fraction"})
    """KV blocks per backend kept for under-share tenants: the same fraction of the cache as
    the headroom's max(1, slots/8) of the slots (1/8 before slots are known)."""
    over_share_priority_demotion: NonNegativeInt = 1
    """Added to the vLLM priority of over-share requests on priority-scheduling backends, so
    that the engine preempts them first under KV pressure."""

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
    """OpenTelemetry traces; off unless `otlp_endpoint` is set."""

    otlp_endpoint: BaseUrl | None = None
    """The base URL of an OTLP/HTTP receiver (a collector's `:4318`); spans go to
    `<url>/v1/traces` as http/protobuf, as with `OTEL_EXPORTER_OTLP_ENDPOINT`. None: no
    tracing, and no tracing work at all."""
    service_name: Name = "weighbridge-sidecar"
    """The `service.name` resource attribute."""
    sample_ratio: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    """The fraction of requests traced (parent-based: a caller's sampled trace is always
    kept)."""

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


class Tokenization(_Model):
    """How prompts are tokenized where a model names its `tokenizer`: on one thread beside
    the event loop, each tenant's prompts in arrival order and the tenants in fair turns by
    bytes, so a tenant's backlog delays another's prompt by at most the one being tokenized.
    A prompt the bounds leave out is estimated, never delayed. Tokenizing costs about
    120-390 µs of CPU per KB of prompt (a byte-level BPE of 2,048 tokens; docs/sidecar.md,
    "Counting text in the engine's tokens")."""

    max_prompt_bytes: PositiveInt = 65_536
    """A longer prompt (its UTF-8: a completion's prompt, a chat's contents) is estimated: one
    prompt holds the thread for at most this many bytes' tokenizing (about 10-20 ms)."""
    max_tenant_pending_bytes: PositiveInt = 262_144
    """A tenant's prompts waiting for the thread or on it, at most; its prompts beyond are
    estimated, so a tenant's burst neither waits long for the thread nor grows its queue."""


class SharedState(_Model):
    """Where the state several sidecar replicas share lives (docs/sidecar.md, "Several
    replicas"): `local` keeps everything in this process (one replica); `redis` shares
    the rate-limit buckets, the tenants' served-token counters and the output estimates."""

    backend: Literal["local", "redis"] = "local"
    """`local`: this process alone; `redis`: shared with every replica using the same Redis
    and `key_prefix` (docs/sidecar.md, "Several replicas")."""
    url: RedisUrl | None = Field(default=None,
                                 json_schema_extra={"x-default": "none; required with redis"})
    """`redis://host:port/db`, `rediss://…` (TLS) or `unix:///path/to/socket`."""
    timeout_ms: PositiveFloat = 5.0
    """One round trip on the admission path; a slower answer counts as Redis being down, and
    the replica falls back to its 1/N share of the limits until it answers again."""
    sync_ms: PositiveInt = 10
    """How often each replica publishes its load (per tenant: in flight, backlogged) and
    reads the others' (one script call, skipped while it is alone; never per streamed
    chunk). Service, estimates and settlements go every 30 ms in one pipelined round trip.
    Shares across replicas are judged on what the others held at the last exchange
    (docs/sidecar.md, "Several replicas")."""
    heartbeat_ms: PositiveInt = 1000
    """A replica registers every `heartbeat_ms`; one silent for 3 beats no longer counts
    towards the N that fallback limits are divided by."""
    key_prefix: Name = "weighbridge"
    """Every key is `{key_prefix}:…`."""
    quota_file: str | None = Field(default="weighbridge-quotas.sqlite3",
                                   json_schema_extra={"x-default": "weighbridge-quotas.sqlite3 "
                                                      "beside the configuration file"})
    """With `local` state, the SQLite file the day and month limits' levels are kept in, so
    that a restart or a crash hands out no quota again (docs/sidecar.md, "Rate limits"). A
    relative path is taken from the configuration file's directory; the directory must be
    writable. A sidecar given no configuration file (embedded in a test or the simulator),
    or None, keeps them in memory only. With `redis`, Redis keeps them."""
    quota_reserve_ahead: float = Field(default=0.01, ge=0, le=1)
    """The part of a day or month limit the quota file is told is spent ahead of the
    admissions that spend it, so that one write covers many: a crash costs a tenant at most
    this part of each limit, and never hands it out twice. 0: one write per admission of
    a tenant with such a limit."""

    @model_validator(mode="after")
    def _url_for_redis(self) -> SharedState:
        if self.backend == "redis" and self.url is None:
            raise PydanticCustomError("missing_url", "url is required with backend redis "
                                      "(redis://host:port/db)")
        return self


class Config(_Model):
    """The sidecar's configuration file."""

    tiers: dict[Name, Tier] = Field(default_factory=default_tiers, min_length=1,
                                    json_schema_extra={"x-default": "interactive, standard, "
                                                       "batch"})
    """Tier name → tier."""
    tenants: dict[Name, Tenant] = Field(default_factory=dict)
    """Tenant name → tenant. Without tenants every request gets 401."""
    endpoints: dict[EndpointPath, Endpoint] = Field(
        default_factory=default_endpoints, json_schema_extra={"x-default": "every served kind"})
    """Endpoint path → endpoint, merged over the defaults, so every served endpoint always
    has a cost model."""
    backends: list[Backend] = Field(min_length=1)
    """The engines, at least one."""
    models: dict[ModelName, Model] = Field(default_factory=dict)
    """Model name → rules for requests naming it."""
    default_model: ModelName | None = None
    """The model a request without `model` is served as: routed to its backends and charged
    to its per-model limits. None: routing uses the first model the first backend lists (what
    vLLM serves such a request with, its first `--served-model-name`), and such requests meet
    no model limit."""
    scheduler: Scheduler = Field(default_factory=Scheduler)
    """The order of service."""
    programs: Programs = Field(default_factory=Programs)
    """How requests name their agent programs."""
    admission: Admission = Field(default_factory=Admission)
    """When a backend takes the next request."""
    routing: RouteField = "prefix_aware"
    """Which backend takes it: a route by its parts (a picker over weighted scorers,
    [Routing](#routing)), or by the name of one of these: `prefix_aware` (`bounded_load` over
    `least_tokens` and `prefix_affinity` at weight 2: the least token work once the
    prompt's cached part is counted free, so a conversation's turns go back to the engine
    holding its history), `least_tokens` (`least_loaded` over `least_tokens`;
    docs/sidecar.md, "Routing"), or the baselines `least_requests` and `round_robin` (the
    pickers of those names)."""
    health_probe: HealthProbe = Field(default_factory=HealthProbe)
    """The backends' active health check."""
    model_discovery: ModelDiscovery = Field(default_factory=ModelDiscovery)
    """How the backends' models are learned."""
    admin_api_keys: list[ApiKeyField] = Field(default_factory=list)
    """Keys that may read `/admin/state`, in the same forms as tenant keys."""
    max_body_bytes: PositiveInt = DEFAULT_MAX_BODY_BYTES
    """Larger request bodies get 413."""
    max_tokens_limit: PositiveInt | None = None
    """The output budget's cap: a request asking for more gets 400, one naming none is
    forwarded with it."""
    client_timeout_ms: PositiveInt = 60_000
    """How long a client may take to send a request's headers, from connecting or from the
    end of its previous request (also the idle keep-alive timeout); a slower one is
    disconnected."""
    client_body_timeout_ms: PositiveInt = 10_000
    """How long a request's body may take to arrive after its headers, as HAProxy's `timeout
    http-request`: a dribbled body gets 408 `request_timeout` before it takes any budget."""
    max_client_connections: PositiveInt = 4096
    """Open client connections per sidecar process; beyond it every request on a new
    connection gets 503 `too_many_connections`. Each costs a descriptor and an upstream one:
    the sidecar raises its open-files limit to twice this plus 64 where the hard limit
    allows, and warns where it does not."""
    tokenization: Tokenization = Field(default_factory=Tokenization)
    """How models' `tokenizer`s count prompts."""
    telemetry: Telemetry = Field(default_factory=Telemetry)
    """OpenTelemetry traces."""
    state: SharedState = Field(default_factory=SharedState)
    """Where replicas share state."""

    _warnings: list[str] = PrivateAttr(default_factory=list)
    _tenant_by_digest: dict[str, str] = PrivateAttr(default_factory=dict)
    _admin_digests: frozenset[str] = PrivateAttr(default_factory=frozenset)

    @field_validator("endpoints", mode="after")
    @classmethod
    def _merge_default_endpoints(cls, value: dict[str, Endpoint]) -> dict[str, Endpoint]:
        return {**default_endpoints(), **value}

    @model_validator(mode="after")
    def _cross_check(self) -> Config:
        issues = self._tier_issues()
        key_owner, key_issues = self._key_owners()
        issues += key_issues + self._backend_issues()
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
        self._admin_digests = frozenset(d for d, loc in key_owner.items() if loc[0] != "tenants")
        return self

    def _tier_issues(self) -> list[Issue]:
        """Ranks used twice; tenants of an unknown tier."""
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
        return issues

    def _key_owners(self) -> tuple[dict[str, tuple[str | int, ...]], list[Issue]]:
        """Where each key (by digest) is declared, and the keys declared twice; the tenants'
        keys are learned (``_tenant_by_digest``) and plain-text keys warned of."""
        # Keys are compared by digest, so 'plain:k' and 'sha256:<sha of k>' are one key.
        issues: list[Issue] = []
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
        self._tenant_by_digest = by_digest
        return key_owner, issues

    def _backend_issues(self) -> list[Issue]:
        """Backend names and URLs declared twice."""
        issues: list[Issue] = []
        first_with: dict[str, int] = {}
        for i, backend in enumerate(self.backends):
            for attr in ("name", "url"):
                value = getattr(backend, attr)
                seen = first_with.setdefault(f"{attr}={value}", i)
                if seen != i:
                    shown = redact_url(value) if attr == "url" else value
                    issues.append(
                        (
                            ("backends", i, attr),
                            f"duplicate backend {attr} '{shown}' (also backends.{seen}.{attr})",
                        )
                    )
        return issues

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
        # reaches it only through BaseModel.__getattr__ after a failed lookup, a slow path
        # on every request (docs/sidecar-performance.md).
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


# Admission settings that make the sidecar tenant-aware; the request-level baseline has none.
FAIRNESS_ADMISSION = ("headroom_slots", "max_prefill_tokens_inflight",
                      "max_backend_prefill_tokens")


def request_level_baseline(sidecar: Mapping[str, Any]) -> dict[str, Any]:
    """The sections of a configuration mapping (a YAML file's) its request-level baseline
    replaces: one FIFO (`fcfs`), round-robin routing, the same admission gate without the
    tenant-aware settings (``FAIRNESS_ADMISSION``; the derived ones apply to tenant-aware
    policies only)."""
    admission = {k: v for k, v in dict(sidecar.get("admission", {})).items()
                 if k not in FAIRNESS_ADMISSION}
    return {"scheduler": {**sidecar.get("scheduler", {}), "policy": "fcfs"},
            "routing": "round_robin", "admission": admission}


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
