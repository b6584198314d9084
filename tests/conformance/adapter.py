"""A LoRA adapter for the tiny model, written offline, for the conformance servers started
with ``--lora-modules`` (tests/conformance/test_lora.py checks what they serve).

Real vLLM loads the adapter's files: a PEFT directory (``adapter_config.json`` +
``adapter_model.safetensors``) of rank 8 on the attention's q_proj and v_proj, every weight
zero (the adapter changes nothing; vLLM only checks its names and shapes). The safetensors
file is written by hand (an 8-byte header length, a JSON header, the raw little-endian
float32 data), so no torch is needed here.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

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
