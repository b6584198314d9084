"""Build a tiny random-weight Llama model, fully offline, for the real-vLLM CPU harness.

Run it inside the real-vLLM virtual environment (it imports torch, transformers and
tokenizers, which the main environment does not have)::

    .venv-vllm/bin/python -m weighbridge.emulator.tiny_model --out .cache/tiny-llama [--seed 0]

Everything is deterministic from ``--seed``: the training text for the tokenizer is
generated from a seeded RNG, the byte-level BPE tokenizer is trained on it with
``tokenizers``, and the model weights are drawn from a seeded torch generator. No hub
access is needed or attempted. The result is a normal Hugging Face model directory
(``config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``,
``chat_template.jinja``, ``generation_config.json``) that ``vllm serve`` loads as-is.

The model's output is noise; it exists so that vLLM's real scheduler, KV cache, API
server and metrics run on a 2-core machine. Its shape keeps head_dim at 64 because
the vLLM CPU attention backend rejects smaller head sizes (16 fails).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Model shape. hidden_size / num_attention_heads = head_dim = 64 (CPU attention needs it).
VOCAB_SIZE = 2048
HIDDEN_SIZE = 128
NUM_HEADS = 2
NUM_KV_HEADS = 2
NUM_LAYERS = 2
INTERMEDIATE_SIZE = 256
MAX_POSITION_EMBEDDINGS = 4096

BOS = "<s>"
EOS = "</s>"
PAD = "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = [PAD, BOS, EOS, *ROLE_TOKENS]  # ids 0..5, in this order

# A minimal chat template: `<s><|user|>\nhello\n<|assistant|>\n`. vLLM renders the template
# and then tokenizes without adding special tokens, so the template emits the BOS itself.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

_ONSETS = ["", "b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "v", "w",
           "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "st", "th", "tr", "wh"]
_VOWELS = ["a", "e", "i", "o", "u", "ea", "ee", "ai", "oo", "ou", "y"]
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "d", "m", "ng", "ck", "st", "nd", "rt"]
_FUNCTION_WORDS = ["the", "a", "of", "and", "to", "in", "is", "it", "that", "for", "on",
                   "with", "as", "was", "at", "by", "this", "from", "be", "are", "we", "you"]
_PUNCT = [".", ".", ".", "?", "!"]


def generate_corpus(seed: int, n_sentences: int = 20000) -> list[str]:
    """Deterministic English-ish text: a seeded lexicon of syllable words, Zipf-ish use."""
    rng = random.Random(seed)
    lexicon: list[str] = []
    seen: set[str] = set()
    while len(lexicon) < 3000:
        word = "".join(
            rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
            for _ in range(rng.choice((1, 1, 2, 2, 3)))
        )
        if word and word not in seen:
            seen.add(word)
            lexicon.append(word)
    weights = [1.0 / (rank + 1) for rank in range(len(lexicon))]
    lines: list[str] = []
    for _ in range(n_sentences):
        n_words = rng.randint(4, 18)
        words = [
            rng.choice(_FUNCTION_WORDS)
            if rng.random() < 0.35
            else rng.choices(lexicon, weights=weights, k=1)[0]
            for _ in range(n_words)
        ]
        if rng.random() < 0.1:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        sentence = " ".join(words)
        sentence = sentence[0].upper() + sentence[1:]
        if rng.random() < 0.15:
            cut = rng.randrange(1, len(words))
            head, tail = " ".join(words[:cut]), " ".join(words[cut:])
            sentence = f"{head[0].upper()}{head[1:]}, {tail}"
        lines.append(sentence + rng.choice(_PUNCT))
    return lines


def train_tokenizer(corpus: list[str], vocab_size: int = VOCAB_SIZE) -> Any:
    """Train a byte-level BPE tokenizer (GPT-2 style) that prepends BOS to every encoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def batches() -> Iterator[list[str]]:
        for i in range(0, len(corpus), 1000):
            yield corpus[i : i + 1000]

    tok.train_from_iterator(batches(), trainer=trainer, length=len(corpus))
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def build(out: Path, seed: int) -> dict[str, Any]:
    """Write the tokenizer and model into ``out`` and return the manifest."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import (
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    out.mkdir(parents=True, exist_ok=True)
    raw = train_tokenizer(generate_corpus(seed))
    vocab_size = raw.get_vocab_size()
    if vocab_size != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer trained to {vocab_size} tokens, expected {VOCAB_SIZE}")

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
        model_max_length=MAX_POSITION_EMBEDDINGS,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    bos_id = tokenizer.convert_tokens_to_ids(BOS)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    pad_id = tokenizer.convert_tokens_to_ids(PAD)

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HIDDEN_SIZE // NUM_HEADS,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(seed)
    with torch.no_grad():
        model = LlamaForCausalLM(config)
        # Re-draw every parameter from one seeded generator in a fixed order, so the weights
        # depend on nothing but the seed (not on transformers' init code paths).
        gen = torch.Generator().manual_seed(seed)
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * config.initializer_range)
    model.generation_config = GenerationConfig(
        bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)

    files = sorted(p for p in out.iterdir() if p.is_file() and not p.name.startswith("."))
    manifest: dict[str, Any] = {
        "seed": seed,
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN_SIZE,
        "num_layers": NUM_LAYERS,
        "num_heads": NUM_HEADS,
        "num_kv_heads": NUM_KV_HEADS,
        "head_dim": HIDDEN_SIZE // NUM_HEADS,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "sha256": {
            p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in files
            if p.name != "weighbridge-tiny.json"
        },
    }
    (out / "weighbridge-tiny.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m weighbridge.emulator.tiny_model",
        description="Build a tiny random-weight Llama model offline (run inside .venv-vllm).",
    )
    parser.add_argument("--out", type=Path, required=True, help="output model directory")
    parser.add_argument("--seed", type=int, default=0, help="seed for text, tokenizer, weights")
    args = parser.parse_args(argv)
    manifest = build(args.out, args.seed)
    print(
        f"tiny model written to {args.out} (seed {args.seed}, vocab {manifest['vocab_size']}, "
        f"hidden {manifest['hidden_size']}, layers {manifest['num_layers']}, "
        f"head_dim {manifest['head_dim']})",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
