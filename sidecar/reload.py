"""Changing a running sidecar's configuration: what a reload may change, checked before
anything changes, and the version every replica shows.

A reload (``SIGHUP``, ``POST /admin/reload``, ``weighbridge reload``) reads the config file
again and validates it completely, with the dotted-path errors of start-up
(``weighbridge.sidecar.config``). :func:`plan` then compares it with the configuration in force and
refuses, at the dotted path of each, what only a restart can change. Nothing changes unless
both pass; then the shell applies the new configuration in one synchronous step, between two
dispatch passes of the single-threaded core (``SchedulingCore.reconfigure``).

What a reload changes live
--------------------------
- ``tenants``: added, removed, or changed in any field (tier, weight, keys, limits). A
  removed tenant's queued requests are answered 503 ``tenant_removed``; its requests in
  flight finish. A removed or rotated key gets 401 from the next request on; streams
  already open are not cut.
- ``admin_api_keys``; the rate limits of ``tiers``, ``endpoints`` (``tenant_limits``) and
  ``models``; a tier's ``vllm_priority``, SLOs, ``stream_interval`` and
  ``cached_prompt_token_weight``, an endpoint's too;
  ``max_tokens_limit``; ``client_body_timeout_ms``.
- ``backends``: added (probed and scraped before it takes work) or removed (drained: no new
  work, its requests in flight finish, then it is forgotten).

What stays with its identity: queued requests, the ledger, bucket levels (what was spent
this window stays spent: sidecar.ratelimit, "Reload"), DRR credit, the learned shape of
every kept backend, the estimator's observations. A backend's identity is its name; a tenant's
its name.

What needs a restart (:data:`RESTART_ONLY`): the fields whose state is built around them
(the tiers' names and ranks, the scheduler, admission, routing, the endpoints' cost models,
the model catalog's default), the listener's (``max_body_bytes``, ``client_timeout_ms``,
``max_client_connections``), and ``telemetry``, ``state``, ``programs``, ``health_probe``
and ``model_discovery``. A kept backend's definition is one too: remove it and add it under
another name, and the old one drains.

Invariants (tests/unit/sidecar/test_reload.py): a config reloaded onto itself changes
nothing; :func:`plan` refuses exactly the configs that differ in a restart-only field; the
version is a function of the validated configuration alone (keys enter it as digests).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from weighbridge.sidecar.config import Backend, Config, ConfigError, load_config

__all__ = ["RESTART_ONLY", "ConfigCollector", "ConfigHolder", "ReadError", "ReloadPlan",
           "ReloadRefused", "config_version", "plan", "read_config"]

# Top-level fields a reload may not change (module doc).
RESTART_ONLY = ("scheduler", "admission", "routing", "health_probe", "model_discovery",
                "default_model", "max_body_bytes", "client_timeout_ms",
                "max_client_connections", "telemetry", "state", "programs")
_RESTART = "changing it needs a restart"
# An endpoint's fields read at each request (the rest shape the scheduler's state).
_ENDPOINT_LIVE = ("tenant_limits", "cached_prompt_token_weight")


class ReloadRefused(ConfigError):
    """A valid configuration that changes what only a restart can."""

    what = "configuration live (kept the one in force)"


@dataclass(frozen=True, slots=True)
class ReloadPlan:
    """What a reload changes, by name (never a key)."""

    tenants_added: tuple[str, ...] = ()
    tenants_removed: tuple[str, ...] = ()
    tenants_changed: tuple[str, ...] = ()  # any field but the keys
    keys_changed: tuple[str, ...] = ()  # tenants whose keys were added, removed or rotated
    admin_keys_changed: bool = False
    backends_added: tuple[str, ...] = ()
    backends_removed: tuple[str, ...] = ()
    other: tuple[str, ...] = ()  # the other reloadable fields that changed, dotted
    version: str = ""  # the new configuration's (config_version), computed with the plan

    @property
    def changes(self) -> bool:
        return any((self.tenants_added, self.tenants_removed, self.tenants_changed,
                    self.keys_changed, self.admin_keys_changed, self.backends_added,
                    self.backends_removed, self.other))

    def as_dict(self) -> dict[str, Any]:
        return {"tenants_added": list(self.tenants_added),
                "tenants_removed": list(self.tenants_removed),
                "tenants_changed": list(self.tenants_changed),
                "keys_changed": list(self.keys_changed),
                "admin_keys_changed": self.admin_keys_changed,
                "backends_added": list(self.backends_added),
                "backends_removed": list(self.backends_removed),
                "other": list(self.other), "version": self.version}

    def summary(self) -> str:
        parts = [f"{what} {', '.join(names)}" for what, names in (
            ("tenants added", self.tenants_added), ("tenants removed", self.tenants_removed),
            ("tenants changed", self.tenants_changed), ("keys changed", self.keys_changed),
            ("backends added", self.backends_added),
            ("backends removed", self.backends_removed), ("changed", self.other)) if names]
        if self.admin_keys_changed:
            parts.append("admin keys changed")
        return "; ".join(parts) or "no change"


def config_version(config: Config) -> str:
    """A content hash of the validated configuration (keys as their digests): equal on two
    replicas exactly when they run the same configuration, whatever the file's layout."""
    return hashlib.sha256(config.model_dump_json().encode()).hexdigest()[:16]


