"""sidecar.tokenizer: which prompts the served model's tokenizer counts, the order the
tokenizer thread takes them (each tenant's in arrival order, the tenants in turn, within the
bounds), and a live sidecar in front of an emulator tokenizing alike: every text prompt
counted as the engine counts it, and every prefix-cache prediction equal to what the engine
reported (issue 38)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given
from hypothesis import strategies as st

from tests.support.stack import auth, tenant
from tests.support.tokenizer_model import VOCAB, write_model_dir
from weighbridge.emulator.options import EmulatorOptions
from weighbridge.emulator.server import Emulator, EmulatorSettings
from weighbridge.emulator.tokenizer import ModelTokenizer
from weighbridge.hf_tokenizer import HfTokenizer
from weighbridge.sidecar.app import Sidecar
from weighbridge.sidecar.config import ConfigError, parse_config
from weighbridge.sidecar.tokenizer import (
    CHAT_MESSAGE_BYTES,
    PromptTokenizers,
    TokenizeQueue,
    text_prompt,
)

COMPLETIONS, CHAT, EMBEDDINGS = "/v1/completions", "/v1/chat/completions", "/v1/embeddings"
KEY = "sk-tokenized"
MODEL = "m"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("tokenizer"))


# -- what is tokenized ------------------------------------------------------------------------

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("endpoint", "body", "counted"), [
    (COMPLETIONS, {"prompt": "héllo"}, True),
    (COMPLETIONS, {"prompt": "hello", "add_special_tokens": False}, True),
    (COMPLETIONS, {"prompt": [1, 2, 3]}, False),  # token ids: exact already
    (COMPLETIONS, {"prompt": ["a", "b"]}, False),  # a batch: one engine request each
    (COMPLETIONS, {"prompt": "hello", "truncate_prompt_tokens": 4}, False),
    (COMPLETIONS, {"prompt": "hello", "add_special_tokens": "yes"}, False),
    (CHAT, {"messages": USER}, True),
    (CHAT, {"messages": USER, "add_generation_prompt": False}, True),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
     False),  # content parts: vLLM joins or passes them by the template's format
    (CHAT, {"messages": [{"role": "user", "content": "hi", "name": "x"}]}, False),
    (CHAT, {"messages": [{"role": "assistant", "content": None}]}, False),
    (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, False),
    (CHAT, {"messages": USER, "chat_template": "{{ messages }}"}, False),
    (CHAT, {"messages": USER, "chat_template_kwargs": {"x": 1}}, False),
    (EMBEDDINGS, {"input": "hello"}, False),
])
def test_only_what_the_tokenizer_counts_as_the_engine_does_is_tokenized(
        endpoint: str, body: dict[str, Any], counted: bool) -> None:
    prompt = text_prompt(endpoint, body)
    assert (prompt is not None) == counted
    if endpoint == COMPLETIONS and prompt is not None:
        assert prompt.size == len(body["prompt"].encode())
        assert prompt.add_special_tokens == body.get("add_special_tokens", True)


# -- the order of the thread ------------------------------------------------------------------

offers = st.lists(st.tuples(st.sampled_from("abc"), st.integers(min_value=1, max_value=40)),
                  max_size=40)


@given(offers=offers, max_prompt=st.integers(min_value=1, max_value=40),
       max_tenant=st.integers(min_value=1, max_value=100), take_every=st.integers(1, 4))
def test_each_tenant_in_order_the_tenants_in_turn_within_the_bounds(
        offers: list[tuple[str, int]], max_prompt: int, max_tenant: int,
        take_every: int) -> None:
    queue: TokenizeQueue[int] = TokenizeQueue(max_prompt, max_tenant)
    accepted: dict[str, list[int]] = {}
    taken: list[tuple[str, int]] = []
    for i, (tenant_, size) in enumerate(offers):
        before = queue.pending(tenant_)
        if queue.offer(tenant_, size, i):
            accepted.setdefault(tenant_, []).append(i)
        else:
            assert size > max_prompt or before + size > max_tenant
        assert queue.pending(tenant_) <= max_tenant
        if i % take_every == 0 and (job := queue.next()) is not None:
            taken.append((job[0], job[2]))
            queue.done(job[0], job[1])
    while (job := queue.next()) is not None:
        taken.append((job[0], job[2]))
        queue.done(job[0], job[1])
    # Every job accepted is taken once, each tenant's in the order offered.
    for tenant_, jobs in accepted.items():
        assert [j for t, j in taken if t == tenant_] == jobs
    assert not len(queue) and all(queue.pending(t) == 0 for t in "abc")


@given(backlog=st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 40)), max_size=30),
       taken_first=st.integers(min_value=0, max_value=5), size=st.integers(1, 40))
def test_an_idle_tenant_waits_for_one_prompt_per_other_tenant_at_most(
        backlog: list[tuple[str, int]], taken_first: int, size: int) -> None:
    queue: TokenizeQueue[str] = TokenizeQueue(40, 10_000)
    for tenant_, n in backlog:
        queue.offer(tenant_, n, tenant_)
    for _ in range(taken_first):  # some are on the thread or done
        if (job := queue.next()) is not None:
            queue.done(job[0], job[1])
    assert queue.offer("victim", size, "victim")
    before: list[str] = []
    while (job := queue.next()) is not None and job[2] != "victim":
        before.append(job[2])
    assert job is not None and job[2] == "victim"
    assert all(before.count(t) <= 1 for t in "abc")


def test_a_tenant_s_backlog_delays_another_by_the_prompt_on_the_thread() -> None:
    queue: TokenizeQueue[str] = TokenizeQueue(100, 1000)
    assert queue.offer("flood", 100, "flood-0")
    assert queue.next() == ("flood", 100, "flood-0")  # on the thread
    for i in range(1, 5):
        assert queue.offer("flood", 100, f"flood-{i}")
    assert queue.offer("victim", 10, "victim-0")
    assert queue.next() == ("victim", 10, "victim-0")


# -- a live sidecar -----------------------------------------------------------------------

def test_a_tokenizer_is_a_directory_with_tokenizer_json(tmp_path: Path) -> None:
    config = {"tenants": {"t": tenant("standard", KEY)},
              "backends": [{"url": "http://127.0.0.1:9"}],
              "models": {MODEL: {"tokenizer": str(tmp_path)}}}
    with pytest.raises(ConfigError, match=r"models\.m\.tokenizer: no tokenizer\.json"):
        parse_config(config)


async def _scraped(sidecar: Sidecar) -> None:
    """Until the sidecar has read the engine's cache shape (what its index may hold)."""
    for _ in range(500):
        backends = sidecar.core.snapshot(0.0)["backends"]
        if all(b["prefix_index"]["capacity_blocks"] for b in backends.values()):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the engine's cache shape was never scraped")


