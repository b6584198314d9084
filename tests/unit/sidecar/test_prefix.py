"""sidecar.prefix: the prefix index's invariants under any sequence of prompts sent and
corrections, and its predictions against vLLM's rule (full blocks from the start, never the
last token)."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from weighbridge.sidecar.prefix import TEXT_BLOCK_BYTES, PrefixIndex, PromptPrefix
from weighbridge.sidecar.prompt import BYTES_PER_TOKEN

BLOCK = 4

# Prompts over a small vocabulary, branching off each other, so prefixes are shared.
prompts = st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=40)
events = st.lists(st.tuples(st.sampled_from(["send", "settle"]), prompts,
                            st.integers(min_value=0, max_value=48)), max_size=60)


def prefix_of(ids: list[int]) -> PromptPrefix:
    return PromptPrefix(token_ids=ids)


def shared_blocks(a: list[int], b: list[int]) -> int:
    """Full blocks of ``a`` that are equal, from the start, to ``b``'s."""
    n = 0
    while (n + 1) * BLOCK <= min(len(a), len(b)) and \
            a[n * BLOCK:(n + 1) * BLOCK] == b[n * BLOCK:(n + 1) * BLOCK]:
        n += 1
    return n


@given(events=events, capacity=st.integers(min_value=1, max_value=12), probe=prompts)
# A missed prediction shrinking the index to nothing still evicts what it held.
@example(events=[("send", [1, 0, 0, 0], 0), ("settle", [1, 0, 0, 0, 0], 0)], capacity=1,
         probe=[0])
def test_the_index_keeps_its_invariants(events: list[tuple[str, list[int], int]],
                                        capacity: int, probe: list[int]) -> None:
    index = PrefixIndex(capacity, BLOCK)
    for kind, ids, reported in events:
        prefix = prefix_of(ids)
        if kind == "send":
            index.sent(prefix)
        else:
            predicted = index.predict(prefix, len(ids))
            index.settle(prefix, predicted, min(reported, len(ids) - 1))
        assert len(index) <= index.retained_blocks <= capacity
    predicted = index.predict(prefix_of(probe), len(probe))
    assert 0 <= predicted <= len(probe) - 1
    assert predicted % BLOCK == 0 or predicted == len(probe) - 1
    # A hit is a prefix: no more than the probe shares with some prompt sent or settled.
    best = max((shared_blocks(probe, ids) for _, ids, _ in events), default=0)
    assert predicted <= best * BLOCK


@given(ids=prompts)
def test_a_prompt_just_sent_is_cached_whole_but_its_last_token(ids: list[int]) -> None:
    index = PrefixIndex(64, BLOCK)
    index.sent(prefix_of(ids))
    assert index.predict(prefix_of(ids), len(ids)) == min(len(ids) // BLOCK * BLOCK,
                                                          len(ids) - 1)


@given(first=prompts, second=prompts)
def test_a_shared_prefix_is_predicted_to_its_last_full_shared_block(
        first: list[int], second: list[int]) -> None:
    index = PrefixIndex(64, BLOCK)
    index.sent(prefix_of(first))
    expected = min(shared_blocks(second, first) * BLOCK, len(second) - 1)
    assert index.predict(prefix_of(second), len(second)) == expected


def test_a_missed_prediction_shrinks_the_index_and_a_met_one_grows_it() -> None:
    index = PrefixIndex(10, BLOCK)
    first, second = list(range(BLOCK * 4)), [9] * (BLOCK * 4)
    index.sent(prefix_of(first))
    index.sent(prefix_of(second))
    assert len(index) == 8
    # The engine had kept only 1 of the 3 blocks predicted: it retains 2 fewer than held.
    index.settle(prefix_of(second), 3 * BLOCK, BLOCK)
    assert index.retained_blocks == 6 and len(index) == 6
    # The settled prompt is cached now, whole; the older one lost its tail first.
    assert index.predict(prefix_of(second), len(second)) == len(second) - 1
    assert index.predict(prefix_of(first), len(first)) == 2 * BLOCK
    # The engine held 2 blocks more than predicted: the index may keep them again.
    index.settle(prefix_of(first), 2 * BLOCK, 4 * BLOCK - 1)
    assert index.retained_blocks == 7


def test_the_tail_of_a_prompt_is_forgotten_before_its_head() -> None:
    index = PrefixIndex(3, BLOCK)
    long = list(range(BLOCK * 3))
    index.sent(prefix_of(long))
    other = [9] * BLOCK
    index.sent(prefix_of(other))  # one block over capacity: the long prompt's last goes
    assert index.predict(prefix_of(long), len(long)) == 2 * BLOCK


def test_text_is_cut_in_fixed_blocks_of_bytes_priced_as_the_estimate() -> None:
    index = PrefixIndex(64, BLOCK)
    system = b"s" * (TEXT_BLOCK_BYTES * 2)
    index.sent(PromptPrefix(text=system + b"first question"))
    follow = PromptPrefix(text=system + b"another question, longer" * 8)
    assert index.predict(follow, 500) == 2 * TEXT_BLOCK_BYTES // BYTES_PER_TOKEN


def test_a_new_block_size_starts_the_index_over() -> None:
    index = PrefixIndex(64, BLOCK)
    ids = list(range(32))
    index.sent(prefix_of(ids))
    index.resize(64, BLOCK * 2)
    assert len(index) == 0 and index.predict(prefix_of(ids), len(ids)) == 0
    index.sent(prefix_of(ids))
    assert index.predict(prefix_of(ids), len(ids)) == 31


def test_a_block_s_name_is_the_same_in_every_process() -> None:
    """Replicas tell each other blocks by name (sidecar.shared): a text block is hashed as
    ints, which PYTHONHASHSEED leaves alone, so these values (computed under two seeds)
    are every process's."""
    assert PromptPrefix(text=bytes(range(128))).blocks(BLOCK) == (7702398102232413564,
                                                                  -9089123448667533195)
    chat = PromptPrefix(messages=[{"role": "user", "content": "hello world " * 10}])
    assert chat.blocks(BLOCK)[:1] == (-913118887417129894,)
