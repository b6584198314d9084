"""The rules that decide where the next dispatch may go, and for whom: each a small pure
class whose docstring is its reason, composed in one ordered list below.

A dispatch pass (sidecar.cycle) first asks every healthy backend's gate
for its verdict (``AdmissionGate.verdict``: open, headroom or closed, from the engine's own
metrics), then refines it with the **backend rules** in order. The open backends take the
next request of anyone the **open rules** allow on at least one of them, and it goes to one
of those that allow its tenant; failing that, the backends in *headroom* do the same under
the **headroom rules** (tenant-aware policies only; the FIFO baselines treat headroom as
ordinary capacity, since they cannot choose a tenant). A tenant rule judges a tenant on one
backend: it may hold it back only for what the tenant has on that backend, or for a
fleet-wide share stated as such, so that no open backend idles while a tenant it would take
waits (work conservation, tests/unit/sidecar/test_work_conservation.py). A rule reads the state it
is handed and changes nothing, so the order of the lists is the whole composition. (The
records they read are plain slotted dataclasses, not frozen ones: a dispatch decision builds
several, and a frozen one costs nine times as much to make.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from weighbridge.sidecar.admission import AdmissionGate, GateVerdict
from weighbridge.sidecar.kv import KvFootprint
from weighbridge.sidecar.plugins import register
from weighbridge.sidecar.request import QueuedRequest
from weighbridge.sidecar.scheduler import Scheduler

Eligible = Callable[[str], bool]  # tenant -> may it dispatch to this backend now


@dataclass(slots=True)
class Standing:
    """One backend's standing in a dispatch pass: its gate's verdict as the backend rules
    refined it, and whether it is at its KV watermark (under-share tenants only)."""

    backend: str
    verdict: GateVerdict
    kv_tight: bool = False


@dataclass(slots=True)
class BackendState:
    """What the backend rules read of one backend."""

    gate: AdmissionGate
    prefill_tokens: int  # prompt tokens dispatched there and not yet prefilled
    kv: KvFootprint
    tenant_aware: bool  # the policy can choose a tenant (headroom is meaningful)


class BackendRule(Protocol):
    def __call__(self, standing: Standing, state: BackendState) -> Standing: ...


@register("backend_rule", "prefill_backlog")
class PrefillBacklog:
    """Enough prompts already wait to be prefilled on this backend
    (``max_backend_prefill_tokens``): only a light tenant with none of its own among them
    may add one (PrefillBacklogShare), so a herd of long prompts cannot overfill the engine's
    waiting queue, while the prompts of a flood, prefilled a chunk a step for many steps, do
    not hold a light tenant's next prompt behind them for all those steps (closing the gate
    to everyone tripled a flooded victim's TTFT, docs/sidecar.md). The FIFO baselines cannot
    choose a tenant: for them the gate closes."""

    def __call__(self, standing: Standing, state: BackendState) -> Standing:
        backlog = state.gate.limits.max_backend_prefill_tokens
        verdict = standing.verdict
        if (backlog is None or verdict.mode == "closed" or state.gate.inflight <= 0
                or state.prefill_tokens < backlog):
            return standing
        if not state.tenant_aware:
            return replace(standing, verdict=GateVerdict("closed", "prefill_backlog",
                                                         verdict.share_slots))
        return replace(standing, verdict=GateVerdict("headroom", "prefill_backlog",
                                                     verdict.share_slots))


@register("backend_rule", "decode_floor")
class DecodeFloor:
    """The engine decodes below the floor for everyone: more of the tenants that slowed it
    would slow it further, but a tenant under its share, beside others, may still start (its
    first token is what isolation protects; one more sequence costs the others little).
    Closing the gate to all turned a CPU-starved engine into seconds of queueing for the
    victim alone."""

    def __call__(self, standing: Standing, state: BackendState) -> Standing:
        verdict = standing.verdict
        if state.tenant_aware and verdict.reason == "decode_slow":
            return replace(standing, verdict=GateVerdict("headroom", "decode_slow",
                                                         verdict.share_slots))
        return standing


@register("backend_rule", "kv_watermark")
class KvWatermark:
    """At the KV watermark only tenants under their share of it may add more: an over-share
    tenant could make the engine preempt (sidecar.kv), an under-share one is what the
    reserve above the watermark is for."""

    def __call__(self, standing: Standing, state: BackendState) -> Standing:
        watermark = state.gate.limits.kv_watermark
        verdict = standing.verdict
        if (not state.tenant_aware or watermark is None or verdict.mode == "closed"
                or state.kv.blocks() < watermark):
            return standing
        if verdict.mode == "open":
            verdict = GateVerdict("headroom", "kv_headroom", verdict.share_slots)
        return Standing(standing.backend, verdict, kv_tight=True)


BACKEND_RULES: tuple[BackendRule, ...] = (PrefillBacklog(), DecodeFloor(), KvWatermark())


@dataclass(slots=True)
class Pass:
    """What the tenant rules read for one backend in one dispatch pass."""

    standing: Standing
    scheduler: Scheduler
    slots: int  # the pool's share slots: what weighted shares are of
    kv: KvFootprint
    prefill_cap: int | None  # the backend's max_prefill_tokens_inflight
    prefilling: Mapping[str, int]  # prompt tokens still in prefill on this backend, by tenant
    light: frozenset[str]  # tenants not backlogged upstream lately
    headroom_always: bool  # the slot headroom is kept with no light tenant around
    kv_watermark: int
    globally_fair: Eligible | None  # the replicas' global share (None: not binding)


class TenantRule(Protocol):
    def __call__(self, p: Pass) -> Eligible | None: ...


@register("tenant_rule", "pacing")
class Pacing:
    """A tenant with ``max_prefill_tokens_inflight`` prompt tokens still in prefill on this
    backend waits: one tenant's long prompts must not fill the engine's prefill budget."""

    def __call__(self, p: Pass) -> Eligible | None:
        cap, prefilling = p.prefill_cap, p.prefilling
        if cap is None or not p.scheduler.uses_headroom:
            return None
        return lambda tenant: prefilling.get(tenant, 0) < cap


@register("tenant_rule", "global_share")
class GlobalShare:
    """With replicas sharing the backends, a tenant at its weighted share of the slots
    across every replica waits while a tenant of its tier, backlogged on another replica or
    queued on this one, holds less than its own (Replica.set_foreign_load,
    sidecar.replica)."""

    def __call__(self, p: Pass) -> Eligible | None:
        return p.globally_fair


@register("tenant_rule", "decode_floor_share")
class DecodeFloorShare:
    """Below the decode floor a lone tenant keeps the engine to itself, and over-share
    tenants wait (the headroom DecodeFloor opens is for under-share tenants beside
    others)."""

    def __call__(self, p: Pass) -> Eligible | None:
        if p.standing.verdict.reason != "decode_slow":
            return None
        scheduler, slots = p.scheduler, p.slots
        return lambda tenant: (scheduler.share_fraction(tenant) < 1
                               and scheduler.under_share(tenant, slots))


@register("tenant_rule", "prefill_backlog_share")
class PrefillBacklogShare:
    """At the prefill backlog a tenant may add a prompt only if it is light (not backlogged
    upstream: this request is its only one queued, or it was light lately), under its
    weighted share of the slots, and has nothing of its own in prefill on this backend: it
    adds at most one prompt to the backlog, and the backlogged tenants that built it, or
    that would pile onto it, add none."""

    def __call__(self, p: Pass) -> Eligible | None:
        if p.standing.verdict.reason != "prefill_backlog":
            return None
        scheduler, slots, prefilling, light = p.scheduler, p.slots, p.prefilling, p.light
        return lambda tenant: (
            tenant not in prefilling
            and (tenant in light or scheduler.tenant_queued(tenant)[0] <= 1)
            and scheduler.under_share(tenant, slots))


@register("tenant_rule", "slot_headroom")
class SlotHeadroom:
    """The slots above the share cap are for tenants under their weighted share; with
    work-conserving headroom (``headroom_always`` off) they are kept only while a light
    tenant other than the asker has been around lately."""

    def __call__(self, p: Pass) -> Eligible | None:
        if p.standing.verdict.reason != "headroom":
            return None
        scheduler, slots = p.scheduler, p.slots
        if p.headroom_always:
            return lambda tenant: scheduler.under_share(tenant, slots)
        light = p.light
        if not light:
            return None
        return lambda tenant: scheduler.under_share(tenant, slots) or not light - {tenant}


@register("tenant_rule", "kv_reserve")
class KvReserve:
    """Above the KV watermark the reserve is for light tenants (not backlogged upstream:
    this request is their only one queued, or they were light lately), each up to its
    weighted share of the watermark. Backlogged tenants all stop at the watermark, so among
    them DRR's token accounting alone decides who fills the cache below it: a partition of
    KV blocks by weight is fair in memory, not in tokens, and skewed backlogged tenants'
    token shares by up to 1.23x (test_token_fairness_drr_vs_rr)."""

    def __call__(self, p: Pass) -> Eligible | None:
        if not p.standing.kv_tight:
            return None
        scheduler, kv, watermark, light = p.scheduler, p.kv, p.kv_watermark, p.light
        return lambda tenant: (
            (tenant in light or scheduler.tenant_queued(tenant)[0] <= 1)
            and kv.tenant_blocks(tenant) < scheduler.share_fraction(tenant) * watermark)


def kv_fit(rules: tuple[TenantRule, ...], p: Pass) -> Callable[[QueuedRequest], bool] | None:
    """At the KV watermark, a short request of a tenant KvReserve holds back goes anyway: one
    whose ``max_tokens`` ends it before the mean of the requests in flight there ends, and
    keeps our requests under the watermark for its whole life
    (``KvFootprint.peak_with``), when every other rule lets its tenant in. The watermark's
    sum counts every answer at its final size at once, so a tenant's short requests waited
    behind its own long answers there, though they end before those grow (decision 0018,
    "The held head"). Only a request's own bound counts, not its expected output: a bimodal
    tenant's answer expected at the mix's mean runs to its long mode a fifth of the time
    (kv_pressure's runner made the engine preempt 48 times a minute). And only a short one:
    a flood's requests, each as long as those in flight, filled the cache to the watermark's
    exact peak for no more output and pushed a victim's TTFT p90 up to 1.5x the ideal.
    None: the backend is not at its watermark."""
    if not p.standing.kv_tight:
        return None
    others = eligible(tuple(r for r in rules if not isinstance(r, KvReserve)), p)
    kv, watermark = p.kv, p.kv_watermark

    def fits(request: QueuedRequest) -> bool:
        bound, n = request.max_tokens, request.sequences
        return (bound is not None
                and bound < kv.mean_steps_left()
                and (others is None or others(request.tenant))
                and kv.peak_with(request.prompt_tokens, bound * n, n) <= watermark)

    return fits


OPEN_RULES: tuple[TenantRule, ...] = (Pacing(), GlobalShare())
HEADROOM_RULES: tuple[TenantRule, ...] = (PrefillBacklogShare(), DecodeFloorShare(),
                                          SlotHeadroom(), KvReserve(), Pacing(),
                                          GlobalShare())


def eligible(rules: tuple[TenantRule, ...], p: Pass) -> Eligible | None:
    """Every rule's predicate at once; None when no rule restricts anyone."""
    predicates = [e for rule in rules if (e := rule(p)) is not None]
    if not predicates:
        return None
    if len(predicates) == 1:
        return predicates[0]
    return lambda tenant: all(e(tenant) for e in predicates)


def refine(gate_verdict: GateVerdict, backend: str, state: BackendState) -> Standing:
    """The gate's verdict through every backend rule, in order."""
    standing = Standing(backend, gate_verdict)
    for rule in BACKEND_RULES:
        standing = rule(standing, state)
    return standing


def cache_pays_prefill(backlog: int, limit: int | None, computed: int, saved: int) -> bool:
    """Whether a prefill limit that holds a backend back (``limit`` prompt tokens still in
    prefill there, ``backlog`` now; None: no limit) lets a request through anyway, the
    backend holding more of its prompt than any open one: when the prefill its cache saves
    (``saved``: the tokens the request would compute on the best open backend, less the
    ``computed`` ones it computes here) pays for what it takes past the limit. So a prefix's
    holder is not passed over while it prefills another prompt, and the limit is overshot by
    less than the one prompt's cached part."""
    return limit is None or backlog + computed <= limit + saved