async def test_text_is_counted_and_cached_as_the_engine_does(model_dir: Path) -> None:
    engine = EmulatorOptions(profile="cpu-tiny", max_model_len=2048, block_size=16)
    settings = EmulatorSettings(engine=engine.engine(), model_name=MODEL, vocab_size=VOCAB,
                                tokenizer=ModelTokenizer(model_dir),
                                enable_prompt_tokens_details=True)
    hf = HfTokenizer(model_dir, what="test", extra="tokenizer")
    async with TestServer(Emulator(settings, engine.step_profile()).app) as backend:
        config = parse_config({
            "tenants": {"t": tenant("standard", KEY)},
            "backends": [{"name": "engine-0", "url": f"http://{backend.host}:{backend.port}"}],
            "models": {MODEL: {"tokenizer": str(model_dir)}},
            "tokenization": {"max_prompt_bytes": 1024},
            "admission": {"metrics_poll_ms": 20},
        })
        sidecar = Sidecar(config)
        async with TestClient(TestServer(sidecar.app)) as client:
            await _scraped(sidecar)
            # The tokenizer loads on its thread, and a prompt meanwhile is estimated
            # ("loading"): on a loaded machine the first request came before it (5 of 6).
            await _until_loaded(sidecar.tokenizers, {"prompt": "warm up"})
            tokenized = sidecar.tokenizers.counts["tokenized"]
            system = " ".join(f"rule {i}: answer briefly and cite the section."
                              for i in range(12))
            bodies: list[tuple[str, dict[str, Any]]] = [
                (COMPLETIONS, {"prompt": system + f" question {i}"}) for i in range(3)]
            bodies += [(CHAT, {"messages": [{"role": "system", "content": system},
                                            {"role": "user", "content": f"hello {i}"}]})
                       for i in range(3)]
            usages = []
            for path, body in bodies:
                response = await client.post(path, headers=auth(KEY), data=orjson.dumps(
                    {"model": MODEL, "max_tokens": 2, "ignore_eos": True, **body}))
                assert response.status == 200
                usages.append((await response.json())["usage"])
            # Counted as the engine counts: the charge the DRR settles is the engine's.
            first = hf.encode(system + " question 0")
            assert usages[0]["prompt_tokens"] == len(first)
            assert sidecar.tokenizers.counts["tokenized"] == tokenized + 6
            # Every prediction met exactly: the index cuts the engine's own blocks.
            predicted = sum(sidecar.core.cached_predicted.values())
            assert predicted > 0
            assert predicted == sum(sidecar.core.cached_reported.values())
            # A prompt over the bound is estimated, not tokenized.
            response = await client.post(COMPLETIONS, headers=auth(KEY), data=orjson.dumps(
                {"model": MODEL, "prompt": "x y " * 300, "max_tokens": 1}))
            assert response.status == 200
            assert sidecar.tokenizers.counts["over_bounds"] == 1
            metrics = await (await client.get("/metrics")).text()
            assert ('weighbridge_prompt_tokenization_total{result="tokenized"} '
                    f'{tokenized + 6:.1f}') in metrics


