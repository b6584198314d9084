"""Per-model figures, for runs whose requests name several models (a base model, another
model, a LoRA adapter): requests by status, TTFT, output tokens per second and each model's
share of the tokens served.

A record's ``model`` is what its request named (weighbridge/records.py); requests that named
none, and every request of a run recorded before records had the field, are grouped as
:data:`UNNAMED`. The breakdown exists only when the records name two or more models: a
single-model run's report is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from weighbridge.analysis.percentiles import Percentiles, by_group
from weighbridge.analysis.tenants import FAILED, _level

UNNAMED = "(none)"  # the group of requests that named no model


@dataclass(frozen=True)
class ModelStats:
    name: str
    requests: int
    by_status: dict[str, int]
    prompt_tokens: int  # served: from usage of the requests that have it
    output_tokens: int
    ttft: Percentiles  # requests that got a first token, any status
    output_tokens_per_s: float | None  # output tokens over the run's duration
    token_share: float | None  # of all tokens served (prompt + output), 0-1
    rejections: dict[str, int] = field(default_factory=dict)  # reason -> count

    @property
    def ok(self) -> int:
        return self.by_status.get("ok", 0)

    @property
    def rejected(self) -> int:
        return self.by_status.get("rejected", 0)

    @property
    def failed(self) -> int:
        return sum(self.by_status.get(s, 0) for s in FAILED)

    @property
    def cancelled(self) -> int:
        return self.by_status.get("cancelled", 0)


def named_models(frame: pd.DataFrame) -> list[str]:
    """The models the records name, by name."""
    return sorted(str(m) for m in frame["model"].dropna().unique())


def model_stats(frame: pd.DataFrame, duration_s: float) -> dict[str, ModelStats]:
    """Per model, by name (then :data:`UNNAMED` when some requests named none); empty when
    the records name fewer than two models."""
    names = named_models(frame)
    if len(names) < 2:
        return {}
    model = frame["model"].astype(object).where(frame["model"].notna(), UNNAMED)
    if (model == UNNAMED).any():
        names.append(UNNAMED)
    grouped = frame.assign(_model=model).groupby("_model", observed=True)
    statuses = grouped["status"].value_counts()
    tokens = grouped[["prompt_tokens", "output_tokens"]].sum()
    rejected = frame["status"] == "rejected"
    reasons = frame[rejected].assign(_model=model[rejected]).groupby(
        ["_model", "reason"], observed=True).size()
    ttft = by_group(frame["ttft_s"], model)
    served = float(tokens["prompt_tokens"].sum() + tokens["output_tokens"].sum())
    empty = Percentiles.of([])
    out: dict[str, ModelStats] = {}
    for name in names:
        by_status = _level(statuses, name)
        prompt = int(tokens["prompt_tokens"].get(name, 0))
        output = int(tokens["output_tokens"].get(name, 0))
        out[name] = ModelStats(
            name=name,
            requests=sum(by_status.values()),
            by_status=by_status,
            prompt_tokens=prompt,
            output_tokens=output,
            ttft=ttft.get(name, empty),
            output_tokens_per_s=output / duration_s if duration_s > 0 else None,
            token_share=(prompt + output) / served if served > 0 else None,
            rejections=_level(reasons, name),
        )
    return out

