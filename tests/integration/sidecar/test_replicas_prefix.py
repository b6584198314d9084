"""Three sidecar replicas sharing their state through a real redis-server, in front of three
emulated engines with the prefix cache (issue 30's acceptance): the replicas route a
conversation's turns to the backend that served its first turn, whichever replica takes
each turn, while the load stays within the bounded-load rule."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tests.support.metrics import scrape
from tests.support.redis import RedisServer
from tests.support.replicas import at_home, play_rounds
from tests.support.stack import ADMIN_KEY, auth, start_emulator, start_sidecar, tenant
from tests.support.wait import wait_for
from weighbridge.headers import BACKEND
from weighbridge.launch import ServerProcess
from weighbridge.sidecar.routing.bounded_load import LOAD_BOUND

pytestmark = pytest.mark.timeout(240)

KEY = "sk-chat"
REPLICAS, ENGINES = 3, 3
CONVERSATIONS, TURNS = 12, 6
FIRST_PROMPT, TURN_GROWTH = 256, 32  # token ids: the first turn's, and each turn's new ones
AFFINITY = 0.95


@dataclass
class Fleet:
    replicas: list[ServerProcess]
    engines: list[ServerProcess]

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]


@pytest.fixture(scope="module")
def fleet(processes: contextlib.ExitStack) -> Iterator[Fleet]:
    redis_server = processes.enter_context(RedisServer())
    # The prefix cache on (the emulator's default) and reported in usage, as the sidecar
    # needs vLLM run (--enable-prompt-tokens-details); KV for every conversation.
    engines = [start_emulator(processes, max_num_seqs=16, num_kv_blocks=2048,
                              enable_prompt_tokens_details=True) for _ in range(ENGINES)]
    config = {
        "tenants": {"chat": tenant("standard", KEY)},
        "admin_api_keys": [f"plain:{ADMIN_KEY}"],
        "endpoints": {"/v1/completions": {"initial_output_estimate": 8}},
        "backends": [{"url": e.url, "name": f"engine-{i}"} for i, e in enumerate(engines)],
        "routing": "prefix_aware",
        "state": {"backend": "redis", "url": redis_server.url, "timeout_ms": 200,
                  "sync_ms": 50, "heartbeat_ms": 200},
    }
    replicas = [start_sidecar(processes, config) for _ in range(REPLICAS)]
    fleet = Fleet(replicas, engines)
    wait_for(lambda: all(scrape(u).value("weighbridge_shared_state_replicas") == REPLICAS
                         for u in fleet.urls) or None, 10, what="3 replicas registered")
    yield fleet


async def send(client: httpx.AsyncClient, url: str, prompt: list[int]) -> str:
    """One completion of ``prompt`` (token ids, so the sidecar's blocks are the engine's);
    the backend that served it."""
    response = await client.post(url + "/v1/completions", headers=auth(KEY), json={
        "prompt": prompt, "max_tokens": 8, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.headers[BACKEND]


def warm_up(fleet: Fleet) -> None:
    """Until each replica has had an answer from every backend: a replica predicts a
    backend's cache only once that backend's answers have shown they report cached tokens.
    Three requests at once on an idle replica go to three backends (each in flight adds
    its tokens to its backend's load); one-token prompts hold no block to route by."""
    async def answered_by(url: str, seed: int) -> set[str]:
        async with httpx.AsyncClient(timeout=30) as client:
            return set(await asyncio.gather(*(send(client, url, [seed + i])
                                              for i in range(ENGINES))))

    for r, url in enumerate(fleet.urls):
        seen: set[str] = set()
        for attempt in range(20):  # a bound, not a retry: each round adds what it saw
            seen |= asyncio.run(answered_by(url, 100 * r + ENGINES * attempt))
            if len(seen) == ENGINES:
                break
        assert len(seen) == ENGINES, (r, seen)


def test_replicas_send_a_conversation_s_turns_to_its_first_backend(fleet: Fleet) -> None:
    warm_up(fleet)
    rng = random.Random(30)
    prompts = [[rng.randrange(100, 30_000) for _ in range(FIRST_PROMPT)]
               for _ in range(CONVERSATIONS)]
    replica = [rng.randrange(REPLICAS) for _ in range(CONVERSATIONS)]

    async def round_(turn: int) -> dict[int, str]:
        # Each turn goes to another replica than the previous one did, drawn at random, and
        # the turns of a round arrive in a random order: no replica sees the same
        # conversations in the same order twice, so where load alone sends a turn is not
        # where its conversation began.
        order = rng.sample(range(CONVERSATIONS), CONVERSATIONS)
        for c in order:
            if turn:
                replica[c] = (replica[c] + rng.randrange(1, REPLICAS)) % REPLICAS
        async with httpx.AsyncClient(timeout=30) as client:
            backends = await asyncio.gather(*(send(client, fleet.urls[replica[c]], prompts[c])
                                              for c in order))
        return dict(zip(order, backends, strict=True))

    def grow(c: int) -> None:
        prompts[c] = prompts[c] + [rng.randrange(100, 30_000) for _ in range(TURN_GROWTH)]

    served = play_rounds(fleet.urls, TURNS, round_, grow, "prefixes_sent", "prefixes_learned")
    home, later = at_home(served, CONVERSATIONS, TURNS)
    print(f"\nturns at their conversation's first backend: {home} of {later}")
    assert home >= AFFINITY * later, (home, later, served)
    # The bounded-load rule, per round: a replica chooses no backend whose load passes
    # LOAD_BOUND x the mean over the backends plus the request's own prompt. In request
    # counts (every turn of a round is of one size) and summed over the replicas, each
    # judging its own requests: at most LOAD_BOUND x the mean turns a backend, plus one turn
    # per replica.
    bound = LOAD_BOUND * CONVERSATIONS / ENGINES + REPLICAS
    for turn in range(TURNS):
        per_backend = Counter(served[(c, turn)] for c in range(CONVERSATIONS))
        assert max(per_backend.values()) <= math.floor(bound), (turn, per_backend)
    # Every engine holds conversations: affinity did not gather them on one.
    assert len({served[(c, 0)] for c in range(CONVERSATIONS)}) == ENGINES
    # The engines served the fleet alone, and each replica, told of the others' prompts,
    # takes their caches for the fleet's whole (sidecar.prefix.CacheShare; alone, a third).
    for url in fleet.urls:
        shares = scrape(url).by("weighbridge_backend_prefix_cache_share", "backend")
        assert len(shares) == ENGINES and min(shares.values()) >= 0.95, (url, shares)
