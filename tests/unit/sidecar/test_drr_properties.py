"""Hypothesis properties of the fairness policies' flow choice, run over every registered
policy that chooses among tenants (sidecar.fairness: DRR and the ones after it): the bound
on two backlogged flows' service, forfeits counted, no starvation, no pick missing work;
then the tighter bounds DRR itself states (sidecar/drr.py) and its credit identities.

Units: costs are in the policy's unit (turns: cost / endpoint quantum), flow ``i`` has weight
``w_i`` (DRR: ``w_i`` turns a round), and service is compared weight-normalised (``x_i =
booked service / w_i``). In tokens, with one endpoint of quantum ``Q``, multiply every bound
by ``Q``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weighbridge.sidecar.drr import DeficitRoundRobin
from weighbridge.sidecar.fairness import Fairness
from weighbridge.sidecar.plugins import registered

# Every registered policy that chooses among tenants: its flow structure is what is tested.
FLOW_POLICIES = [name for name, policy in registered("fairness").items() if policy.per_tenant]

EPS = 1e-9
WEIGHTS = st.sampled_from([0.25, 0.5, 1.0, 1.5, 2.0, 4.0])
COSTS = st.floats(min_value=0.05, max_value=3.0, allow_nan=False, allow_infinity=False)


@dataclass
class Model:
    """Runs ops against a DRR and records, after every op, each flow's weight-normalised
    booked service and whether it is backlogged."""

    weights: list[float]
    drr: Fairness = field(default_factory=DeficitRoundRobin)
    queues: list[list[float]] = field(default_factory=list)
    booked: list[float] = field(default_factory=list)
    max_cost: list[float] = field(default_factory=list)
    # per flow, per backlog period: |adjustments| since activation + debt carried into it
    adjust_budget: list[float] = field(default_factory=list)
    history: list[tuple[list[float], list[bool], list[float]]] = field(default_factory=list)
    served: list[int] = field(default_factory=list)  # flow served by each decision
    # per snapshot, each flow's weight-normalised forfeit (quanta lost to pass-overs)
    forfeited: list[list[float]] = field(default_factory=list)
    # Called with each picked flow before it is charged (what a test checks at that moment).
    on_pick: Callable[[str], None] | None = None
    turn: float = math.inf  # what a visit may spend (sidecar.drr, "Turn size")

    def __post_init__(self) -> None:
        n = len(self.weights)
        for i, w in enumerate(self.weights):
            self.drr.add(str(i), w)
        self.queues = [[] for _ in range(n)]
        self.booked = [0.0] * n
        self.max_cost = [0.0] * n
        self.adjust_budget = [0.0] * n

    def snapshot(self) -> None:
        self.history.append(
            (
                [b / w for b, w in zip(self.booked, self.weights, strict=True)],
                [bool(q) for q in self.queues],
                list(self.adjust_budget),
            )
        )
        self.forfeited.append([self.drr.forfeited(str(i)) / w
                               for i, w in enumerate(self.weights)])

    def enqueue(self, i: int, cost: float) -> None:
        if not self.queues[i]:
            self.adjust_budget[i] = max(0.0, -self.drr.credit(str(i)))
            self.drr.activate(str(i))
        self.queues[i].append(cost)
        self.max_cost[i] = max(self.max_cost[i], cost)

    def decide(self, ineligible: int = 0) -> int | None:
        """One decision; flows whose bit is set in ``ineligible`` are passed over."""
        flow = self.drr.pick(lambda f: not ineligible >> int(f) & 1) if ineligible else (
            self.drr.pick())
        if flow is None:
            assert ineligible or not any(self.queues), (
                "a backlogged flow exists but pick() found none")
            return None
        if self.on_pick is not None:
            self.on_pick(flow)
        i = int(flow)
        cost = self.queues[i].pop(0)
        self.drr.consume(flow, cost, backlogged=bool(self.queues[i]), turn=self.turn)
        self.booked[i] += cost
        self.served.append(i)
        return i

    def adjust(self, i: int, delta: float) -> None:
        self.drr.adjust(str(i), delta)
        self.booked[i] += delta
        self.adjust_budget[i] += abs(delta)

    def cancel(self, i: int) -> None:
        if self.queues[i]:
            self.queues[i].pop()
            if not self.queues[i]:
                self.drr.deactivate(str(i))

    def apply(self, kind: str, i: int, value: float) -> int | None:
        """One op of the strategies below; a decision's flow served (None: none, or not a
        decision)."""
        i %= len(self.weights)
        if kind == "enq":
            self.enqueue(i, value)
        elif kind == "dec":
            return self.decide()
        elif kind == "cancel":
            self.cancel(i)
        elif kind == "skip":
            return self.decide(ineligible=i)
        else:
            self.adjust(i, value)
        return None


OPS_PLAIN = st.one_of(
    st.tuples(st.just("enq"), st.integers(0, 3), COSTS),
    st.tuples(st.just("dec"), st.just(0), st.just(0.0)),
    st.tuples(st.just("dec"), st.just(0), st.just(0.0)),
    st.tuples(st.just("cancel"), st.integers(0, 3), st.just(0.0)),
)
ADJUST = st.tuples(
    st.just("adj"),
    st.integers(0, 3),
    st.floats(min_value=-2.0, max_value=2.0, allow_nan=False, allow_infinity=False),
)
OPS_ADJUSTED = st.one_of(OPS_PLAIN, ADJUST)
# A decision with some flows ineligible (admission passing them over): a bit mask of flows.
PASS_OVER = st.tuples(st.just("skip"), st.integers(1, 14), st.just(0.0))
OPS_PASSED_OVER = st.one_of(OPS_PLAIN, PASS_OVER, PASS_OVER)
# A visit's turn, apart from the quantum: the whole round's credit, one request (any cost
# spends it), or half a quantum. Shares and bounds are the same for every one.
TURNS = [math.inf, 1e-9, 0.5]


def run(weights: list[float], ops: list[tuple[str, int, float]], model: Model | None = None,
        policy: str = "drr", turn: float = math.inf):
    model = model or Model(weights, registered("fairness")[policy](), turn=turn)
    model.snapshot()
    for op in ops:
        model.apply(*op)
        model.snapshot()
    return model


def backlogged_spans(history, i: int, j: int):
    """Maximal [start, end] index ranges where both i and j are backlogged at every snapshot."""
    start = None
    for k, (_, backlog, _) in enumerate(history):
        both = backlog[i] and backlog[j]
        if both and start is None:
            start = k
        if not both and start is not None:
            yield start, k - 1
            start = None
    if start is not None:
        yield start, len(history) - 1


def check_sliding_bound(model: Model, adjusted: bool, forfeits: bool = False,
                        generic: bool = False) -> None:
    """With ``forfeits``, each flow's service is counted with the quanta it forfeited;
    ``generic``: the bound every registered policy keeps, else DRR's own (tighter)."""
    w, c = model.weights, model.max_cost
    n = len(w)
    widest = max((c[k] + 2 * max(h[2][k] for h in model.history)) / w[k] for k in range(n))
    for i in range(n):
        for j in range(i + 1, n):
            for start, end in backlogged_spans(model.history, i, j):
                # Without adjustments a carried debt is an overshoot (< C) and needs no term.
                budget_i = budget_j = 0.0
                if adjusted:
                    budget_i = max(model.history[k][2][i] for k in range(start, end + 1))
                    budget_j = max(model.history[k][2][j] for k in range(start, end + 1))
                if generic:
                    # One quantum a round and a maximal request per flow (the widest of any
                    # flow: it may be the one served between them), adjustments twice.
                    bound = 2 + 2 * widest + EPS
                else:
                    bound = (
                        2 + (c[i] + 2 * budget_i) / w[i] + (c[j] + 2 * budget_j) / w[j] + EPS
                    )
                for a in range(start, end + 1):
                    xa = model.history[a][0]
                    fa = model.forfeited[a] if forfeits else [0.0] * n
                    for b in range(a + 1, end + 1):
                        xb = model.history[b][0]
                        fb = model.forfeited[b] if forfeits else [0.0] * n
                        diff = ((xb[i] + fb[i] - xa[i] - fa[i])
                                - (xb[j] + fb[j] - xa[j] - fa[j]))
                        assert abs(diff) < bound, (i, j, a, b, diff, bound)


