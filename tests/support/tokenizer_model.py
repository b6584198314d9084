"""A model directory as ``weighbridge.emulator.tiny_model`` writes it, with a small vocabulary
and no torch: the tokenizer, its special tokens and the chat template, for the tests that
tokenize as a served model does."""

from __future__ import annotations

import json
from pathlib import Path

from weighbridge.emulator.tiny_model import (
    BOS,
    CHAT_TEMPLATE,
    EOS,
    PAD,
    generate_corpus,
    train_tokenizer,
)

VOCAB = 400


def write_model_dir(root: Path, vocab: int = VOCAB) -> Path:
    """Write the directory's tokenizer files under ``root``; returns ``root``."""
    train_tokenizer(generate_corpus(0, n_sentences=400), vocab_size=vocab).save(
        str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}))
    (root / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return root
