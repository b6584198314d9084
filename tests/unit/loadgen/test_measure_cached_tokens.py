"""The meter's prefix-cache and session fields: ``cached_tokens`` from usage (bodies as
vLLM sends them with --enable-prompt-tokens-details, and without), and a turn's answer."""

from __future__ import annotations

import dataclasses

import orjson
import pytest

from weighbridge.loadgen.measure import StreamMeter
from weighbridge.loadgen.plan import RequestPlan

PLAN = RequestPlan(request_id="t-s0-t1", tenant="t", tier="standard", phase="p", user=None,
                   endpoint="/v1/completions", stream=True, prompt_tokens=300, max_tokens=3,
                   scheduled_s=1.0, content_seed=0, session_id="t-s0", turn=1)


def _event(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _usage(details: object) -> dict[str, object]:
    usage: dict[str, object] = {"prompt_tokens": 300, "completion_tokens": 3,
                                "total_tokens": 303}
    if details is not ...:
        usage["prompt_tokens_details"] = details
    return usage


def _completion_chunk(text: str, ids: list[int] | None) -> bytes:
    return _event({"choices": [{"index": 0, "text": text, "finish_reason": None,
                                "token_ids": ids}]})


def _streamed(plan: RequestPlan, chunks: list[bytes], usage: dict[str, object]) -> StreamMeter:
    meter = StreamMeter(plan, "run", "s")
    meter.sent(1.0)
    meter.response(1.001, 200, {})
    for i, chunk in enumerate(chunks):
        meter.feed(chunk, 1.01 + i * 0.01)
    meter.feed(_event({"choices": [], "usage": usage}) + b"data: [DONE]\n\n", 1.1)
    meter.finish(1.1)
    return meter


@pytest.mark.parametrize(("details", "cached"), [
    ({"cached_tokens": 288}, 288),  # vLLM with --enable-prompt-tokens-details
    ({"cached_tokens": 0}, 0),
    (None, None),  # vLLM without the flag sends null
    (..., None),  # a server without the field at all
    ({"cached_tokens": "288"}, None),  # not a count
])
def test_cached_tokens_come_from_usage_or_stay_empty(details: object,
                                                     cached: int | None) -> None:
    meter = _streamed(PLAN, [_completion_chunk(" a", None)], _usage(details))
    record = meter.record()
    assert record.cached_tokens == cached
    assert record.computed_prompt_tokens == (None if cached is None else 300 - cached)
    assert (record.session_id, record.turn) == ("t-s0", 1)


def test_a_completions_turn_keeps_its_answer_text_and_token_ids() -> None:
    chunks = [_completion_chunk(" a", [7]), _completion_chunk(" b c", [8, 9])]
    answer = _streamed(PLAN, chunks, _usage({"cached_tokens": 288})).answer()
    assert answer is not None
    assert (answer.tokens, answer.text, answer.token_ids) == (3, " a b c", (7, 8, 9))


def test_ids_that_do_not_add_up_to_the_usage_are_dropped() -> None:
    chunks = [_completion_chunk(" a", [7]), _completion_chunk(" b c", None)]
    answer = _streamed(PLAN, chunks, _usage(None)).answer()
    assert answer is not None and answer.token_ids is None and answer.text == " a b c"


def test_a_chat_turn_keeps_its_streamed_content() -> None:
    plan = dataclasses.replace(PLAN, endpoint="/v1/chat/completions")
    chunks = [_event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
              _event({"choices": [{"index": 0, "delta": {"content": " fair"}}]}),
              _event({"choices": [{"index": 0, "delta": {"content": " cue tier"}}]})]
    answer = _streamed(plan, chunks, _usage(None)).answer()
    assert answer is not None and answer.text == " fair cue tier" and answer.tokens == 3


def test_a_whole_body_answer_and_its_cached_tokens() -> None:
    plan = dataclasses.replace(PLAN, stream=False, endpoint="/v1/chat/completions")
    meter = StreamMeter(plan, "run", "s")
    meter.sent(1.0)
    meter.response(1.001, 200, {})
    meter.body(orjson.dumps({"choices": [{"index": 0, "message": {"role": "assistant",
                                                                  "content": " x y z"},
                                          "token_ids": [3, 4, 5]}],
                             "usage": _usage({"cached_tokens": 192})}), 1.2)
    meter.finish(1.2)
    answer = meter.answer()
    assert answer is not None and answer.token_ids == (3, 4, 5) and answer.text == " x y z"
    assert meter.record().cached_tokens == 192


def test_no_answer_without_an_ok_end_or_outside_sessions() -> None:
    meter = StreamMeter(PLAN, "run", "s")
    meter.sent(1.0)
    meter.response(1.001, 200, {})
    meter.feed(_completion_chunk(" a", [7]), 1.01)
    meter.timed_out(2.0)
    assert meter.answer() is None
    plain = dataclasses.replace(PLAN, session_id=None, turn=None)
    assert _streamed(plain, [_completion_chunk(" a", [7])], _usage(None)).answer() is None
