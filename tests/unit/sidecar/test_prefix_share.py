"""sidecar.prefix.CacheShare and the prefix index's share bound, in virtual time: the engine's
prefix-cache lookups (``vllm:prefix_cache_queries_total``, counted when the engine admits a
request) against the prompt tokens the sidecar sent (counted at dispatch), and the index
bounded by that share of the engine's cache."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import generate_latest

from tests.unit.sidecar.test_core import arrive
from tests.unit.sidecar.test_prefix_routing import BLOCK, cache_shape, core_with
from weighbridge.emulator.engine import EngineConfig, StepModel
from weighbridge.emulator.metrics import EngineMetrics
from weighbridge.emulator.profiles import get_profile
from weighbridge.sidecar.prefix import (
    ADMITTED_HELD,
    SHARE_FLOOR,
    SHARE_HOLD_S,
    SHARE_MIN_TOKENS,
    SHARE_WINDOW_S,
    CacheShare,
    PrefixIndex,
    PromptPrefix,
)
from weighbridge.sidecar.replica import Replica
from weighbridge.sidecar.request import QueuedRequest
from weighbridge.vllm_metrics import BackendSample, parse_vllm_metrics

# Requests: (gap since the previous dispatch s, prompt tokens, dispatch-to-admission lag s,
# admission-to-first-token lag s).
requests = st.lists(st.tuples(st.floats(0.0, 2.0), st.integers(1, 4000), st.floats(0.0, 60.0),
                              st.floats(0.0, 30.0)), max_size=80)
scrape_gaps = st.lists(st.floats(0.01, 3.0), min_size=1, max_size=120)


def replay(reqs: list[tuple[float, int, float, float]], scrapes: list[float],
           foreign_rate: float = 0.0) -> list[float]:
    """The sidecar sends ``reqs``; the engine admits each after its lag (and others' prompts
    at ``foreign_rate`` tokens/s) and answers its first token later; a scrape at each of
    ``scrapes`` reads the engine's lookups. The share after each scrape."""
    share = CacheShare()
    events: list[tuple[float, int, str, int]] = []  # (at, order, kind, tokens)
    t = 0.0
    for gap, tokens, admit, first in reqs:
        t += gap
        events += [(t, 0, "sent", tokens), (t + admit, 1, "admit", tokens),
                   (t + admit + first, 2, "first", tokens)]
    events += [(at, 3, "scrape", 0) for at in scrapes]
    engine, shares = 0.0, []
    for at, _, kind, tokens in sorted(events):
        if kind == "sent":
            share.sent(tokens)
        elif kind == "admit":
            engine += tokens
        elif kind == "first":
            share.admitted(tokens, at)
        else:
            shares.append(share.observe(at, engine + foreign_rate * at))
    return shares


def scrape_times(gaps: list[float]) -> list[float]:
    times, at = [], 0.0
    for gap in gaps:
        at += gap
        times.append(at)
    return times


@given(reqs=requests, gaps=scrape_gaps)
def test_with_only_its_own_traffic_the_share_stays_whole(
        reqs: list[tuple[float, int, float, float]], gaps: list[float]) -> None:
    """Whenever the engine admits the sidecar's prompts, and however late their first token
    comes back, the engine's lookups are all the sidecar's: the whole cache."""
    assert set(replay(reqs, scrape_times(gaps))) <= {1.0}


@given(counters=st.lists(st.tuples(st.floats(0.0, 10.0), st.floats(0.0, 1e6),
                                   st.integers(-1000, 100_000), st.integers(0, 100_000)),
                         max_size=60))
def test_the_share_stays_between_its_floor_and_one(
        counters: list[tuple[float, float, int, int]]) -> None:
    """Any counters (restarts included) and any prompts sent and admitted."""
    share, at = CacheShare(), 0.0
    for gap, engine, sent, admitted in counters:
        at += gap
        share.sent(sent)
        share.admitted(admitted, at)
        assert SHARE_FLOOR <= share.observe(at, engine) <= 1.0


@given(per_poll=st.integers(20, 5000), fraction=st.floats(0.05, 0.95),
       poll=st.floats(0.05, 2.0))
