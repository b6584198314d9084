"""The tenant traffic spec: who sends what, how big, how often, in which phase.

A tenants file is YAML with one list::

    tenants:
      - name: victim
        api_key: sk-victim-demo       # sent as `Authorization: Bearer ...`; none: no header
        tier: interactive             # for the records and the report (the sidecar decides)
        weight: 1
        endpoint: chat                # chat | completions | embeddings (prompt only, never
        stream: true                  #   streamed: set stream: false; output is ignored)
        model: model-a                # the body's `model` (a base model or a LoRA adapter);
                                      #   default: --model, else the server's first model
        ignore_eos: true              # outputs of exactly the drawn length
        users: 20                     # distinct end users (the `user` field), 0: none
        lengths: {prompt: {kind: lognormal, median: 300, sigma: 0.5}, output: 64}
        arrival: {kind: poisson, rate: 2}        # in every phase ...
        phases: {flood: {kind: poisson, rate: 50}, recovery: null}   # ... unless overridden
        system_prompt: {length: 600, shared: support-bot}   # the same text before every prompt
        sessions: {turns: {kind: uniform, low: 2, high: 8}, think_ms: 4000}
        programs: {calls: {kind: uniform, low: 4, high: 12}, tool_ms: 1500, tool_output: 200,
                   subagents: {probability: 0.2, count: 2, calls: 3}}
        identity: [claude_code, agentic_context]   # how its requests name their program

A tenant without ``system_prompt``, ``sessions`` and ``programs`` is in **prefix-free
mode**: no two of its prompts share a prefix. With ``sessions``, ``arrival`` says when
sessions start and ``lengths`` draws each turn's new user message and answer
(weighbridge.loadgen.sessions); with ``programs``, when agent programs start, ``lengths``
drawing each program's task and each call's answer (weighbridge.loadgen.programs).

Problems are reported once, at load, as ``TenantsError`` with one ``path: message`` line each
(``tenants.0.lengths.prompt.low: ...``), naming the file.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    model_validator,
)

from weighbridge import headers as headers_
from weighbridge.loadgen.arrivals import Arrival, Closed
from weighbridge.loadgen.lengths import Distribution, Lengths

__all__ = ["ENDPOINT_PATHS", "HARNESSES", "Harness", "Programs", "Sessions", "Subagents",
           "SystemPrompt", "TenantSpec", "TenantsError", "TenantsFile", "load_tenants"]

Endpoint = Literal["completions", "chat", "embeddings"]
# How a request names its agent program (weighbridge.loadgen.identity): an agent harness's
# headers, or vllm-router's vllm_xargs.agentic_context in the body.
Harness = Literal["claude_code", "opencode", "codex", "agentic_context"]
HARNESSES: tuple[str, ...] = typing.get_args(Harness)
ENDPOINT_PATHS: dict[str, str] = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "embeddings": "/v1/embeddings",
}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SystemPrompt(_Model):
    """A system prompt before every prompt of the tenant: ``length`` tokens, drawn once per
    run from the seed; its text is the same for every request. Tenants naming the same
    ``shared`` text take their prompts from one text, so they share its first
    ``min(length)`` tokens."""

    length: Distribution
    shared: str | None = Field(default=None, min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")


class Sessions(_Model):
    """Multi-turn sessions: each starts at an open-loop arrival of the tenant, has ``turns``
    turns, and sends its next turn ``think_ms`` after the previous answer ended."""

    turns: Distribution
    think_ms: Distribution


class Subagents(_Model):
    """Fork-join: after each of its calls but the last, a program forks ``count`` subagents
    with chance ``probability``; each is a program of ``calls`` calls that starts from its
    parent's context and its own task, and the parent resumes when they have all ended.
    Subagents fork in turn down to ``depth`` levels below the program a person started."""

    probability: float = Field(ge=0, le=1)
    count: Distribution
    calls: Distribution
    depth: PositiveInt = 1


class Programs(_Model):
    """Agent programs: each starts at an open-loop arrival of the tenant with ``calls``
    calls; after each answer but the last its tool runs for ``tool_ms`` and appends
    ``tool_output`` tokens to the context the next call resends (weighbridge.loadgen.programs)."""

    calls: Distribution
    tool_ms: Distribution
    tool_output: Distribution
    subagents: Subagents | None = None


class TenantSpec(_Model):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    api_key: str | None = None
    tier: str = "standard"
    weight: PositiveFloat = 1.0
    endpoint: Endpoint = "completions"
    # The `model` its requests name (as /v1/models lists it: a base model or a LoRA adapter);
    # None: the run's --model, else the first model the target lists.
    model: str | None = Field(default=None, min_length=1, pattern=r"^\S+$")
    stream: bool = True
    ignore_eos: bool = True
    continuous_usage: bool = False  # ask for usage in every chunk (vLLM continuous_usage_stats)
    users: NonNegativeInt = 0
    timeout_s: PositiveFloat = 300.0
    priority: int | None = None  # vLLM's priority field, for servers run with priority policy
    # Ask the sidecar for ``tier`` (x-weighbridge-tier): it schedules the request there, at or
    # below the tenant's own tier, and refuses a higher one (403) or an unknown one (400).
    ask_tier: bool = False
    # x-weighbridge-deadline-ms: the sidecar turns the request away at once (503
    # deadline_unmeetable) when it predicts it cannot start it within this many ms.
    deadline_ms: PositiveFloat | None = None
    headers: dict[str, str] = Field(default_factory=dict)  # any others, sent as given
    lengths: Lengths
    arrival: Arrival | None = None
    phases: dict[str, Arrival | None] = Field(default_factory=dict)
    system_prompt: SystemPrompt | None = None
    sessions: Sessions | None = None
    programs: Programs | None = None
    # How its requests name their agent program, each harness as it sends it (several may
    # be combined); none: they name none.
    identity: tuple[Harness, ...] = ()

    @model_validator(mode="after")
    def _prefix_structure_fits(self) -> TenantSpec:
        if self.endpoint == "embeddings" and (self.system_prompt or self.sessions
                                              or self.programs):
            raise ValueError("system_prompt, sessions and programs: an embeddings tenant "
                             "sends one input, with no prefix structure")
        if self.sessions is not None and self.programs is not None:
            raise ValueError("sessions and programs: a tenant's arrivals start one or the "
                             "other")
        kind = "sessions" if self.sessions is not None else \
            "programs" if self.programs is not None else None
        if kind is not None and any(
                isinstance(a, Closed) for a in (self.arrival, *self.phases.values())):
            raise ValueError(f"{kind}: {kind} arrive open loop; a closed-loop arrival does "
                             "not fit (their requests already wait for answers)")
        if len(set(self.identity)) != len(self.identity):
            raise ValueError("identity: a harness is named twice")
        return self

    @property
    def prefix_free(self) -> bool:
        """No two prompts of the tenant share a prefix (no system prompt, sessions or
        programs)."""
        return self.system_prompt is None and self.sessions is None and self.programs is None

    @model_validator(mode="before")
    @classmethod
    def _embeddings_do_not_stream(cls, data: Any) -> Any:
        # An embeddings answer is one JSON body: the tenant's default (stream: true) does not
        # apply there, and asking for it explicitly is a mistake worth saying.
        if isinstance(data, dict) and data.get("endpoint") == "embeddings":
            if data.get("stream") is True:
                raise ValueError("stream: embeddings are never streamed; set stream: false")
            return {**data, "stream": False}
        return data

    @property
    def path(self) -> str:
        return ENDPOINT_PATHS[self.endpoint]

    @property
    def request_headers(self) -> dict[str, str]:
        """The headers of every request of this tenant, besides its authorization."""
        out = dict(self.headers)
        if self.ask_tier:
            out[headers_.TIER] = self.tier
        if self.deadline_ms is not None:
            out[headers_.DEADLINE_MS] = f"{self.deadline_ms:g}"
        return out

    def arrival_in(self, phase: str) -> Arrival | None:
        """The tenant's traffic in ``phase``: its override there, else its default."""
        if phase in self.phases:
            return self.phases[phase]
        return self.arrival

    def scaled(self, factor: float) -> TenantSpec:
        if factor == 1:
            return self
        return self.model_copy(update={
            "arrival": self.arrival.scaled(factor) if self.arrival else None,
            "phases": {k: v.scaled(factor) if v else None for k, v in self.phases.items()},
        })


