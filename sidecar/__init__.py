"""The fair-scheduling sidecar: a pure, clock-injected scheduling core and its HTTP shell.

The core modules (``request``, ``rejection``, ``ratelimit``, ``estimator``, ``queues``,
``drr``, ``tiers``, ``scheduler`` with its ``fairness`` policies, ``predictor``,
``admission``, ``eligibility``, ``kv``, ``shape``, ``prefix``, ``fleet``, ``routing``,
``cycle``, ``ledger`` and ``core``, which composes them) do no I/O and never read a clock:
every method that depends on time takes ``now`` (seconds, any monotonic origin). The same
code serves the live proxy, the hypothesis properties and virtual-time simulations.
``session`` holds a request's ingress checks and its end for every front; ``app`` is the
aiohttp shell, and ``upstream`` its one client to the backends.

The surface (``__all__``) is what the application and the other parts use: the live sidecar
(``Sidecar``, ``run_sidecar``), its configuration schema (``config``: ``Config``,
``load_config``, ``parse_config``, ``request_level_baseline``...) and the parts it names
(``registered``), the endpoint picker's pool and identity sources (``PoolRef``,
``TrustedSources``), the core and a request's session as the simulator drives them (and
the core as one replica among several, ``Replica``), the
stability and utilisation meter it feeds, and the engine shape and limits the ideal bound
derives. Each name is read from its module on first use (``weighbridge.surface``), so
importing a pure module loads no aiohttp.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weighbridge.surface import surface

if TYPE_CHECKING:
    from weighbridge.sidecar.admission import derive_limits
    from weighbridge.sidecar.app import Sidecar, run_sidecar
    from weighbridge.sidecar.config import (
        EMBEDDINGS,
        Config,
        ConfigError,
        ModelName,
        load_config,
        parse_config,
        request_level_baseline,
    )
    from weighbridge.sidecar.core import Dispatch, SchedulingCore
    from weighbridge.sidecar.discovery import PoolRef
    from weighbridge.sidecar.epp import run_epp
    from weighbridge.sidecar.identity import IdentitySource, TrustedSources
    from weighbridge.sidecar.plugins import registered
    from weighbridge.sidecar.prefix import PromptPrefix
    from weighbridge.sidecar.replica import SERVICE_SYNC_S, Replica
    from weighbridge.sidecar.request import QueuedRequest
    from weighbridge.sidecar.session import (
        ApiError,
        Caller,
        Ingress,
        Prompt,
        RelayOutcome,
        RequestSession,
        Usage,
    )
    from weighbridge.sidecar.shape import EngineShape
    from weighbridge.sidecar.stability import (
        StabilityMeter,
        current_pools,
        learned_step_s,
        step_budget,
    )
else:
    __getattr__, __dir__ = surface(__name__, {
        "admission": ("derive_limits",),
        "app": ("Sidecar", "run_sidecar"),
        "config": ("EMBEDDINGS", "Config", "ConfigError", "ModelName", "load_config",
                   "parse_config", "request_level_baseline"),
        "core": ("Dispatch", "SchedulingCore"),
        "discovery": ("PoolRef",),
        "epp": ("run_epp",),
        "identity": ("IdentitySource", "TrustedSources"),
        "plugins": ("registered",),
        "prefix": ("PromptPrefix",),
        "replica": ("SERVICE_SYNC_S", "Replica"),
        "request": ("QueuedRequest",),
        "session": ("ApiError", "Caller", "Ingress", "Prompt", "RelayOutcome", "RequestSession",
                    "Usage"),
        "shape": ("EngineShape",),
        "stability": ("StabilityMeter", "current_pools", "learned_step_s", "step_budget"),
    })

__all__ = [
    "EMBEDDINGS",
    "SERVICE_SYNC_S",
    "ApiError",
    "Caller",
    "Config",
    "ConfigError",
    "Dispatch",
    "EngineShape",
    "IdentitySource",
    "Ingress",
    "ModelName",
    "PoolRef",
    "Prompt",
    "PromptPrefix",
    "QueuedRequest",
    "RelayOutcome",
    "Replica",
    "RequestSession",
    "SchedulingCore",
    "Sidecar",
    "StabilityMeter",
    "TrustedSources",
    "Usage",
    "current_pools",
    "derive_limits",
    "learned_step_s",
    "load_config",
    "parse_config",
    "registered",
    "request_level_baseline",
    "run_epp",
    "run_sidecar",
    "step_budget",
]
