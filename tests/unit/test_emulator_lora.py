"""LoRA adapters on the emulator, as vLLM serves them: the options and their start-up checks,
the adapter cards of /v1/models, requests naming an adapter, and the step model's max_loras
rule (unit cases and properties over arbitrary loads)."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from pydantic import ValidationError
from typer.testing import CliRunner

from tests.support.metrics import parse as parse_metrics
from weighbridge.app.cli import app
from weighbridge.app.stack import parse_stack
from weighbridge.emulator.engine import EngineConfig, Sequence, StepModel, simulate
from weighbridge.emulator.metrics import EngineMetrics
from weighbridge.emulator.options import EmulatorOptions, LoraModule, parse_lora_module
from weighbridge.emulator.profiles import StepTimeProfile, get_profile
from weighbridge.emulator.server import Emulator, EmulatorSettings
from weighbridge.launch import emulator_process

FLAT = StepTimeProfile("flat", t_fixed=0.01, t_prefill_token=0.0, t_decode_seq=0.0,
                       t_kv_token=0.0)
MODEL = "base"


def seq(rid: str, prompt: int, out: int, lora: str | None = None, arrival: float = 0.0,
        priority: int = 0) -> Sequence:
    return Sequence(request_id=rid, prompt_tokens=prompt, target_output_tokens=out,
                    max_tokens=out, arrival_s=arrival, priority=priority, lora=lora)


# -- options ----------------------------------------------------------------------------------

def test_both_of_vllms_module_forms_are_read() -> None:
    assert parse_lora_module("sql=/adapters/sql") == LoraModule("sql", "/adapters/sql")
    assert parse_lora_module("a=b=c") == LoraModule("a", "b=c")  # split at the first =
    assert parse_lora_module(json.dumps({"name": "x", "path": "/p", "base_model_name": "m"})
                             ) == LoraModule("x", "/p")
    options = EmulatorOptions(enable_lora=True, lora_modules=["a=/p", '{"name":"b","path":"/q"}'],
                              max_loras=2)
    assert options.lora_adapters() == (LoraModule("a", "/p"), LoraModule("b", "/q"))
    assert options.engine().max_loras == 2
    assert EmulatorOptions().engine().max_loras == 1  # vLLM's default


@pytest.mark.parametrize(("fields", "message"), [
    ({"lora_modules": ["a=/p"]}, "LoRA is not enabled. Use --enable-lora"),
    ({"enable_lora": True, "lora_modules": ["a=/p", "a=/q"]}, "'a' has already been loaded"),
    ({"enable_lora": True, "lora_modules": [f"{MODEL}=/p"]}, "conflicts with a served base"),
    ({"enable_lora": True, "lora_modules": ["{not json"]}, "Invalid JSON format"),
    ({"enable_lora": True, "lora_modules": ['{"name": "a"}']}, "Invalid fields"),
    ({"enable_lora": True, "lora_modules": ["=/p"]}, "Both 'lora_name' and 'lora_path'"),
    ({"enable_lora": True, "max_loras": 0}, "greater than or equal to 1"),
    ({"enable_lora": True, "max_lora_rank": 12}, "must be one of 1, 8, 16"),
])
def test_vllms_start_up_refusals(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        EmulatorOptions(model_name=MODEL, **fields)


def test_the_command_takes_the_flag_once_per_adapter_and_names_a_bad_one() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["emulator", "--help"], env={"COLUMNS": "400"})
    assert "repeat the flag for each adapter" in result.output
    result = runner.invoke(app, ["emulator", "--lora-modules", "a=/p"], env={"COLUMNS": "300"})
    assert result.exit_code == 2
    assert "--lora-modules: LoRA is not enabled. Use --enable-lora to enable LoRA." \
        in result.output


def test_a_stack_and_a_launched_engine_carry_the_adapters() -> None:
    spec = parse_stack({
        "engines": {"emulator": {"enable_lora": True, "lora_modules": ["a=/p", "b=/q"],
                                 "max_loras": 2}},
        "sidecar": {"tenants": {"t": {"tier": "standard", "api_keys": ["plain:k"]}}}})
    flags = spec.engines.emulator.flags()
    assert flags["lora_modules"] == ["a=/p", "b=/q"]
    argv = list(emulator_process(**flags).argv)
    assert argv.count("--lora-modules") == 2 and "--enable-lora" in argv
    i = argv.index("--lora-modules")
    assert argv[i + 1] == "a=/p" and argv[i + 3] == "b=/q"
    assert argv[argv.index("--max-loras") + 1] == "2"


# -- the HTTP face ----------------------------------------------------------------------------

def lora_settings(**engine: Any) -> EmulatorSettings:
    return EmulatorSettings(model_name=MODEL, engine=EngineConfig(**engine), enable_lora=True,
                            lora_modules=(LoraModule("sql", "/adapters/sql"),
                                          LoraModule("chat", "/adapters/chat")))


@pytest.fixture
async def served() -> AsyncIterator[tuple[TestClient[Any, Any], Emulator, list[Sequence]]]:
    emulator = Emulator(lora_settings(), get_profile("cpu-tiny"))
    submitted: list[Sequence] = []
    submit = emulator.runner.submit

    def recording(s: Sequence, **kwargs: Any) -> Any:
        submitted.append(s)
        return submit(s, **kwargs)

    emulator.runner.submit = recording  # type: ignore[method-assign]
    async with TestClient(TestServer(emulator.app)) as c:
        yield c, emulator, submitted


def test_settings_refuse_adapters_without_lora() -> None:
    with pytest.raises(ValueError, match="--enable-lora"):
        EmulatorSettings(lora_modules=(LoraModule("a", "/p"),))


async def test_models_lists_the_base_card_then_one_per_adapter(served: Any) -> None:
    client, _, _ = served
    cards = (await (await client.get("/v1/models")).json())["data"]
    assert [c["id"] for c in cards] == [MODEL, "sql", "chat"]
    base, sql = cards[0], cards[1]
    assert base["max_model_len"] == 4096 and base["parent"] is None
    assert sql["root"] == "/adapters/sql" and sql["parent"] == MODEL
    assert sql["max_model_len"] is None
    assert set(sql) == set(base)  # the same card shape, as vLLM's ModelCard
    assert sql["object"] == "model" and sql["owned_by"] == "vllm"


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "hello there", "max_tokens": 3, "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 3, "ignore_eos": True}),
    ("/v1/embeddings", {"input": ["one", "two"]}),
])
async def test_a_request_naming_an_adapter_is_served_by_it(served: Any, path: str,
                                                           body: dict[str, Any]) -> None:
    client, emulator, submitted = served
    response = await client.post(path, json={**body, "model": "sql"})
    assert response.status == 200, await response.text()
    assert (await response.json())["model"] == "sql"
    assert submitted and {s.lora for s in submitted} == {"sql"}
    submitted.clear()
    response = await client.post(path, json={**body, "model": MODEL})
    assert (await response.json())["model"] == MODEL
    assert {s.lora for s in submitted} == {None}
    assert emulator.model.lora_requests == {}  # every request left the engine


async def test_a_stream_from_an_adapter_names_it_in_every_chunk(served: Any) -> None:
    client, _, _ = served
    response = await client.post("/v1/chat/completions", json={
        "model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    chunks = [json.loads(line[len("data: "):]) for line in (await response.text()).split("\n\n")
              if line.startswith("data: {")]
    assert len(chunks) >= 3 and {c["model"] for c in chunks} == {"chat"}


async def test_an_unknown_model_gets_vllms_404_naming_the_served_model_only(
        served: Any) -> None:
    client, _, submitted = served
    response = await client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    assert response.status == 404
    error = (await response.json())["error"]
    # vLLM's message lists the served model's names, not the adapters.
    assert error == {"message": f"The model `nope` does not exist. Valid aliases: {MODEL}.",
                     "type": "NotFoundError", "param": "model", "code": 404}
    assert not submitted


async def test_without_lora_an_adapter_name_is_unknown() -> None:
    emulator = Emulator(EmulatorSettings(model_name=MODEL), get_profile("cpu-tiny"))
    async with TestClient(TestServer(emulator.app)) as client:
        response = await client.post("/v1/completions", json={"model": "sql", "prompt": "x"})
        assert response.status == 404
        cards = (await (await client.get("/v1/models")).json())["data"]
        assert [c["id"] for c in cards] == [MODEL]
        text = await (await client.get("/metrics")).text()
        assert "vllm:lora_requests_info" not in text  # vLLM exports it only with LoRA on


def test_lora_requests_info_has_vllms_labels_and_lists_the_adapters_in_flight() -> None:
    model = StepModel(EngineConfig(max_loras=2), FLAT)
    metrics = EngineMetrics(model, MODEL, max_loras=2)
    model.add(seq("a", 10, 5, lora="sql"))
    model.add(seq("b", 10, 5, lora="chat"))
    model.add(seq("c", 10, 5))
    result = model.step(0.0)
    assert result is not None
    metrics.on_step(result, 0.0)
    samples = parse_metrics(generate_latest(metrics.registry).decode())
    (labels, value), = samples.samples["vllm:lora_requests_info"]
    # As vLLM 0.32: no model_name/engine label; both adapter labels list every adapter
    # with a request in the engine; the value is when that state was last seen.
    assert labels == {"max_lora": "2", "waiting_lora_adapters": "sql,chat",
                      "running_lora_adapters": "sql,chat"}
    assert value > 1e9
    list(simulate(model, []))
    assert model.lora_requests == {}


# -- the step model -----------------------------------------------------------------------------

def test_a_request_of_a_third_adapter_is_passed_over_and_keeps_its_place() -> None:
    """max_loras=2: a (sql) and b (chat) fill the batch's adapters; c (docs) is passed over,
    d (sql) and e (base model) behind it are admitted; c is still first in the queue and
    runs once an adapter leaves the batch."""
    model = StepModel(EngineConfig(max_loras=2), FLAT)
    a, b = seq("a", 10, 2, "sql"), seq("b", 10, 6, "chat")
    c, d, e = seq("c", 10, 2, "docs"), seq("d", 10, 2, "sql"), seq("e", 10, 2)
    for s in (a, b, c, d, e):
        model.add(s)
    batch = model.schedule(0.0)
    assert batch is not None
    assert list(batch.scheduled) == [a, b, d, e]
    assert list(model.waiting) == [c]
    model.complete(batch, batch.duration_s)
    # a and d (sql) finish at their second token; then c's docs fits beside chat.
    batch = model.schedule(1.0)
    assert batch is not None and c not in batch.scheduled
    model.complete(batch, 1.0 + batch.duration_s)
    batch = model.schedule(2.0)
    assert batch is not None and c in batch.scheduled
    assert {s.lora for s in model.running} == {"chat", "docs"}


def test_max_loras_one_serialises_adapters_but_not_the_base_model() -> None:
    model = StepModel(EngineConfig(), FLAT)  # max_loras=1, vLLM's default
    x1, y1, b1, x2 = (seq("x1", 10, 3, "x"), seq("y1", 10, 3, "y"), seq("b1", 10, 3),
                      seq("x2", 10, 3, "x"))
    steps = list(simulate(model, [x1, y1, b1, x2]))
    assert list(steps[0].batch.scheduled) == [x1, b1, x2]
    # y1 starts only when the last x request has left the batch.
    assert y1.first_scheduled_s == max(x1.finished_s or 0, x2.finished_s or 0) > 0


def test_split_mode_counts_every_running_adapter() -> None:
    model = StepModel(EngineConfig(max_loras=1, chunked_prefill=False,
                                   max_num_batched_tokens=4096), FLAT)
    model.add(seq("x1", 10, 5, "x"))
    model.step(0.0)
    model.add(seq("y1", 10, 5, "y"))
    model.add(seq("b1", 10, 5))
    batch = model.schedule(1.0)
    assert batch is not None and [s.request_id for s in batch.scheduled] == ["b1"]
    assert [s.request_id for s in model.waiting] == ["y1"]


# -- properties over arbitrary loads ------------------------------------------------------------

ADAPTERS = st.sampled_from([None, None, "a", "b", "c", "d"])
requests = st.lists(
    st.tuples(
        st.floats(min_value=0.0, max_value=2.0),  # arrival
        st.integers(min_value=1, max_value=300),  # prompt tokens
        st.integers(min_value=1, max_value=60),  # output tokens
        st.integers(min_value=0, max_value=3),  # priority
        ADAPTERS,
    ),
    min_size=1,
    max_size=40,
)


@st.composite
def configs(draw: st.DrawFn) -> EngineConfig:
    block_size = draw(st.sampled_from([4, 8, 16]))
    kv_tokens = draw(st.integers(min_value=384, max_value=1600))
    return EngineConfig(
        max_num_seqs=draw(st.integers(min_value=1, max_value=16)),
        max_num_batched_tokens=draw(st.integers(min_value=16, max_value=512)),
        num_kv_blocks=math.ceil(kv_tokens / block_size),
        block_size=block_size,
        max_model_len=384,
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
        max_loras=draw(st.integers(min_value=1, max_value=3)),
    )


def _arrivals(reqs: list[tuple[float, int, int, int, str | None]]) -> list[Sequence]:
    return [seq(f"r{i}", p, o, lora, a, prio) for i, (a, p, o, prio, lora) in enumerate(reqs)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), reqs=requests)
def test_max_loras_holds_and_a_request_is_passed_over_only_for_it(
        config: EngineConfig, reqs: list[tuple[float, int, int, int, str | None]]) -> None:
    """Under any load with adapters: the running sequences never hold more than max_loras
    distinct adapters; every request still finishes once; the per-adapter count of requests
    in the engine is exact. Under fcfs, a step keeps the waiting queue's order (the requests
    passed over stay where they were), and a request behind which one was admitted was passed
    over only because its adapter was new to a batch already holding max_loras adapters."""
    model = StepModel(config, FLAT)
    pending = sorted(_arrivals(reqs), key=lambda s: s.arrival_s)
    now, k = 0.0, 0
    finished: list[str] = []
    while True:
        while k < len(pending) and pending[k].arrival_s <= now:
            model.add(pending[k])
            k += 1
        waiting_before = list(model.waiting)
        batch = model.schedule(now)
        if batch is None:
            if k == len(pending):
                break
            now = pending[k].arrival_s
            continue
        loras = {s.lora for s in model.running if s.lora is not None}
        assert len(loras) <= config.max_loras
        in_engine = [s for s in pending[:k] if not s.is_finished]
        counts: dict[str | int, int] = {}
        for s in in_engine:
            if s.lora is not None:
                counts[s.lora] = counts.get(s.lora, 0) + 1
        assert model.lora_requests == counts
        admitted = [s for s in waiting_before if s in batch.scheduled]
        if config.scheduling_policy == "fcfs":
            rest = [s for s in waiting_before if s not in batch.scheduled]
            assert list(model.waiting) == batch.preempted[::-1] + rest
            if admitted:
                last = waiting_before.index(admitted[-1])
                for s in waiting_before[:last]:
                    if s not in batch.scheduled:
                        assert s.lora is not None and s.lora not in loras
                        assert len(loras) == config.max_loras
        result = model.complete(batch, now + batch.duration_s)
        finished.extend(s.request_id for s in result.finished)
        now = result.end_s
    assert sorted(finished) == sorted(s.request_id for s in pending)
    assert all(s.output_tokens == s.target_output_tokens for s in pending)
    assert model.lora_requests == {} and model.free_blocks == config.num_kv_blocks