def _config(tokenizer: Path | None) -> Any:
    models = {MODEL: {"tokenizer": str(tokenizer)}} if tokenizer else {}
    return parse_config({"tenants": {"t": tenant("standard", KEY)},
                         "backends": [{"url": "http://127.0.0.1:9"}], "models": models})


async def _until_loaded(tokenizers: PromptTokenizers, body: dict[str, Any]) -> list[int]:
    for _ in range(500):
        ids = await tokenizers.tokenize(MODEL, "t", COMPLETIONS, body)
        if ids is not None:
            return ids
        await asyncio.sleep(0.01)
    raise AssertionError(f"never tokenized: {dict(tokenizers.counts)}")


async def test_a_tokenizer_named_by_a_reload_is_loaded_on_first_use(model_dir: Path) -> None:
    config = _config(None)
    tokenizers = PromptTokenizers(lambda: config)
    tokenizers.start()
    try:
        body = {"prompt": "where is the station?"}
        assert await tokenizers.tokenize(MODEL, "t", COMPLETIONS, body) is None
        assert not tokenizers.counts  # no tokenizer: nothing to count
        config = _config(model_dir)  # the reload
        assert await tokenizers.tokenize(MODEL, "t", COMPLETIONS, body) is None
        assert tokenizers.counts["loading"] == 1  # estimated while it loads
        ids = await _until_loaded(tokenizers, body)
        assert ids == HfTokenizer(model_dir, what="test", extra="tokenizer").encode(body["prompt"])
        assert tokenizers.bytes == len(body["prompt"]) and tokenizers.cpu_s > 0
    finally:
        tokenizers.stop()


async def test_a_tokenizer_that_fails_to_load_leaves_its_prompts_estimated(
        tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    config = _config(tmp_path)
    tokenizers = PromptTokenizers(lambda: config)
    tokenizers.start()
    try:
        for _ in range(500):
            if await tokenizers.tokenize(MODEL, "t", COMPLETIONS, {"prompt": "hi"}) is None \
                    and tokenizers.counts["unavailable"]:
                break
            await asyncio.sleep(0.01)
        assert tokenizers.counts["unavailable"] >= 1 and not tokenizers.counts["tokenized"]
    finally:
        tokenizers.stop()


def test_a_chat_s_size_counts_each_message_s_framing() -> None:
    """Rendering a message costs CPU however short it is: 10,000 empty messages are not a
    free prompt."""
    prompt = text_prompt(CHAT, {"messages": [{"role": "user", "content": ""}] * 10_000})
    assert prompt is not None and prompt.size == 10_000 * (CHAT_MESSAGE_BYTES + len("user"))
