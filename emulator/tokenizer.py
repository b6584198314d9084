"""What turns a request's text into the token ids the engine counts, caches and bills.

Two tokenizers answer the same questions:

* :data:`RULE`, the default: the emulator's own documented rule (emulator/text.py), which
  needs no files and which the load generator and the simulator count by too.
* :class:`ModelTokenizer`: a Hugging Face model directory's ``tokenizer.json`` and chat
  template, loaded with the ``tokenizers`` library and rendered with Jinja as vLLM's API
  server renders them (``--tokenizer``). Given the directory of the model a real vLLM
  serves, the emulator counts, numbers and caches every prompt as that vLLM does, so a
  request's ``prompt_tokens`` and ``cached_tokens`` can be compared one for one.

Each also names the tokens it generates: a deterministic piece per (request seed, index),
whose id a next turn that resends the answer as text may hit in the prefix cache.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from weighbridge.emulator import text

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


def _raise(message: str) -> None:
    raise ValueError(message)  # a template's raise_exception(), as transformers defines it


class ModelTokenizer:
    """A model directory's tokenizer and chat template (module doc)."""

    def __init__(self, directory: str | Path) -> None:
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            from tokenizers import Tokenizer as HfTokenizer
        except ImportError:
            raise ValueError("--tokenizer needs the tokenizers and jinja2 packages: pip "
                             "install 'weighbridge[emulator]'") from None
        root = Path(directory)
        if not (root / "tokenizer.json").is_file():
            raise ValueError(f"--tokenizer {directory}: no tokenizer.json there")
        self._tokenizer = HfTokenizer.from_file(str(root / "tokenizer.json"))
        config: dict[str, Any] = {}
        if (root / "tokenizer_config.json").is_file():
            config = json.loads((root / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        if (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text()
        if not isinstance(template, str):
            raise ValueError(f"--tokenizer {directory}: no chat template (chat_template.jinja "
                             "or tokenizer_config.json's chat_template)")
        # transformers' settings for chat templates, so whitespace renders as in vLLM.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(template)
        self._specials = {name: _token_text(config.get(name))
                          for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
        special = {t.content for t in self._tokenizer.get_added_tokens_decoder().values()
                   if t.special}
        # What generated tokens are drawn from: ids whose text is one printable ASCII piece,
        # so that a streamed answer's chunks concatenate to the answer.
        self._pieces: list[tuple[int, str]] = []
        for piece, token_id in sorted(self._tokenizer.get_vocab().items(), key=lambda x: x[1]):
            if piece in special:
                continue
            decoded = self._tokenizer.decode([token_id])
            if decoded and decoded.isascii() and decoded.isprintable():
                self._pieces.append((token_id, decoded))
        if not self._pieces:
            raise ValueError(f"--tokenizer {directory}: no printable tokens in its vocabulary")

    def prompt_ids(self, prompt: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        return tuple(self._tokenizer.encode(prompt, add_special_tokens=add_special_tokens).ids)

    def chat_ids(self, messages: Sequence[tuple[str, str]],
                 add_generation_prompt: bool = True) -> tuple[int, ...]:
        rendered = self._template.render(
            messages=[{"role": role, "content": content} for role, content in messages],
            add_generation_prompt=add_generation_prompt, **self._specials)
        # vLLM tokenizes the rendered template without adding special tokens again.
        return tuple(self._tokenizer.encode(rendered, add_special_tokens=False).ids)

    def _piece(self, seed: int, index: int) -> tuple[int, str]:
        return self._pieces[(seed * 31 + index * 7) % len(self._pieces)]

    def output_id(self, seed: int, index: int) -> int:
        return self._piece(seed, index)[0]

    def output_ids(self, seed: int, start: int, count: int) -> list[int]:
        return [self._piece(seed, i)[0] for i in range(start, start + count)]

    def output_text(self, seed: int, start: int, count: int) -> str:
        return "".join(self._piece(seed, i)[1] for i in range(start, start + count))


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json gives it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""