@dataclass(frozen=True)
class Bound:
    """One sliding-window bound on two backlogged flows' weight-normalised service: the ops
    it holds under, and how it counts (``check_sliding_bound``'s flags)."""

    ops: st.SearchStrategy[tuple[str, int, float]]
    adjusted: bool
    forfeits: bool = False
    generic: bool = False


# Over any interval in which two flows i and j are both backlogged, |dx_i - dx_j| stays below:
BOUNDS = {
    # every policy, forfeits counted: 2 + 2 max_k (C_k + 2 A_k) / w_k (one quantum a round
    # and a maximal request, with its adjustments, per flow);
    "generic": Bound(st.one_of(OPS_ADJUSTED, PASS_OVER), adjusted=True, forfeits=True,
                     generic=True),
    # DRR, classic: 2 + C_i/w_i + C_j/w_j (2Q + Max in tokens);
    "drr": Bound(OPS_PLAIN, adjusted=False),
    # DRR with adjustments (settlement, streamed charges) at arbitrary times: that plus
    # 2A_i/w_i + 2A_j/w_j, A bounding a flow's |adjustments| within one backlog period;
    "drr_adjusted": Bound(OPS_ADJUSTED, adjusted=True),
    # DRR with pass-overs: a flow passed over (ineligible) while others are served is not
    # compensated, so the classic bound holds once each flow's forfeited quanta are counted
    # as service, |d(x_i + F_i/w_i) - d(x_j + F_j/w_j)|; this is what a fairness check adds
    # to its margin (weighbridge_drr_quanta_forfeited).
    "drr_passed_over": Bound(OPS_PASSED_OVER, adjusted=False, forfeits=True),
}
BOUND_CASES = [(policy, "generic") for policy in FLOW_POLICIES] + [
    ("drr", "drr"), ("drr", "drr_adjusted"), ("drr", "drr_passed_over")]


