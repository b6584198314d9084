"""LoRA adapters, one suite for the emulator and real vLLM CPU: /v1/models lists an adapter
given with ``--lora-modules``, and a request naming it is served under its name.

Real vLLM loads the adapter's files, so the suite writes one for the tiny model offline: a
PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``) of rank 8 on the
attention's q_proj and v_proj, every weight zero (the adapter changes nothing; vLLM only
checks its names and shapes). The safetensors file is written by hand (an 8-byte header
length, a JSON header, the raw little-endian float32 data), so no torch is needed here.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conformance.backends import (
    MAX_MODEL_LEN,
    Backend,
    assert_error_body,
    emulator_backend,
    real_vllm,
)
from tests.support import metrics
from weighbridge.emulator.real_vllm import tiny_model_dir

ADAPTER = "zero-adapter"
RANK = 8
TARGETS = ("q_proj", "v_proj")


def _tiny_config(model_dir: Path) -> dict[str, int]:
    config = model_dir / "config.json"
    if config.is_file():
        return json.loads(config.read_text())
    # The emulator never reads the adapter: without the tiny model, its documented shape.
    return {"num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 2,
            "num_key_value_heads": 2, "head_dim": 64}


def write_zero_lora(out: Path, model_dir: Path, rank: int = RANK) -> Path:
    """A zero-weight PEFT LoRA adapter for the Llama in ``model_dir``, written to ``out``."""
    cfg = _tiny_config(model_dir)
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    out_features = {"q_proj": heads * head_dim,
                    "v_proj": int(cfg.get("num_key_value_heads") or heads) * head_dim}
    tensors: dict[str, tuple[int, int]] = {}
    for layer in range(int(cfg["num_hidden_layers"])):
        for module in TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (rank, hidden)
            tensors[f"{prefix}.lora_B.weight"] = (out_features[module], rank)
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (rows, cols) in tensors.items():
        size = rows * cols * 4
        header[name] = {"dtype": "F32", "shape": [rows, cols],
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_model.safetensors").write_bytes(
        struct.pack("<Q", len(raw)) + raw + bytes(offset))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "lora_dropout": 0.0, "target_modules": list(TARGETS), "bias": "none",
        "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False,
        "use_dora": False, "base_model_name_or_path": str(model_dir)}, indent=2))
    return out


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_zero_lora(tmp_path_factory.mktemp("lora") / ADAPTER, tiny_model_dir())


def _lora_flags(path: Path) -> list[str]:
    return ["--enable-lora", "--lora-modules", f"{ADAPTER}={path}", "--max-loras", "1",
            "--max-lora-rank", str(RANK)]


@pytest.fixture(scope="module")
def emulator_lora_backend(adapter_dir: Path) -> Iterator[Backend]:
    with emulator_backend(enable_lora=True, lora_modules=[f"{ADAPTER}={adapter_dir}"],
                          max_lora_rank=RANK) as backend:
        yield backend


@pytest.fixture(scope="module")
def vllm_lora_backend(adapter_dir: Path) -> Iterator[Backend]:
    with real_vllm(extra_args=_lora_flags(adapter_dir)) as server:
        yield Backend("vllm", server.url, server.model_name)


@pytest.fixture(params=["emulator_lora", pytest.param("vllm_lora", marks=pytest.mark.vllm)])
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue(f"{request.param}_backend")


def test_models_lists_the_adapter_after_the_base_model(backend: Backend,
                                                       adapter_dir: Path) -> None:
    r = httpx.get(backend.url + "/v1/models", timeout=10)
    assert r.status_code == 200, r.text
    cards = r.json()["data"]
    assert [c["id"] for c in cards] == [backend.model, ADAPTER]
    base, adapter = cards
    assert base["parent"] is None and base["max_model_len"] == MAX_MODEL_LEN
    assert adapter["root"] == str(adapter_dir) and adapter["parent"] == backend.model
    assert adapter["max_model_len"] is None
    assert set(adapter) == set(base)
    assert (adapter["object"], adapter["owned_by"]) == ("model", "vllm")


def test_a_request_naming_the_adapter_is_answered_under_its_name(backend: Backend) -> None:
    body = {"model": ADAPTER, "prompt": [7, 8, 9, 10, 11], "max_tokens": 4, "ignore_eos": True,
            "temperature": 0}
    r = httpx.post(backend.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == ADAPTER
    assert r.json()["usage"]["completion_tokens"] == 4
    chat = httpx.post(backend.url + "/v1/chat/completions", timeout=60, json={
        "model": ADAPTER, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "ignore_eos": True, "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert chat.json()["model"] == ADAPTER


def test_an_unknown_model_is_a_404_naming_the_served_model(backend: Backend) -> None:
    r = httpx.post(backend.url + "/v1/completions", timeout=10,
                   json={"model": "no-such-adapter", "prompt": [7, 8], "max_tokens": 1})
    assert_error_body(r, 404)
    assert r.json()["error"]["message"] == (
        f"The model `no-such-adapter` does not exist. Valid aliases: {backend.model}.")


def test_lora_requests_info_names_the_adapter_of_a_request_in_flight(backend: Backend) -> None:
    body = {"model": ADAPTER, "prompt": [7, 8, 9], "max_tokens": 6, "ignore_eos": True,
            "temperature": 0}
    assert httpx.post(backend.url + "/v1/completions", json=body, timeout=60).status_code == 200
    scrape = metrics.scrape(backend.url)
    assert scrape.types.get("vllm:lora_requests_info") == "gauge"
    series = [labels for labels, _ in scrape.samples["vllm:lora_requests_info"]]
    assert {frozenset(s) for s in series} == {
        frozenset({"max_lora", "waiting_lora_adapters", "running_lora_adapters"})}
    assert all(s["max_lora"] == "1" for s in series)
    # vLLM 0.32 lists every adapter with a request in the engine under both labels.
    assert {"running_lora_adapters": ADAPTER, "waiting_lora_adapters": ADAPTER,
            "max_lora": "1"} in series
