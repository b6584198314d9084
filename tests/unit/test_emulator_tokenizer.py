"""The emulator's --tokenizer: a model directory's tokenizer and chat template count, number
and cache prompts; the default rule is unchanged (emulator/tokenizer.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given
from hypothesis import strategies as st

from tests.support.tokenizer_model import VOCAB, write_model_dir
from weighbridge.emulator import text
from weighbridge.emulator.engine import EngineConfig
from weighbridge.emulator.profiles import get_profile
from weighbridge.emulator.server import Emulator, EmulatorSettings
from weighbridge.emulator.tokenizer import RULE, ModelTokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> ModelTokenizer:
    return ModelTokenizer(model_dir)


def test_a_completions_prompt_gets_bos_first_unless_special_tokens_are_off(
        tokenizer: ModelTokenizer) -> None:
    ids = tokenizer.prompt_ids("the station is north of the river")
    assert ids[0] == 1 and len(ids) > 2  # <s> is id 1 (tiny_model's special tokens)
    assert tokenizer.prompt_ids("the station is north of the river", False) == ids[1:]


def test_chat_renders_the_template_and_adds_no_second_bos(tokenizer: ModelTokenizer) -> None:
    messages = [("system", "be brief"), ("user", "where is the station?")]
    ids = tokenizer.chat_ids(messages)
    rendered = "<s><|system|>\nbe brief\n<|user|>\nwhere is the station?\n<|assistant|>\n"
    assert ids == tokenizer.prompt_ids(rendered, add_special_tokens=False)
    assert ids.count(1) == 1
    without = tokenizer.chat_ids(messages, add_generation_prompt=False)
    assert ids[:len(without)] == without and len(ids) > len(without)


def test_a_next_turn_extends_the_previous_prompt(tokenizer: ModelTokenizer) -> None:
    """What the prefix cache needs: a turn's prompt starts with the one before it, up to the
    reply's opening."""
    first = [("system", "rules of the house"), ("user", "hello")]
    turn = [*first, ("assistant", "hi there"), ("user", "and then?")]
    earlier = tokenizer.chat_ids(first, add_generation_prompt=False)
    assert tokenizer.chat_ids(turn)[:len(earlier)] == earlier


@given(seed=st.integers(0, 10**6), n=st.integers(0, 64))
def test_generated_pieces_concatenate_to_the_answer(tokenizer: ModelTokenizer, seed: int,
                                                    n: int) -> None:
    whole = tokenizer.output_text(seed, 0, n)
    assert whole == "".join(tokenizer.output_text(seed, i, 1) for i in range(n))
    assert tokenizer.output_ids(seed, 0, n) == [tokenizer.output_id(seed, i) for i in range(n)]
    assert all(i > 5 for i in tokenizer.output_ids(seed, 0, n))  # never a special token


def test_the_rule_is_the_default_and_unchanged() -> None:
    assert RULE.prompt_ids("hello world") == text.prompt_ids("hello world")
    assert RULE.prompt_ids("hello world", False) == text.prompt_ids("hello world")[1:]
    assert RULE.chat_ids([("user", "hi")]) == text.chat_ids([("user", "hi")])
    assert RULE.chat_ids([("user", "hi")], False) == text.chat_ids([("user", "hi")])[:-1]
    assert RULE.output_text(3, 0, 5) == text.generated_text(3, 0, 5)
    assert EmulatorSettings().tokenizer is RULE


def test_a_directory_without_a_tokenizer_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no tokenizer\.json"):
        ModelTokenizer(tmp_path)


def test_a_tokenizer_without_a_chat_template_is_refused(model_dir: Path,
                                                         tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match="no chat template"):
        ModelTokenizer(tmp_path)


@pytest.fixture
async def client(tokenizer: ModelTokenizer) -> AsyncIterator[TestClient[Any, Any]]:
    settings = EmulatorSettings(model_name="m", vocab_size=VOCAB, tokenizer=tokenizer,
                                enable_prompt_tokens_details=True,
                                engine=EngineConfig(block_size=16))
    async with TestClient(TestServer(Emulator(settings, get_profile("cpu-tiny")).app)) as c:
        yield c


async def test_the_server_counts_and_caches_by_the_model_tokenizer(
        client: TestClient[Any, Any], tokenizer: ModelTokenizer) -> None:
    system = " ".join(f"rule {i}: answer briefly and cite the section." for i in range(12))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "hello"}]
    ids = tokenizer.chat_ids([(m["role"], m["content"]) for m in messages])
    r = await client.post("/tokenize", json={"model": "m", "messages": messages})
    assert (await r.json())["tokens"] == list(ids)
    usages = []
    for _ in range(2):
        r = await client.post("/v1/chat/completions", json={
            "model": "m", "messages": messages, "max_tokens": 3, "ignore_eos": True})
        usages.append((await r.json())["usage"])
    assert [u["prompt_tokens"] for u in usages] == [len(ids)] * 2
    # The repeat hits every whole block short of the last token, as vLLM's cache does.
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] == (len(ids) - 1) // 16 * 16
    r = await client.post("/v1/completions", json={"model": "m", "prompt": system,
                                                   "max_tokens": 2, "ignore_eos": True})
    body = await r.json()
    assert body["usage"]["prompt_tokens"] == len(tokenizer.prompt_ids(system))
