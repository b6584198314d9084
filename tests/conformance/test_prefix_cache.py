"""vLLM's automatic prefix cache, request by request, on the emulator and on real vLLM: each
answer's ``usage.prompt_tokens_details.cached_tokens`` and the deltas of
``vllm:prefix_cache_queries`` / ``_hits`` are the numbers written here, on both.

An emulator of the module's own and the suite's real vLLM (which the modules before this one
used too), with the suite's engine shape, the prefix cache on and
``--enable-prompt-tokens-details``. The emulator gets 63 blocks where vLLM gets 64: vLLM
keeps one as its null block, and eviction order depends on how many blocks there are. The
requests of a test go one after another (each answered before the next is sent) unless the
test needs them together, and each test's prompts are its own token ids, so a test's numbers
do not depend on the tests or modules before it. Block size 32: the numbers below are in its
units.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conformance.backends import (
    BLOCK_SIZE,
    NUM_KV_BLOCKS,
    Backend,
    emulator_backend,
    stream_chunks,
)
from tests.support import loopback, metrics

QUERIES, HITS = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"


@pytest.fixture(scope="module")
def emulator_cache_backend() -> Iterator[Backend]:
    with emulator_backend(num_kv_blocks=NUM_KV_BLOCKS - 1,  # vLLM's null block
                          enable_prompt_tokens_details=True) as backend:
        yield backend


@pytest.fixture(params=["emulator_cache", pytest.param("vllm", marks=pytest.mark.vllm)])
def backend(request: pytest.FixtureRequest) -> Backend:
    """The emulator of this module, and the suite's real vLLM (its prefix cache on, as
    vLLM's default, with ``--enable-prompt-tokens-details``: tests/conformance/conftest.py)."""
    return request.getfixturevalue(f"{request.param}_backend")


def _ids(name: str, n: int) -> list[int]:
    """``n`` token ids of the test's own (ids from 6 up: 0-5 are special tokens)."""
    rng = random.Random(f"prefix-cache/{name}")
    return [rng.randrange(6, 2048) for _ in range(n)]


def _counters(backend: Backend) -> tuple[float, float]:
    m = metrics.scrape(backend.url)
    return m.total(QUERIES), m.total(HITS)