class TenantsFile(_Model):
    tenants: list[TenantSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> TenantsFile:
        names = [t.name for t in self.tenants]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"tenant names must be unique; repeated: {', '.join(repeated)}")
        return self

    def check_phases(self, phases: Sequence[str]) -> None:
        """Every phase a tenant mentions must exist in the scenario."""
        known = set(phases)
        problems = [
            f"tenants.{i}.phases.{name}: no phase {name!r} in this scenario "
            f"(phases: {', '.join(phases)})"
            for i, tenant in enumerate(self.tenants)
            for name in tenant.phases
            if name not in known
        ]
        if problems:
            raise TenantsError("\n".join(problems))


class TenantsError(ValueError):
    """A tenants file that cannot be used; the message has one ``path: problem`` per line."""


def _dotted(loc: Sequence[str | int]) -> str:
    # pydantic puts the discriminator tag in the path ("poisson"); users wrote no such key.
    return ".".join(str(p) for p in loc if p not in _TAGS) or "(top level)"


_TAGS = {"fixed", "uniform", "normal", "lognormal", "mixture", "empirical", "poisson",
         "gamma", "burst", "on_off", "closed"}


def parse_tenants(data: Any, *, base_dir: Path, source: str) -> TenantsFile:
    try:
        return TenantsFile.model_validate(data, context={"base_dir": base_dir})
    except ValidationError as exc:
        lines = [f"{_dotted(e['loc'])}: {e['msg']}" for e in exc.errors()]
        raise TenantsError(f"{source}:\n  " + "\n  ".join(lines)) from None


def load_tenants(path: str | Path) -> TenantsFile:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise TenantsError(f"{path}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise TenantsError(f"{path}: not valid YAML: {exc}") from None
    return parse_tenants(data, base_dir=path.parent, source=str(path))
