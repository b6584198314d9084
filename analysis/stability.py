"""Stability: did the system serve the token load it was offered?

Offered tokens of a request: its prompt (from usage; when unknown, e.g. a rejected request,
the mean prompt of its tenant and endpoint's requests that have one) plus its output (an ok
request's usage; otherwise the mean output of its tenant and endpoint's ok requests, capped
at its ``max_tokens``). ``offered_tokens_per_s`` sums them over the requests scheduled in
``[0, T)``, over ``T``. ``served_tokens_per_s`` is the tokens served inside ``[0, T]`` (prompt
at the first token, output spread to the last), over ``T``. Their stability ratio (offered
over served, weighbridge.statistics) stays near 1 in a stable run; a queue that grows without
bound shows as a ratio above 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from weighbridge.analysis.windows import served_tokens
from weighbridge.statistics import stability_ratio

# Stable: served at least 95% of what was offered, i.e. offered/served at most 1/0.95.
MAX_STABLE_RATIO = 1 / 0.95


@dataclass(frozen=True, slots=True)
class Stability:
    duration_s: float
    offered_tokens: float
    served_tokens: float

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


def stability(frame: pd.DataFrame, duration_s: float) -> Stability:
    t = float(duration_s)
    scheduled = frame["scheduled_s"]
    arrived = (scheduled >= 0) & (scheduled < t)
    offered = float(offered_tokens(frame)[arrived].sum())
    served = float(served_tokens(frame, np.array([0.0, t])).sum()) if t > 0 else 0.0
    return Stability(t, offered, served)
