"""Stability: did the system serve the token load it was offered?

Offered tokens of a request: its prompt (from usage; when unknown, e.g. a rejected request,
the mean prompt of its tenant and endpoint's requests that have one) plus its output (an ok
request's usage; otherwise the mean output of its tenant and endpoint's ok requests, capped
at its ``max_tokens``). ``offered_tokens_per_s`` sums them over the requests scheduled in
``[0, T)``, over ``T``. ``served_tokens_per_s`` is the tokens served inside ``[0, T]`` (prompt
at the first token, output spread to the last), over ``T``. Their stability ratio (offered
over served, weighbridge.statistics) stays near 1 in a stable run; a queue that grows without
bound shows as a ratio above 1.

Utilisation rho, the seed's λ(m_prefill + m_decode) < B / t_step as one number: the offered
tokens per second over the engines' capacity, the sum over backends of the step budget ``B``
over the time ``t_step`` of a full step. The records hold neither, so rho needs them in
``run.json``'s ``options.utilisation`` (``step_budget_tokens`` and ``full_step_s`` per
backend, which ``weighbridge simulate`` writes from the sidecar's own meter); without them
it is undefined, never guessed: the records' inter-token gaps give the *mean* step at the
run's load, which is shorter than a full one, so rho from them would read low (0.49 at 85 % of
capacity in the setting of tests/unit/simulation/test_utilisation_ramp.py). Per backend, the
offered work is the tokens of the requests it served: prompt less its cached tokens, plus
output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from weighbridge.analysis.windows import served_tokens
from weighbridge.statistics import stability_ratio, utilisation

UTILISATION_OPTION = "utilisation"  # run.json options: {step_budget_tokens, full_step_s}

# Stable: served at least 95% of what was offered, i.e. offered/served at most 1/0.95.
MAX_STABLE_RATIO = 1 / 0.95


@dataclass(frozen=True, slots=True)
class Stability:
    duration_s: float
    offered_tokens: float
    served_tokens: float
    # The engines' capacity B / t_step summed (tokens/s); None when run.json lacks it.
    capacity_tokens_per_s: float | None = None
    # Per backend: the tokens of its requests per second over its own B / t_step.
    utilisation_by_backend: dict[str, float] | None = None

    @property
    def utilisation(self) -> float | None:
        """rho: offered tokens per second over the engines' capacity (module doc)."""
        offered = self.offered_tokens_per_s
        if offered is None or self.capacity_tokens_per_s is None:
            return None
        return utilisation(offered, [self.capacity_tokens_per_s])

    @property
    def offered_tokens_per_s(self) -> float | None:
        return self.offered_tokens / self.duration_s if self.duration_s > 0 else None

    @property
    def served_tokens_per_s(self) -> float | None:
        return self.served_tokens / self.duration_s if self.duration_s > 0 else None

    @property
    def ratio(self) -> float | None:
        """The stability ratio: offered over served; None when nothing was either."""
        return stability_ratio(self.offered_tokens, self.served_tokens)

    @property
    def stable(self) -> bool | None:
        return None if self.ratio is None else self.ratio <= MAX_STABLE_RATIO


def offered_tokens(frame: pd.DataFrame) -> pd.Series:
    """Per request: the tokens it asked the system for (see the module docstring)."""
    keys = [frame["tenant"].astype(str), frame["endpoint"].astype(str)]
    prompt = frame["prompt_tokens"]
    prompt = prompt.fillna(prompt.groupby(keys).transform("mean")).fillna(0.0)
    ok = frame["status"] == "ok"
    ok_output = frame["output_tokens"].where(ok)
    typical = ok_output.groupby(keys).transform("mean").fillna(0.0)
    capped = np.minimum(typical, frame["max_tokens"].fillna(np.inf))
    output = ok_output.fillna(capped)
    return prompt + output


def stability(frame: pd.DataFrame, duration_s: float,
              options: dict[str, Any] | None = None) -> Stability:
    """``options``: run.json's, whose ``utilisation`` gives rho (module doc)."""
    t = float(duration_s)
    scheduled = frame["scheduled_s"]
    arrived = (scheduled >= 0) & (scheduled < t)
    offered = offered_tokens(frame)
    served = float(served_tokens(frame, np.array([0.0, t])).sum()) if t > 0 else 0.0
    capacities = step_capacities((options or {}).get(UTILISATION_OPTION))
    if not capacities or t <= 0:
        return Stability(t, float(offered[arrived].sum()), served)
    # What each backend computed: its requests' tokens less the prompt tokens it had cached.
    computed = offered - frame["cached_tokens"].fillna(0.0)
    backends = frame["backend"][arrived].astype(object)
    by_backend = computed[arrived].groupby(backends, observed=True).sum()
    per_backend = {backend: tokens / t / capacities[backend]
                   for backend, tokens in by_backend.items() if backend in capacities}
    return Stability(t, float(offered[arrived].sum()), served,
                     sum(capacities.values()), per_backend)


def step_capacities(recorded: Any) -> dict[str, float]:
    """Each backend's B / t_step from run.json's ``options.utilisation``; empty when absent
    or incomplete."""
    if not isinstance(recorded, dict):
        return {}
    budget = recorded.get("step_budget_tokens")
    steps = recorded.get("full_step_s")
    if not isinstance(budget, (int, float)) or budget <= 0 or not isinstance(steps, dict):
        return {}
    return {str(backend): budget / step for backend, step in steps.items()
            if isinstance(step, (int, float)) and step > 0}