def _without(data: dict[str, Any], *fields: str) -> dict[str, Any]:
    return {k: v for k, v in data.items() if k not in fields}


def plan(old: Config, new: Config, draining: Collection[str] = (),
         source: str = "<config>") -> ReloadPlan:
    """What reloading ``new`` over ``old`` changes; raises :class:`ReloadRefused` listing
    every restart-only change at its dotted path. ``draining``: backends a previous reload
    removed that still finish requests (a new backend may not take such a name yet)."""
    issues: list[tuple[str, str]] = []
    for name in RESTART_ONLY:
        if getattr(old, name) != getattr(new, name):
            issues.append((name, _RESTART))
    other: list[str] = []
    _tier_changes(old, new, issues, other)
    _endpoint_changes(old, new, issues, other)
    if old.models != new.models:
        other.append("models")
    for name in ("max_tokens_limit", "client_body_timeout_ms"):
        if getattr(old, name) != getattr(new, name):
            other.append(name)
    before_backends = {b.name: b for b in old.backends}
    issues += _backend_issues(before_backends, new, draining)
    if issues:
        raise ReloadRefused(source, issues)

    after_backends = {b.name for b in new.backends}
    tenants_changed, keys_changed = _tenant_changes(old, new)
    return ReloadPlan(
        tenants_added=tuple(n for n in new.tenants if n not in old.tenants),
        tenants_removed=tuple(n for n in old.tenants if n not in new.tenants),
        tenants_changed=tuple(sorted(tenants_changed)),
        keys_changed=tuple(sorted(keys_changed)),
        admin_keys_changed={k.digest for k in old.admin_api_keys}
        != {k.digest for k in new.admin_api_keys},
        backends_added=tuple(b.name for b in new.backends if b.name not in before_backends),
        backends_removed=tuple(n for n in before_backends if n not in after_backends),
        other=tuple(other),
        version=config_version(new),
    )


def _tier_changes(old: Config, new: Config, issues: list[tuple[str, str]],
                  other: list[str]) -> None:
    """A tier added, removed or ranked anew needs a restart; its other fields change live."""
    if set(old.tiers) != set(new.tiers):
        issues.append(("tiers", "adding or removing a tier needs a restart"))
    for name in sorted(set(old.tiers) & set(new.tiers)):
        before, after = old.tiers[name], new.tiers[name]
        if before.rank != after.rank:
            issues.append((f"tiers.{name}.rank", _RESTART))
        elif before != after:
            other.append(f"tiers.{name}")


def _endpoint_changes(old: Config, new: Config, issues: list[tuple[str, str]],
                      other: list[str]) -> None:
    """An endpoint added or removed, or changed beyond its live fields, needs a restart."""
    if set(old.endpoints) != set(new.endpoints):
        issues.append(("endpoints", "adding or removing an endpoint needs a restart"))
    for path in sorted(set(old.endpoints) & set(new.endpoints)):
        was, now = old.endpoints[path], new.endpoints[path]
        if _without(was.model_dump(), *_ENDPOINT_LIVE) != \
                _without(now.model_dump(), *_ENDPOINT_LIVE):
            issues.append((f"endpoints.{path}", "only " + " and ".join(_ENDPOINT_LIVE)
                           + " may change without a restart"))
        elif was != now:
            other.append(f"endpoints.{path}")


def _backend_issues(before: Mapping[str, Backend], new: Config,
                    draining: Collection[str]) -> list[tuple[str, str]]:
    """A kept backend changed, or a new one under a name still draining."""
    issues: list[tuple[str, str]] = []
    for i, backend in enumerate(new.backends):
        kept = before.get(backend.name)
        if kept is not None and kept != backend:
            issues.append((f"backends.{i}", f"backend {backend.name!r} changed; remove it "
                           "and add it under another name (it drains), or restart"))
        elif kept is None and backend.name in draining:
            issues.append((f"backends.{i}.name", f"backend {backend.name!r} is still "
                           "draining; add it again once it has drained, or under another name"))
    return issues