def test_with_others_sending_the_share_follows_the_sidecar_s_part(
        per_poll: int, fraction: float, poll: float) -> None:
    """The sidecar sends ``per_poll`` tokens a poll (at least 200 tokens/s: the window then
    holds enough lookups), others the rest of the engine's lookups, so that the sidecar's
    part is ``fraction``; its prompts are admitted a second after they are sent, and answer
    a second later. The share errs up only by the prompts awaiting their first token (2 s of
    the sidecar's traffic) over the window's lookups."""
    per_poll = max(per_poll, round(200 * poll))
    own = per_poll / poll
    foreign = own * (1 - fraction) / fraction
    share, at = CacheShare(), 0.0
    while at < 6 * SHARE_WINDOW_S:
        share.sent(per_poll)
        share.admitted(per_poll, at + 2.0)
        at += poll
        share.observe(at, foreign * at + own * max(0.0, at - 1.0))
    expected = max(SHARE_FLOOR, fraction)
    assert expected - 0.01 <= share.share <= min(1.0, expected * (1 + 2.0 / SHARE_WINDOW_S)) + 0.01


def test_too_few_lookups_do_not_move_the_share_and_a_restart_counts_from_zero() -> None:
    share = CacheShare()
    share.observe(0.0, 0.0)
    # Others' lookups, but fewer than the window needs: still the whole cache.
    assert share.observe(1.0, SHARE_MIN_TOKENS - 1) == 1.0
    share.sent(SHARE_MIN_TOKENS)
    share.admitted(SHARE_MIN_TOKENS, 1.5)
    # Enough, but held for SHARE_HOLD_S: the estimate of one scrape does not lower it.
    assert share.observe(2.0, 4 * SHARE_MIN_TOKENS) == 1.0
    later = 2.0 + SHARE_HOLD_S
    assert share.observe(later, 4 * SHARE_MIN_TOKENS) < 0.5
    low = share.share
    # The engine restarted: its counter counts from 0 again, all of it the sidecar's.
    share.sent(4 * SHARE_MIN_TOKENS)
    share.admitted(4 * SHARE_MIN_TOKENS, later + 0.5)
    assert share.observe(later + 1, 4 * SHARE_MIN_TOKENS) > low
    # A scrape older than the last is ignored.
    assert share.observe(later, 0.0) == share.share


def test_the_engine_s_hit_rate_is_over_the_window() -> None:
    share = CacheShare()
    share.observe(0.0, 0.0, 0.0)
    assert share.hit_rate is None
    share.observe(1.0, 2 * SHARE_MIN_TOKENS, SHARE_MIN_TOKENS)
    assert share.hit_rate == 0.5


ids = st.lists(st.integers(0, 3), min_size=1, max_size=40)
index_events = st.lists(st.one_of(
    st.tuples(st.just("send"), ids),
    st.tuples(st.just("settle"), ids, st.integers(0, 48)),
    st.tuples(st.just("share"), st.floats(SHARE_FLOOR, 1.0)),
    st.tuples(st.just("resize"), st.integers(0, 16))), max_size=60)


@given(events=index_events, capacity=st.integers(1, 12))
def test_the_index_never_holds_more_than_its_share_of_the_engine_s_cache(
        events: list[tuple], capacity: int) -> None:
    index = PrefixIndex(capacity, 4)
    for event in events:
        if event[0] == "send":
            index.sent(PromptPrefix(token_ids=event[1]))
        elif event[0] == "settle":
            prefix = PromptPrefix(token_ids=event[1])
            predicted = index.predict(prefix, len(event[1]))
            index.settle(prefix, predicted, min(event[2], len(event[1]) - 1))
        elif event[0] == "share":
            index.bound_share(event[1])
        else:
            index.resize(event[1], 4)
        assert len(index) <= index.retained_blocks <= index.ceiling_blocks \
            <= index.capacity_blocks
        if index.capacity_blocks:
            assert index.ceiling_blocks >= max(1, int(index.share * index.capacity_blocks))