@settings(max_examples=300, deadline=None)
@given(weights=st.lists(WEIGHTS, min_size=2, max_size=4), data=st.data())
@pytest.mark.parametrize(("policy", "bound"), BOUND_CASES)
@pytest.mark.parametrize("turn", TURNS)
def test_two_backlogged_flows_service_stays_within_the_bound(policy, bound, turn, weights,
                                                             data) -> None:
    """Every registered policy keeps the generic bound (``BOUNDS``); DRR keeps its own,
    tighter ones, whatever a visit's turn."""
    case = BOUNDS[bound]
    ops = data.draw(st.lists(case.ops, max_size=120), label="ops")
    check_sliding_bound(run(weights, ops, policy=policy, turn=turn), adjusted=case.adjusted,
                        forfeits=case.forfeits, generic=case.generic)


@settings(max_examples=300, deadline=None)
@given(
    weights=st.lists(WEIGHTS, min_size=2, max_size=4),
    ops=st.lists(OPS_PASSED_OVER, max_size=120),
)
@pytest.mark.parametrize("policy", FLOW_POLICIES)
def test_the_forfeit_count_never_decreases(policy, weights, ops) -> None:
    """It is exported as a counter (weighbridge_drr_quanta_forfeited_total) and read over a
    window: a pass-over still going on is in it, and a flow that empties keeps what it lost."""
    model = run(weights, ops, policy=policy)
    for before, after in itertools.pairwise(model.forfeited):
        for i in range(len(weights)):
            assert after[i] >= before[i] - EPS, (i, before, after)


def test_a_flow_passed_over_forfeits_the_rounds_others_were_served() -> None:
    model = Model([1.0, 1.0])
    for _ in range(4):
        model.enqueue(0, 1.0)
        model.enqueue(1, 1.0)
    assert model.decide() == 0  # round 1
    for _ in range(3):  # flow 0 ineligible: flow 1 is served in rounds 1, 2 and 3
        assert model.decide(ineligible=0b01) == 1
    assert model.drr.forfeited("1") == 0
    # The pass-over is counted while it goes on: a window ending now sees it.
    assert model.drr.forfeited("0") == 1.0
    # Flow 0 kept its place (keyed for round 2) and is served first, but in round 3: its
    # round 2 went to flow 1 and is not given back.
    assert model.decide() == 0
    assert model.drr.forfeited("0") == 1.0
    assert model.booked[1] - model.booked[0] == 1.0 == model.drr.forfeited("0")


@settings(max_examples=300, deadline=None)
@given(
    weights=st.lists(WEIGHTS, min_size=2, max_size=4),
    first=st.lists(COSTS, min_size=4, max_size=4),
    ops=st.lists(OPS_PLAIN, max_size=120),
)
@pytest.mark.parametrize("turn", TURNS)
def test_common_start_bound_is_one_quantum_plus_one_request(turn, weights, first,
                                                            ops) -> None:
    """Flows that become backlogged together (same round, no debt) stay within
    one quantum plus one weight-normalised maximal request of each other for as long as
    both stay backlogged: |dx_i - dx_j| < 1 + max(C_i/w_i, C_j/w_j) (Q + C/w in tokens)."""
    model = Model(weights, turn=turn)
    for i in range(len(weights)):
        model.enqueue(i, first[i])
    run(weights, ops, model)
    w, c = model.weights, model.max_cost
    x0 = model.history[0][0]
    for i in range(len(w)):
        for j in range(i + 1, len(w)):
            bound = 1 + max(c[i] / w[i], c[j] / w[j]) + EPS
            for x, backlog, _ in model.history:
                if not (backlog[i] and backlog[j]):
                    break  # the guarantee is for the common backlog period
                diff = (x[i] - x0[i]) - (x[j] - x0[j])
                assert abs(diff) < bound, (i, j, diff, bound)