def _complete(backend: Backend, prompt: list[int], max_tokens: int = 1,
              stream: bool = False) -> int:
    """One completion; its cached_tokens (from the usage chunk when streamed)."""
    body: dict[str, Any] = {"model": backend.model, "prompt": prompt, "max_tokens": max_tokens,
                            "ignore_eos": True, "temperature": 0}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    r = loopback.post(backend.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    usage = stream_chunks(r.content)[-1]["usage"] if stream else r.json()["usage"]
    assert usage["prompt_tokens"] == len(prompt)
    return int(usage["prompt_tokens_details"]["cached_tokens"])


class Counted:
    """The prefix-cache counters' deltas over a block of requests."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def __enter__(self) -> Counted:
        self.before = _counters(self.backend)
        return self

    def __exit__(self, *exc: object) -> None:
        after = _counters(self.backend)
        self.queries, self.hits = (a - b for a, b in zip(after, self.before, strict=True))


def test_a_repeat_hits_every_full_block_before_its_last_token(backend: Backend) -> None:
    """The issue's example: 300 tokens sent again hit 288 (9 blocks; the 10th is partial),
    streamed or not."""
    prompt = _ids("repeat", 300)
    with Counted(backend) as counted:
        first = _complete(backend, prompt)
        again = _complete(backend, prompt)
        streamed = _complete(backend, prompt, stream=True)
    assert (first, again, streamed) == (0, 288, 288)
    assert (counted.queries, counted.hits) == (900, 576)


def test_a_prefix_shared_to_a_point_inside_a_block_hits_the_blocks_before_it(
        backend: Backend) -> None:
    base = _ids("inside", 300)
    other = base[:200] + _ids("inside/other", 100)
    with Counted(backend) as counted:
        assert _complete(backend, base) == 0
        assert _complete(backend, other) == 192  # 200 shared: 6 whole blocks
    assert (counted.queries, counted.hits) == (600, 192)


def test_a_prompt_of_whole_blocks_repeated_recomputes_its_last_block(backend: Backend) -> None:
    """vLLM caps a hit at num_tokens - 1, then at whole blocks: 256 tokens hit 224."""
    prompt = _ids("whole", 256)
    with Counted(backend) as counted:
        assert _complete(backend, prompt) == 0
        assert _complete(backend, prompt) == 224
    assert (counted.queries, counted.hits) == (512, 224)


def test_branches_of_branches_hit_their_common_ancestors(backend: Backend) -> None:
    root = _ids("tree", 200)
    left = root[:150] + _ids("tree/left", 100)  # shares 150 with root
    left_left = left[:230] + _ids("tree/left/left", 50)  # 230 with left
    right = root[:100] + _ids("tree/right", 60)  # 100 with root
    right_left = right[:140] + left_left[140:200]  # 140 with right, then left's tokens
    with Counted(backend) as counted:
        cached = [_complete(backend, p) for p in (root, left, left_left, right, right_left)]
    # right_left's tokens after 140 match left_left's, but the chain broke at 140.
    assert cached == [0, 128, 224, 96, 128]
    assert (counted.queries, counted.hits) == (200 + 250 + 280 + 160 + 200, 576)


def test_eviction_under_kv_pressure_is_oldest_first_and_tail_first(backend: Backend) -> None:
    """63 blocks. Two requests of 31 blocks each first, so that whatever earlier tests
    cached, the free queue is then: 1 stale block, the two requests' blocks. Then P1, P2,
    P3 of 20 blocks each and X of 25, one after another: X takes the 3 blocks before P1's,
    all of P1's (tail first) and P2's last two. Sent again, P3 hits 19 blocks (its last is
    always recomputed, which takes P2's next block), P2 hits 17, P1 none."""
    flush = [_ids(f"evict/flush{i}", 31 * 32) for i in range(2)]
    p1, p2, p3 = (_ids(f"evict/p{i}", 20 * 32) for i in (1, 2, 3))
    x = _ids("evict/x", 25 * 32)
    with Counted(backend) as counted:
        for prompt in (*flush, p1, p2, p3, x):
            _complete(backend, prompt)
        probes = [_complete(backend, p) for p in (p3, p2, p1)]
    assert probes == [19 * 32, 17 * 32, 0]
    assert counted.queries == 2 * 992 + 3 * 640 + 800 + 3 * 640
    assert counted.hits == 36 * 32


async def test_a_preempted_request_finds_its_blocks_again(backend: Backend) -> None:
    """Two requests of 600 + 400 tokens outgrow the 63 blocks: the later one is preempted
    when it needs its 32nd block (31 full blocks, 992 tokens, freed to the cache), waits
    until the other ends, and resumes with all 31 as a hit (never counted: vLLM counts a
    request's first lookup only). Their prompts, sent again, hit 18 blocks each."""
    a, b = _ids("preempt/a", 600), _ids("preempt/b", 600)
    preemptions = "vllm:num_preemptions_total"
    before = metrics.scrape(backend.url).total(preemptions)

    # The two outgrow the 63 blocks only in their last 7 steps (each needs its 32nd block
    # from its 393rd token on), so they must start within 7 engine steps of each other: one
    # client, made before either is sent, puts them on the wire together (a client each
    # built an SSL context between them: tens of milliseconds on a loaded machine).
    async def send(client: httpx.AsyncClient, prompt: list[int]) -> int:
        r = await client.post(backend.url + "/v1/completions", json={
            "model": backend.model, "prompt": prompt, "max_tokens": 400,
            "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    with Counted(backend) as counted:
        async with httpx.AsyncClient(timeout=300) as client:
            assert await asyncio.gather(send(client, a), send(client, b)) == [0, 0]
        assert metrics.scrape(backend.url).total(preemptions) - before == 1
        assert [_complete(backend, p) for p in (a, b)] == [576, 576]
    assert (counted.queries, counted.hits) == (4 * 600, 2 * 576)


def _tokenize(backend: Backend, messages: list[dict[str, str]]) -> list[int]:
    r = loopback.post(backend.url + "/tokenize", json={"model": backend.model,
                                                    "messages": messages}, timeout=30)
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_chat_with_a_shared_system_prompt(backend: Backend) -> None:
    """Two conversations under one system prompt, and the first one's next turn. The
    backends tokenise text differently (the emulator has no vocabulary), so the expected
    hits come from each backend's own token ids (``/tokenize``): whole blocks of the
    longest prefix shared with an earlier prompt, short of the last token."""
    system = {"role": "system", "content": " ".join(
        f"Rule {i}: answer {'briefly' if i % 2 else 'politely'} and cite section {i}."
        for i in range(20))}
    first = [system, {"role": "user", "content": "Where is the station?"}]
    second = [system, {"role": "user", "content": "Tell me about trains."}]
    turn = [*first, {"role": "assistant", "content": "Go north."},
            {"role": "user", "content": "And then?"}]
    sent: list[list[int]] = []
    expected: list[int] = []
    cached: list[int] = []
    with Counted(backend) as counted:
        for i, messages in enumerate((first, second, turn, second)):
            ids = _tokenize(backend, messages)
            shared = max((_common(ids, earlier) for earlier in sent), default=0)
            expected.append(min(shared, len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE)
            body: dict[str, Any] = {"model": backend.model, "messages": messages,
                                    "max_tokens": 4, "ignore_eos": True, "temperature": 0}
            stream = i == 3
            if stream:
                body.update(stream=True, stream_options={"include_usage": True})
            r = loopback.post(backend.url + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            usage = stream_chunks(r.content)[-1]["usage"] if stream else r.json()["usage"]
            assert usage["prompt_tokens"] == len(ids)
            details = usage["prompt_tokens_details"]
            cached.append(details["cached_tokens"])
            # The prompt tokens this request put in the cache: its whole blocks not hit.
            assert details["created_cache_tokens"] == (
                len(ids) // BLOCK_SIZE * BLOCK_SIZE - details["cached_tokens"]), details
            sent.append(ids)
    assert cached == expected, json.dumps({"cached": cached, "expected": expected})
    # The system prompt is long enough to share whole blocks; the turn hits the whole of
    # the first conversation's prompt (its blocks up to the reply).
    assert expected[1] >= 4 * BLOCK_SIZE and expected[2] >= len(sent[0]) // 32 * 32
    assert (counted.queries, counted.hits) == (sum(map(len, sent)), sum(cached))


def test_a_next_turn_that_resends_the_answer_hits_its_decode_blocks(backend: Backend) -> None:
    """Decode blocks are cached as they fill. 100 prompt tokens and 60 generated: the
    first request computed 159 of them (its last sampled token never is), so 4 blocks; a
    next turn of prompt + answer (the ids it returned, ``return_token_ids``) + 10 new hits
    128, where the prompt alone would give 96."""
    prompt = _ids("turns", 100)
    r = loopback.post(backend.url + "/v1/completions", json={
        "model": backend.model, "prompt": prompt, "max_tokens": 60, "ignore_eos": True,
        "temperature": 0, "return_token_ids": True}, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    answer = choice["token_ids"]
    assert len(answer) == 60 and choice["prompt_token_ids"] == prompt
    with Counted(backend) as counted:
        assert _complete(backend, prompt + answer + _ids("turns/next", 10)) == 128
    assert (counted.queries, counted.hits) == (170, 128)
