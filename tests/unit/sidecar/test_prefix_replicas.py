"""Replicas agree on where a conversation's history is: each replica (sidecar.replica) hands
over the blocks of the prompts its core sent (``take_sent_prefixes``) and learns the others'
(``learn_sent_prefix``), so another replica sends the next turn to the backend the first
replica chose."""

from __future__ import annotations

from tests.unit.sidecar.test_core import arrive
from tests.unit.sidecar.test_prefix_routing import BLOCK, core_with, turn
from weighbridge.sidecar.core import SchedulingCore
from weighbridge.sidecar.prefix import PromptPrefix
from weighbridge.sidecar.replica import Replica
from weighbridge.sidecar.request import QueuedRequest


def reporting(core: SchedulingCore) -> None:
    """One answer from each backend saying what it found cached (predictions start then)."""
    first, second = turn(core, [1], 0.0), turn(core, [2], 0.0)
    assert {first.backend, second.backend} == set(core.fleet.names)
    for d in (first, second):
        core.on_completed(d.request, 1, 8, 0.0, cached_tokens=0)


def test_a_replica_sends_the_next_turn_where_another_sent_the_first() -> None:
    a, b = core_with("prefix_aware"), core_with("prefix_aware")
    replica_a, replica_b = Replica(a), Replica(b)
    reporting(a)
    reporting(b)
    replica_a.take_sent_prefixes()
    # Replica a's first backend is busy, so the conversation's first turn goes to the other.
    busy = arrive(a, "b", 0.1, prompt_tokens=4000, max_tokens=8)
    assert isinstance(busy, QueuedRequest)
    (held,) = a.dispatch_ready(0.1)
    history = list(range(200))
    first = turn(a, history, 0.2)
    assert first.backend != held.backend
    sent = replica_a.take_sent_prefixes()
    assert sent == [(first.backend, BLOCK, PromptPrefix(token_ids=history).blocks(BLOCK))]
    assert replica_a.take_sent_prefixes() == []  # taken once
    # Before b learns of it, b predicts nothing cached anywhere and sends the turn by load.
    assert b.fleet[first.backend].predicted_cached(turn_request(b, history)) == 0
    for backend, block_size, blocks in sent:
        replica_b.learn_sent_prefix(backend, block_size, blocks)
    second = turn(b, history + list(range(300, 340)), 0.3)
    assert second.backend == first.backend
    assert second.request.predicted_cached_tokens == 192


def test_what_cannot_be_matched_is_not_learned() -> None:
    core = core_with("prefix_aware")
    replica = Replica(core)
    reporting(core)
    blocks = PromptPrefix(token_ids=list(range(64))).blocks(BLOCK)
    replica.learn_sent_prefix("no-such-backend", BLOCK, blocks)
    backend = core.fleet.names[0]
    # Another block size names other blocks.
    replica.learn_sent_prefix(backend, BLOCK * 2, blocks)
    assert all(len(b.prefix) == 0 for b in core.fleet)
    replica.learn_sent_prefix(backend, BLOCK, blocks)
    assert len(core.fleet[backend].prefix) == len(blocks)


def test_a_core_routing_alone_records_nothing() -> None:
    core = core_with("prefix_aware")
    turn(core, list(range(64)), 0.0)
    # A replica made afterwards finds nothing recorded from before.
    assert Replica(core).take_sent_prefixes() == []


def turn_request(core: SchedulingCore, history: list[int]) -> QueuedRequest:
    """A request for ``history`` as the core would queue it (not dispatched)."""
    return QueuedRequest(id="probe", tenant="a", tier="standard", endpoint="/v1/completions",
                         prompt_tokens=len(history), max_tokens=8, sequences=1,
                         estimated_output_tokens=8, arrival_s=0.0,
                         prefix=PromptPrefix(token_ids=history))
