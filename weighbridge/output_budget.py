"""A generation request's output budget as vLLM reads it from the body.

The emulator generates by this rule and the sidecar limits and charges by it, so the two read
the same body the same way (``tests/conformance`` checks the rule against real vLLM).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# vLLM's CompletionRequest default for `max_tokens`; a null one takes it too.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def budget_field(chat: bool, body: Mapping[str, Any]) -> str:
    """The field vLLM takes a request's budget from: a chat request's
    ``max_completion_tokens`` unless it is null or absent, else ``max_tokens`` (completions
    read no other)."""
    if chat and body.get("max_completion_tokens") is not None:
        return "max_completion_tokens"
    return "max_tokens"


def sequences(body: Mapping[str, Any]) -> int:
    """How many answers the request generates: ``n`` (vLLM 0.32 ignores ``best_of``)."""
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