def test_the_index_follows_the_share_down_and_back_up_where_it_bound_it() -> None:
    index = PrefixIndex(100, 4)
    for n in range(50):
        index.sent(PromptPrefix(token_ids=[n] * 8))  # 2 blocks each
    assert len(index) == 100
    index.bound_share(0.25)
    assert (index.retained_blocks, len(index)) == (25, 25)
    index.bound_share(1.0)
    assert index.retained_blocks == 100  # the share was what bound it
    # A missed prediction shrinks it below its share: a larger share leaves that as it is.
    index.bound_share(0.5)
    prefix = PromptPrefix(token_ids=[49] * 8)
    index.settle(prefix, 4, 0)  # predicted a block, found none
    retained = index.retained_blocks
    assert retained < 50
    index.bound_share(1.0)
    assert index.retained_blocks == retained


def sample(at: float, queries: float, hits: float = 0.0, blocks: int = 1000) -> BackendSample:
    return BackendSample(at, 0, 0, 0.1, 0, 0, 0, kv_blocks=blocks, block_size=BLOCK,
                         prefix_cache_queries_total=queries, prefix_cache_hits_total=hits)


def test_the_core_bounds_each_index_by_the_engine_s_lookups() -> None:
    core = core_with("least_tokens")
    (backend, other) = core.fleet.names
    core.on_backend_metrics(backend, sample(0.0, 0.0))
    sent = 0
    now = 0.0
    for n in range(40):
        now += 0.1
        request = arrive(core, "a", now, prompt_tokens=500, max_tokens=8,
                         prefix=PromptPrefix(token_ids=[n] * 500))
        assert isinstance(request, QueuedRequest)
        (dispatch,) = core.dispatch_ready(now)
        if dispatch.backend == backend:
            sent += 500
        core.on_completed(dispatch.request, 500, 8, now, cached_tokens=0)
    # The engine looked up only what the sidecar sent: its whole cache is the sidecar's.
    core.on_backend_metrics(backend, sample(5.0, sent))
    assert core.fleet[backend].prefix.share == 1.0
    # Then it looked up three times as much as the sidecar sent: others hold the rest, as
    # the share says once the scrapes have said so for SHARE_HOLD_S.
    core.on_backend_metrics(backend, sample(6.0, sent + 3 * sent))
    assert core.fleet[backend].prefix.share == 1.0
    core.on_backend_metrics(backend, sample(6.0 + SHARE_HOLD_S + 0.1, sent + 3 * sent))
    share = core.fleet[backend].prefix.share
    assert 0.2 < share < 0.3
    state = core.snapshot(12.0)["backends"][backend]["prefix_index"]
    assert state["share"] == round(share, 4)
    assert state["retained_blocks"] == int(share * 1000)
    assert core.fleet[other].prefix.share == 1.0  # no counters from it: no correction


def test_the_sidecar_counts_each_answer_and_the_engine_s_prompt_count() -> None:
    core = core_with("least_tokens")
    request = arrive(core, "a", 0.0, prompt_tokens=100, max_tokens=8, sequences=3)
    assert isinstance(request, QueuedRequest)
    (dispatch,) = core.dispatch_ready(0.0)
    share = core.fleet[dispatch.backend].prefix.cache_share
    assert share.pending_tokens == 300  # n answers: n engine requests, each looked up
    core.dispatch_failed(dispatch.request, 0.1)  # never reached it
    assert share.pending_tokens == 0
    (dispatch,) = core.dispatch_ready(0.2)
    share = core.fleet[dispatch.backend].prefix.cache_share
    core.on_first_token(dispatch.request, 0.25)
    core.on_completed(dispatch.request, 120, 8, 0.3)  # the engine counted 120 a prompt
    assert share.pending_tokens == 0
    core.on_backend_metrics(dispatch.backend, sample(0.0, 0.0))
    core.on_backend_metrics(dispatch.backend, sample(0.1, 0.0))
    assert share.sent_tokens == 0  # admitted after the scrape: not in the window yet
    core.on_backend_metrics(dispatch.backend, sample(1.0, 360.0))
    assert round(share.sent_tokens) == 360