def _tenant_changes(old: Config, new: Config) -> tuple[list[str], list[str]]:
    """The kept tenants whose settings changed, and those whose keys changed."""
    tenants_changed, keys_changed = [], []
    for name in old.tenants.keys() & new.tenants.keys():
        before_t, after_t = old.tenants[name], new.tenants[name]
        if before_t == after_t:
            continue  # most of them: no dump to compare
        if {k.digest for k in before_t.api_keys} != {k.digest for k in after_t.api_keys}:
            keys_changed.append(name)
        if _without(before_t.model_dump(), "api_keys") != \
                _without(after_t.model_dump(), "api_keys"):
            tenants_changed.append(name)
    return tenants_changed, keys_changed


@dataclass(frozen=True, slots=True)
class ReadError:
    """A ``ConfigError`` as it crosses a process boundary (the exception itself does not
    pickle: its constructor takes the problems, not the message)."""

    source: str
    errors: list[tuple[str, str]]


def read_config(path: str) -> Config | ReadError:
    """``load_config`` for a worker process: parsing a large file's YAML is seconds of pure
    Python, which in a thread of the sidecar would hold the GIL its streams need."""
    try:
        return load_config(path)
    except ConfigError as e:
        return ReadError(e.source, e.errors)


@dataclass(slots=True)
class ConfigHolder:
    """The configuration in force, where it came from, its version and when it was loaded
    (wall clock, for /metrics and /admin/state), and how reloads went."""

    config: Config
    path: str | None = None  # None: given in code (tests); a reload has nothing to read
    loaded_unix_s: float = field(default_factory=time.time)
    version: str = ""
    reloads: dict[str, int] = field(default_factory=lambda: {"ok": 0, "refused": 0})
    last_error: str | None = None
    # What the file read is put through before it is compared: the picker's discovered
    # backends replace the file's (sidecar.discovery); None: the file as it is.
    overlay: Callable[[Config], Config] | None = None

    def __post_init__(self) -> None:
        self.version = self.version or config_version(self.config)

    def check(self, draining: Collection[str] = (),
              read: Config | ReadError | None = None) -> tuple[Config, ReloadPlan]:
        """Read the file again and validate it against the configuration in force; raises
        ``ConfigError`` (``ReloadRefused`` for restart-only changes), counted and kept as
        ``last_error``, and changes nothing. ``read``: the file already read and validated
        elsewhere (``read_config`` in another process); None: read here."""
        try:
            if self.path is None:
                raise ConfigError("<config>", [("(source)", "the sidecar was given its "
                                               "configuration in code: no file to reload")])
            new = load_config(self.path) if read is None else read
            if isinstance(new, ReadError):
                raise ConfigError(new.source, new.errors)
            if self.overlay is not None:
                new = self.overlay(new)
            return new, plan(self.config, new, draining, self.path)
        except ConfigError as e:
            self.reloads["refused"] += 1
            self.last_error = str(e)
            raise

    def adopt(self, config: Config, version: str = "") -> None:
        """``config`` is in force from now (the shell applied it); ``version``: its, when
        already computed (``ReloadPlan.version``, off the event loop)."""
        self.config = config
        self.version = version or config_version(config)
        self.loaded_unix_s = time.time()
        self.reloads["ok"] += 1
        self.last_error = None

    def snapshot(self) -> dict[str, Any]:
        return {"version": self.version, "loaded_unix_s": self.loaded_unix_s,
                "path": self.path, "reloads": dict(self.reloads),
                "last_error": self.last_error}


class ConfigCollector(Collector):
    """The configuration's version and load time on /metrics, so that replicas running
    different configurations show it (``count(count by (version)
    (weighbridge_config_info)) > 1``)."""

    def __init__(self, holder: ConfigHolder) -> None:
        self.holder = holder

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        holder = self.holder
        info = GaugeMetricFamily("weighbridge_config_info",
                                 "1, labelled with the version (a content hash) of the "
                                 "configuration in force.", labels=["version"])
        info.add_metric([holder.version], 1.0)
        loaded = GaugeMetricFamily("weighbridge_config_loaded_timestamp_seconds",
                                   "When the configuration in force was loaded (Unix time).")
        loaded.add_metric([], holder.loaded_unix_s)
        reloads = CounterMetricFamily("weighbridge_config_reloads",
                                      "Reloads of the configuration, by result (ok, refused: "
                                      "invalid or needing a restart).", labels=["result"])
        for result, n in holder.reloads.items():
            reloads.add_metric([result], n)
        yield from (info, loaded, reloads)
