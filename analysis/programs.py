"""Agent programs: when each program a person started finished, per tenant, with Little's
Law over programs and the tenants' fairness in the tokens they made the server compute.

A record of schema 4 names the program it is a call of (``program_id``), the program that
forked it (``parent_program_id``) and its program's planned calls (``program_calls``). A
program's **family** is the program nobody forked (its root, what a person started) and
every subagent below it, found by following the parent ids. Per family:

* **start** ``s``: the root's first call's scheduled send (the earliest ``scheduled_s`` of
  the family);
* **end** ``e`` and **outcome**, by ``RequestRecord.program_end`` (the one rule, applied
  here to whole columns): ``completed`` at the end of the root's last planned call when it
  ended ok, ``failed`` at the end of the first root call that ended neither ok nor cut off
  by the run, else ``unfinished``, in the system until the run's end ``T``;
* **completion time** ``e - s`` of the completed families: p50/p90/p99/p99.9 per tenant;
* **tokens**: the family's prompt and output tokens, what Little's Law weighs.

Little's Law over programs is the request-level one (analysis/littles_law.py) with each
family as one request from ``s`` to ``e``. Beside them, Jain's index over the computed
tokens of every tenant that sent requests (``TenantStats.computed_tokens``: output, and the
prompt tokens the prefix cache did not answer) per unit of weight says whether one tenant's
programs took another's compute.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from weighbridge.analysis.littles_law import LittlesLaw, littles_law
from weighbridge.analysis.percentiles import Percentiles
from weighbridge.analysis.tenants import TenantStats
from weighbridge.statistics import jain_index

__all__ = ["ProgramStats", "Programs", "program_families", "programs"]

# RequestRecord.program_end, per status: a root's call that ended ok completes its family
# when it was the last planned one; cancelled ends nothing (the run did); any other fails it.
_NOT_FAILED = ("ok", "cancelled")


@dataclass(frozen=True)
class ProgramStats:
    """One tenant's programs (families)."""

    programs: int  # started: families whose root's first call was due in the run
    completed: int
    failed: int
    unfinished: int  # cut off by the run's end
    subagents: int  # forked programs, every level
    completion: Percentiles  # e - s of the completed, seconds
    littles_law: LittlesLaw  # families as the requests


@dataclass(frozen=True)
class Programs:
    families: pd.DataFrame  # program_families
    tenants: dict[str, ProgramStats]  # tenants with programs, in the run's tenant order
    computed_tokens_jain_index: float | None  # over every tenant's computed tokens / weight


def program_families(frame: pd.DataFrame, duration_s: float) -> pd.DataFrame:
    """One row per family: ``tenant``, ``start_s``, ``end_s``, ``outcome`` (completed,
    failed, unfinished), ``tokens``, ``subagents``, indexed by the root's program id."""
    calls = frame[frame["program_id"].notna()]
    columns = ["tenant", "start_s", "end_s", "outcome", "tokens", "subagents"]
    if calls.empty:
        return pd.DataFrame(columns=columns)
    parent = calls.groupby("program_id")["parent_program_id"].first()
    root = pd.Series(parent.index, index=parent.index)
    up = parent.dropna()
    while not up.empty:  # one level of forks per pass
        root[up.index] = up.to_numpy()
        up = up.map(parent).dropna()
    family = calls["program_id"].map(root)
    own = calls["program_id"] == family  # the root's own calls, which end its family
    status = calls["status"].astype(str)
    completed = own & (status == "ok") & (calls["turn"] + 1 >= calls["program_calls"])
    failed = own & ~status.isin(_NOT_FAILED)
    by = calls.assign(family=family).groupby("family")
    out = pd.DataFrame({
        "tenant": by["tenant"].first().astype(str),
        "start_s": by["scheduled_s"].min(),
        "tokens": by["tokens"].sum(),
        "subagents": by["program_id"].nunique() - 1,
    })
    done = calls["end_s"].where(completed).groupby(family).min()
    broke = calls["end_s"].where(failed).groupby(family).min()
    out["outcome"] = np.where(done.reindex(out.index).notna(), "completed",
                              np.where(broke.reindex(out.index).notna(), "failed",
                                       "unfinished"))
    out["end_s"] = done.reindex(out.index).fillna(broke.reindex(out.index)).fillna(
        float(duration_s))
    return out[columns]


def programs(frame: pd.DataFrame, tenants: dict[str, TenantStats], duration_s: float
             ) -> Programs | None:
    """The programs of a run, per tenant of ``tenants`` (every tenant's figures); None when
    its records name none."""
    families = program_families(frame, duration_s)
    if families.empty:
        return None
    stats: dict[str, ProgramStats] = {}
    for name in tenants:
        own = families[families["tenant"] == name]
        if own.empty:
            continue
        outcome = own["outcome"]
        done = own[outcome == "completed"]
        stats[name] = ProgramStats(
            programs=len(own), completed=len(done), failed=int((outcome == "failed").sum()),
            unfinished=int((outcome == "unfinished").sum()),
            subagents=int(own["subagents"].sum()),
            completion=Percentiles.of((done["end_s"] - done["start_s"]).to_numpy()),
            littles_law=littles_law(own.rename(columns={"start_s": "scheduled_s"}),
                                    duration_s))
    sending = [t for t in tenants.values() if t.requests]
    jain = jain_index([t.computed_tokens / t.weight for t in sending]) \
        if len(sending) >= 2 else None
    return Programs(families, stats, jain)