def test_the_scrape_reads_the_prefix_cache_counters() -> None:
    text = "\n".join([
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="m"} 1.0',
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0',
        "# TYPE vllm:generation_tokens_total counter",
        'vllm:generation_tokens_total{engine="0",model_name="m"} 5.0',
        "# TYPE vllm:prefix_cache_queries_total counter",
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 900.0',
        'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 100.0',
        "# TYPE vllm:prefix_cache_queries_created gauge",
        'vllm:prefix_cache_queries_created{engine="0",model_name="m"} 1.7e9',
        "# TYPE vllm:prefix_cache_hits_total counter",
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 480.0',
        ""])
    parsed = parse_vllm_metrics(text, 1.0)
    assert (parsed.prefix_cache_queries_total, parsed.prefix_cache_hits_total) == (1000, 480)
    bare = parse_vllm_metrics(text.split("# TYPE vllm:prefix")[0], 1.0)
    assert bare.prefix_cache_queries_total is None
    assert cache_shape(0.0).prefix_cache_queries_total is None


def test_replicas_count_each_other_s_prompts_as_the_fleet_s() -> None:
    """Two replicas each send half of what one engine looks up: each, told of the other's
    prompts, still takes the engine's whole cache for the fleet's."""
    a, b = core_with("least_tokens"), core_with("least_tokens")
    replica_a, replica_b = Replica(a), Replica(b)
    backend = a.fleet.names[0]
    for core in (a, b):
        core.on_backend_metrics(backend, sample(0.0, 0.0))
    looked_up, now = 0, 0.0
    for n in range(20):
        now += 0.1
        for core in (a, b):
            request = arrive(core, "a", now, prompt_tokens=1000, max_tokens=8)
            assert isinstance(request, QueuedRequest)
            (dispatch,) = core.dispatch_ready(now)
            if dispatch.backend == backend:
                looked_up += 1000
            core.on_completed(dispatch.request, 1000 + n % 2, 8, now)
            looked_up += n % 2 if dispatch.backend == backend else 0
    told_a, told_b = replica_a.take_sent_tokens(), replica_b.take_sent_tokens()
    assert told_a[backend] == told_b[backend] == looked_up // 2
    assert replica_a.take_sent_tokens() == {}  # taken once
    # Before they are told, each sees the other as a client it cannot see ...
    for at in (5.0, 5.0 + SHARE_HOLD_S + 0.1):
        a.on_backend_metrics(backend, sample(at, looked_up))
    assert a.fleet[backend].prefix.share < 0.6
    # ... and once told, as the fleet's own.
    for name, tokens in told_a.items():
        replica_b.learn_sent_tokens(name, tokens, 4.0)
    for at in (5.0, 5.0 + SHARE_HOLD_S + 0.1):
        b.on_backend_metrics(backend, sample(at, looked_up))
    assert b.fleet[backend].prefix.share == 1.0
    replica_b.learn_sent_tokens("no-such-backend", 10, 4.0)  # nothing to count it against


def test_the_emulator_s_counters_are_read_by_their_names() -> None:
    """The emulator's exposition (vLLM's names, with prometheus_client's ``_created``
    samples beside them) gives the counters, from 0."""
    model = StepModel(EngineConfig(num_kv_blocks=64, block_size=16, max_model_len=512),
                      get_profile("cpu-tiny"))
    text = generate_latest(EngineMetrics(model, "m").registry).decode()
    parsed = parse_vllm_metrics(text, 0.0)
    assert (parsed.prefix_cache_queries_total, parsed.prefix_cache_hits_total) == (0.0, 0.0)


def test_without_scrapes_what_was_admitted_is_kept_in_bounded_memory() -> None:
    share = CacheShare()
    share.observe(0.0, 0.0)
    for n in range(3 * ADMITTED_HELD):
        share.sent(10)
        share.admitted(10, 1.0 + n / 1000)
    assert len(share._admitted) <= ADMITTED_HELD
    share.observe(10.0, 10.0 * 3 * ADMITTED_HELD)
    assert round(share.sent_tokens) == 10 * 3 * ADMITTED_HELD and share.share == 1.0
