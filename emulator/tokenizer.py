"""What turns a request's text into the token ids the engine counts, caches and bills.

Two tokenizers answer the same questions:

* :data:`RULE`, the default: the emulator's own documented rule (emulator/text.py), which
  needs no files and which the load generator and the simulator count by too.
* :class:`ModelTokenizer`: a Hugging Face model directory's ``tokenizer.json`` and chat
  template, loaded with the ``tokenizers`` library and rendered with Jinja as vLLM's API
  server renders them (``--tokenizer``; weighbridge.hf_tokenizer, which the sidecar counts
  text prompts by too). Given the directory of the model a real vLLM
  serves, the emulator counts, numbers and caches every prompt as that vLLM does, so a
  request's ``prompt_tokens`` and ``cached_tokens`` can be compared one for one.

Each also names the tokens it generates: a deterministic piece per (request seed, index),
whose id a next turn that resends the answer as text may hit in the prefix cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from weighbridge.emulator import text
from weighbridge.hf_tokenizer import HfTokenizer

__all__ = ["RULE", "ModelTokenizer", "RuleTokenizer", "Tokenizer"]


class Tokenizer(Protocol):
    def prompt_ids(self, prompt: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        """A completions prompt's ids: BOS first unless ``add_special_tokens`` is false."""
        ...

    def chat_ids(self, messages: Sequence[tuple[str, str]],
                 add_generation_prompt: bool = True) -> tuple[int, ...]:
        """A chat prompt's ids for (role, content) messages, rendered by the template."""
        ...

    def output_id(self, seed: int, index: int) -> int:
        """The id of output token ``index`` of the request numbered ``seed``."""
        ...

    def output_ids(self, seed: int, start: int, count: int) -> list[int]:
        """Ids of output tokens ``start`` to ``start + count`` of the request ``seed``."""
        ...

    def output_text(self, seed: int, start: int, count: int) -> str:
        """Their text, one piece per token."""
        ...


class RuleTokenizer:
    """The emulator's own rule (emulator/text.py)."""

    def prompt_ids(self, prompt: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        ids = text.prompt_ids(prompt)
        return ids if add_special_tokens else ids[1:]

    def chat_ids(self, messages: Sequence[tuple[str, str]],
                 add_generation_prompt: bool = True) -> tuple[int, ...]:
        ids = text.chat_ids(messages)
        return ids if add_generation_prompt else ids[:-1]

    def output_id(self, seed: int, index: int) -> int:
        return text.generated_token_id(seed, index)

    def output_ids(self, seed: int, start: int, count: int) -> list[int]:
        return text.generated_token_ids(seed, start, count)

    def output_text(self, seed: int, start: int, count: int) -> str:
        return text.generated_text(seed, start, count)


RULE = RuleTokenizer()


class ModelTokenizer:
    """A model directory's tokenizer and chat template (module doc), read by
    ``weighbridge.hf_tokenizer`` as the sidecar reads it."""

    def __init__(self, directory: str | Path) -> None:
        self._model = HfTokenizer(directory, what="--tokenizer", extra="emulator")
        if not self._model.has_chat_template:
            raise ValueError(f"--tokenizer {directory}: no chat template (chat_template.jinja "
                             "or tokenizer_config.json's chat_template)")
        tokenizer = self._model.tokenizer
        special = {t.content for t in tokenizer.get_added_tokens_decoder().values()
                   if t.special}
        # What generated tokens are drawn from: ids whose text is one printable ASCII piece,
        # so that a streamed answer's chunks concatenate to the answer.
        self._pieces: list[tuple[int, str]] = []
        for piece, token_id in sorted(tokenizer.get_vocab().items(), key=lambda x: x[1]):
            if piece in special:
                continue
            decoded = tokenizer.decode([token_id])
            if decoded and decoded.isascii() and decoded.isprintable():
                self._pieces.append((token_id, decoded))
        if not self._pieces:
            raise ValueError(f"--tokenizer {directory}: no printable tokens in its vocabulary")

    def prompt_ids(self, prompt: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        return tuple(self._model.encode(prompt, add_special_tokens))

    def chat_ids(self, messages: Sequence[tuple[str, str]],
                 add_generation_prompt: bool = True) -> tuple[int, ...]:
        return tuple(self._model.chat_ids(messages, add_generation_prompt))

    def _piece(self, seed: int, index: int) -> tuple[int, str]:
        return self._pieces[(seed * 31 + index * 7) % len(self._pieces)]

    def output_id(self, seed: int, index: int) -> int:
        return self._piece(seed, index)[0]

    def output_ids(self, seed: int, start: int, count: int) -> list[int]:
        return [self._piece(seed, i)[0] for i in range(start, start + count)]

    def output_text(self, seed: int, start: int, count: int) -> str:
        return "".join(self._piece(seed, i)[1] for i in range(start, start + count))

