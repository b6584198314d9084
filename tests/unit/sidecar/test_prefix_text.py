"""Text prompts in the scheduling core's prefix index (issue 38): the engine's own prompt count
teaches each backend's bytes per token, and a shared text prefix the engine keeps stays
predicted, whatever the bytes per token of the model's tokenizer."""

from __future__ import annotations

from tests.unit.sidecar.test_core import arrive
from tests.unit.sidecar.test_prefix_routing import core_with
from weighbridge.sidecar.prefix import PromptPrefix
from weighbridge.sidecar.prompt import BYTES_PER_TOKEN
from weighbridge.sidecar.request import QueuedRequest

SYSTEM = bytes(range(97, 123)) * 134  # 3,484 bytes: 768 tokens at 4.54 bytes a token


def test_a_shared_text_prefix_stays_predicted_at_any_bytes_per_token() -> None:
    core = core_with("prefix_aware")
    for i in range(60):
        prompt = SYSTEM + f"question {i:03} ".encode() * 90  # 4,654 bytes, 1,025 tokens
        request = arrive(core, "a", float(i), prompt_tokens=len(prompt) // BYTES_PER_TOKEN,
                         max_tokens=8, prefix=PromptPrefix(text=prompt))
        assert isinstance(request, QueuedRequest)
        (dispatch,) = core.dispatch_ready(float(i))
        if i > 1:  # the first answer turns predictions on
            assert dispatch.request.predicted_cached_tokens >= 704  # 44 of the 48 blocks
        core.on_completed(dispatch.request, 1025, 8, i + 0.5, cached_tokens=768 if i else 0)
    index = core.snapshot(61.0)["backends"][dispatch.backend]["prefix_index"]
    assert index["retained_blocks"] == index["capacity_blocks"]  # never read as an eviction
    assert 4.4 < index["bytes_per_token"] < 4.7
