"""sidecar.prefix: the prefix index's invariants under any sequence of prompts sent and
corrections, and its predictions against vLLM's rule (full blocks from the start, never the
last token)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from weighbridge.sidecar.prefix import TEXT_BLOCK_BYTES, PrefixIndex, PromptPrefix
from weighbridge.sidecar.prompt import BYTES_PER_TOKEN

BLOCK = 4

# Prompts over a small vocabulary, branching off each other, so prefixes are shared.
prompts = st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=40)
events = st.lists(st.tuples(st.sampled_from(["send", "correct"]), prompts,
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
def test_the_index_keeps_its_invariants(events: list[tuple[str, list[int], int]],
                                        capacity: int, probe: list[int]) -> None:
    index = PrefixIndex(capacity, BLOCK)
    for kind, ids, reported in events:
        prefix = prefix_of(ids)
        if kind == "send":
            index.sent(prefix)
        else:
            index.correct(prefix, reported)
        assert len(index) <= capacity
    predicted = index.predict(prefix_of(probe), len(probe))
    assert 0 <= predicted <= len(probe) - 1
    assert predicted % BLOCK == 0 or predicted == len(probe) - 1
    # A hit is a prefix: no more than the probe shares with some prompt sent or corrected.
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


@given(ids=st.lists(st.integers(0, 3), min_size=BLOCK * 3, max_size=40),
       reported=st.integers(min_value=0, max_value=48))
def test_a_correction_makes_the_prediction_what_the_engine_reported(
        ids: list[int], reported: int) -> None:
    index = PrefixIndex(64, BLOCK)
    index.sent(prefix_of(ids))
    index.correct(prefix_of(ids), reported)
    blocks = len(ids) // BLOCK
    expected = min(-(-reported // BLOCK), blocks) * BLOCK
    assert index.predict(prefix_of(ids), len(ids)) == min(expected, len(ids) - 1)


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
