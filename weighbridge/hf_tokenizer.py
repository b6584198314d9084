"""A Hugging Face model directory's tokenizer and chat template, applied as vLLM's API server
applies them: ``tokenizer.json`` through the ``tokenizers`` library (its post-processor adds
the special tokens a completion's prompt begins with), and the chat template
(``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``) rendered by
Jinja with transformers' settings, then tokenized without adding special tokens again.

The emulator counts, numbers and caches prompts by it (``--tokenizer``, emulator/tokenizer.py);
the sidecar counts text prompts in the served model's tokens by it (``models.<name>.tokenizer``,
sidecar/tokenizer.py). ``tokenizers`` and ``jinja2`` are imported when a directory is loaded,
so neither is needed until one is.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["MODULES", "HfTokenizer"]

# What loading needs, as the import names the extras install.
MODULES = ("tokenizers", "jinja2")


def _raise(message: str) -> None:
    raise ValueError(message)  # a template's raise_exception(), as transformers defines it


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json gives it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


class HfTokenizer:
    """A model directory's tokenizer and (when it has one) chat template. ``what`` names the
    setting that asked for it, and ``extra`` the extra that installs the libraries, in the
    errors (a ``ValueError``): missing libraries, no ``tokenizer.json``."""

    def __init__(self, directory: str | Path, *, what: str, extra: str) -> None:
        try:
            from jinja2.sandbox import ImmutableSandboxedEnvironment
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError(f"{what} needs the tokenizers and jinja2 packages: pip install "
                             f"'weighbridge[{extra}]'") from None
        root = Path(directory)
        if not (root / "tokenizer.json").is_file():
            raise ValueError(f"{what} {directory}: no tokenizer.json there")
        self.tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
        config: dict[str, Any] = {}
        if (root / "tokenizer_config.json").is_file():
            config = json.loads((root / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        if (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text()
        self.has_chat_template = isinstance(template, str)
        # transformers' settings for chat templates, so whitespace renders as in vLLM.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(template) if isinstance(template, str) else None
        self._specials = {name: _token_text(config.get(name))
                          for name in ("bos_token", "eos_token", "pad_token", "unk_token")}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s ids. Through the batch call: it releases the GIL while it tokenizes
        (``encode`` holds it), so a thread tokenizing leaves the event loop running."""
        return list(self.tokenizer.encode_batch_fast(
            [text], add_special_tokens=add_special_tokens)[0].ids)

    def render_chat(self, messages: Sequence[tuple[str, str]],
                    add_generation_prompt: bool = True) -> str:
        """The chat template rendered for (role, content) messages."""
        if self._template is None:
            raise ValueError("the tokenizer has no chat template")
        return self._template.render(
            messages=[{"role": role, "content": content} for role, content in messages],
            add_generation_prompt=add_generation_prompt, **self._specials)

    def chat_ids(self, messages: Sequence[tuple[str, str]],
                 add_generation_prompt: bool = True) -> list[int]:
        """A chat prompt's ids: the rendered template, tokenized without adding special
        tokens again (the template writes them)."""
        return self.encode(self.render_chat(messages, add_generation_prompt),
                           add_special_tokens=False)