@settings(max_examples=300, deadline=None)
@given(
    weights=st.lists(WEIGHTS, min_size=2, max_size=5),
    ops=st.lists(OPS_PLAIN, max_size=150),
)
@pytest.mark.parametrize("policy", FLOW_POLICIES)
@pytest.mark.parametrize("turn", TURNS)
def test_no_backlogged_flow_starves(policy, turn, weights, ops) -> None:
    """A backlogged flow is served within (floor(C/w) + 2) * sum_j ceil(w_j/c_min)
    decisions, C/w the widest maximal request of any flow: it is at most floor(C/w) + 1
    rounds (DRR; VTC: that much weight-normalised service) ahead, and in each every other
    flow serves at most ceil(w_j / c_min) requests."""
    model = Model(weights, registered("fairness")[policy](), turn=turn)
    n = len(weights)
    waited = [0] * n
    c_min = 0.05  # COSTS' lower bound
    for kind, i, value in ops:
        before = [bool(q) for q in model.queues]
        served = model.apply(kind, i, value)
        if kind == "cancel" and not model.queues[i % n]:
            waited[i % n] = 0
        elif kind == "dec":
            for k in range(n):
                if k == served or not model.queues[k]:
                    waited[k] = 0
                elif before[k]:
                    waited[k] += 1
                    rounds = math.floor(max(max(model.max_cost[j], c_min) / weights[j]
                                            for j in range(n))) + 2
                    per_round = sum(
                        math.ceil(weights[j] / c_min) for j in range(n) if j != k
                    )
                    assert waited[k] <= rounds * per_round


@settings(max_examples=200, deadline=None)
@given(
    weights=st.lists(WEIGHTS, min_size=1, max_size=4),
    ops=st.lists(OPS_ADJUSTED, max_size=150),
)
@pytest.mark.parametrize("policy", FLOW_POLICIES)
def test_pick_never_misses_work(policy, weights, ops) -> None:
    """Whatever the adjustments, a pick finds a flow exactly when one is backlogged."""
    model = Model(weights, registered("fairness")[policy]())
    for kind, i, value in ops:
        backlogged = any(model.queues)
        served = model.apply(kind, i, value)
        if kind == "dec":
            assert (served is None) == (not backlogged)


@settings(max_examples=200, deadline=None)
@given(
    weights=st.lists(WEIGHTS, min_size=1, max_size=4),
    ops=st.lists(OPS_ADJUSTED, max_size=150),
)
def test_drr_credit_is_positive_when_picked_and_idle_flows_bank_none(weights, ops) -> None:
    model = Model(weights)

    def picked(flow: str) -> None:
        assert model.drr.credit(flow) > 0

    model.on_pick = picked
    for kind, i, value in ops:
        backlogged = any(model.queues)
        served = model.apply(kind, i, value)
        if kind == "dec":
            assert (served is None) == (not backlogged)
        assert model.drr.active_count == sum(1 for q in model.queues if q)
        for k, q in enumerate(model.queues):
            if not q:
                assert model.drr.credit(str(k)) <= 0  # idle flows never bank credit


def test_common_start_bound_is_nearly_attained() -> None:
    """The bound is not slack: a flow that spends its quantum on small requests and then
    overshoots with one maximal request leads by 1 + C - epsilon."""
    model = Model([1.0, 1.0])
    for _ in range(19):
        model.enqueue(0, 0.05)
    model.enqueue(0, 3.0)
    model.enqueue(0, 3.0)
    model.enqueue(1, 3.0)
    model.enqueue(1, 3.0)
    for _ in range(20):
        assert model.decide() == 0
    lead = model.booked[0] - model.booked[1]
    assert 1 + 3.0 - 0.1 < lead < 1 + 3.0


def test_a_turn_of_one_request_rotates_tenants_with_shares_unchanged() -> None:
    """Two flows of weight 1 and 2, requests of an eighth of a quantum: with the whole round
    a visit, each serves its round's credit in a run (8, then 16); with a turn of one request
    they alternate, and over whole rounds each is served its weight's share all the same."""
    for turn, runs in ((math.inf, [8, 16]), (1e-9, [1, 1])):
        model = Model([1.0, 2.0], turn=turn)
        for _ in range(300):
            model.enqueue(0, 0.125)
            model.enqueue(1, 0.125)
        for _ in range(144):  # 6 whole rounds of 8 + 16 requests
            model.decide()
        lengths = [len(list(g)) for _, g in itertools.groupby(model.served)]
        assert lengths[:2] == runs
        assert model.booked == [6.0, 12.0]
