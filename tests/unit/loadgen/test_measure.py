from __future__ import annotations

import dataclasses

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weighbridge.loadgen.measure import StreamMeter
from weighbridge.loadgen.plan import RequestPlan

PLAN = RequestPlan(request_id="t-0", tenant="t", tier="standard", phase="p", user="t-u1",
                   endpoint="/v1/chat/completions", stream=True, prompt_tokens=20,
                   max_tokens=6, scheduled_s=1.0, content_seed=0)


def _event(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _chat(content: str | None = None, **delta: object) -> bytes:
    d = dict(delta)
    if content is not None:
        d["content"] = content
    return _event({"choices": [{"index": 0, "delta": d, "finish_reason": None}]})


USAGE = _event({"choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 6,
                                         "total_tokens": 26}})
DONE = b"data: [DONE]\n\n"

# (bytes, arrival time): a role chunk and an empty chunk first, then content chunks of
# several tokens each, the usage chunk and [DONE].
STREAM = [
    (_chat(role="assistant", content=""), 1.010),
    (_chat(""), 1.020),
    (_chat(" a b"), 1.100),
    (_chat(reasoning_content="hmm"), 1.130),
    (_chat(" c d"), 1.150),
    (_event({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0}]}}]}), 1.250),
    (USAGE, 1.251),
    (DONE, 1.252),
]


def _meter(status: int = 200, headers: dict[str, str] | None = None) -> StreamMeter:
    meter = StreamMeter(PLAN, "run", "scn")
    meter.sent(1.001)
    meter.response(1.005, status, headers or {})
    return meter


def test_first_token_is_the_first_content_chunk_and_counts_come_from_usage() -> None:
    meter = _meter(headers={"x-weighbridge-backend": "b1", "x-weighbridge-queue-ms": "250"})
    for data, t in STREAM:
        meter.feed(data, t)
    meter.finish(1.253)
    r = meter.record()
    assert r.status == "ok" and r.http_status == 200
    assert r.first_token_s == 1.100  # not the role-only or the empty chunk
    assert r.ttft_s == pytest.approx(0.100)
    assert r.last_token_s == 1.250
    assert r.chunks == 4
    assert (r.prompt_tokens, r.output_tokens) == (20, 6)  # usage, not 4 chunks
    assert r.itl_max_s == pytest.approx(0.100)
    assert r.itl_p50_s == pytest.approx(0.030)
    assert (r.backend, r.queue_s) == ("b1", 0.25)
    assert (r.user, r.max_tokens, r.scheduled_s, r.sent_s) == ("t-u1", 6, 1.0, 1.001)
    assert r.model is None  # the plan named none


def test_the_record_keeps_the_model_the_request_named() -> None:
    meter = StreamMeter(dataclasses.replace(PLAN, model="model-a-lora"), "run", "scn")
    meter.timed_out(2.0)
    assert meter.record().model == "model-a-lora"


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_split_of_the_bytes_measures_the_same(data: st.DataObject) -> None:
    """Events cut anywhere by the network keep their content; an event is timed when its
    last byte arrives."""
    reference = _meter()
    for chunk, t in STREAM:
        reference.feed(chunk, t)
    reference.finish(2.0)
    meter = _meter()
    for chunk, t in STREAM:
        cuts = sorted(data.draw(st.sets(st.integers(1, len(chunk) - 1), max_size=4)))
        pieces = [chunk[a:b] for a, b in zip([0, *cuts], [*cuts, len(chunk)], strict=True)]
        for piece in pieces:
            meter.feed(piece, t)
    meter.finish(2.0)
    assert meter.record() == reference.record()


def test_crlf_events_are_parsed() -> None:
    meter = _meter()
    meter.feed(_chat(" x").replace(b"\n", b"\r\n"), 1.2)
    meter.feed(USAGE.replace(b"\n", b"\r\n") + DONE.replace(b"\n", b"\r\n"), 1.3)
    meter.finish(1.3)
    r = meter.record()
    assert (r.status, r.first_token_s, r.output_tokens) == ("ok", 1.2, 6)


def test_continuous_usage_keeps_the_latest_counts() -> None:
    meter = _meter()
    for i in range(1, 4):
        meter.feed(_event({"choices": [{"index": 0, "text": " w"}],
                           "usage": {"prompt_tokens": 20, "completion_tokens": i}}), 1 + i)
    meter.finish(5.0)  # cut off: no [DONE]
    r = meter.record()
    assert (r.status, r.reason, r.output_tokens) == ("error", "stream_ended_early", 3)


def test_error_event_mid_stream() -> None:
    meter = _meter()
    meter.feed(_chat(" x"), 1.1)
    meter.feed(_event({"error": {"message": "boom", "type": "InternalServerError",
                                 "code": 500}}) + DONE, 1.2)
    meter.finish(1.2)
    r = meter.record()
    assert (r.status, r.reason, r.first_token_s) == ("error", "500", 1.1)


@pytest.mark.parametrize("status, headers, body, expected", [
    (429, {"x-weighbridge-reject-reason": "rate_limited"}, {"error": {"code": "x"}},
     ("rejected", "rate_limited")),
    (503, {}, {"error": {"message": "busy", "type": "ServiceUnavailable"}},
     ("rejected", "ServiceUnavailable")),
    (400, {}, {"error": {"message": "bad", "type": "BadRequestError", "code": 400}},
     ("error", "400")),
    (500, {}, b"<html>oops", ("error", None)),
])
def test_non_200_answers(status: int, headers: dict[str, str], body: object,
                         expected: tuple[str, str | None]) -> None:
    meter = _meter(status, headers)
    meter.body(body if isinstance(body, bytes) else orjson.dumps(body), 1.1)
    meter.finish(1.1)
    r = meter.record()
    assert (r.status, r.reason) == expected
    assert r.http_status == status and r.first_token_s is None


def test_non_streamed_answer_is_one_chunk() -> None:
    meter = _meter()
    meter.body(orjson.dumps({"choices": [{"index": 0, "message": {"content": "hi there"}}],
                             "usage": {"prompt_tokens": 20, "completion_tokens": 2}}), 1.4)
    meter.finish(1.4)
    r = meter.record()
    assert (r.status, r.first_token_s, r.last_token_s, r.chunks, r.output_tokens) == (
        "ok", 1.4, 1.4, 1, 2)


def test_an_embeddings_answer_is_one_chunk_of_no_output() -> None:
    meter = _meter()
    meter.body(orjson.dumps({"object": "list", "data": [{"index": 0, "embedding": [0.5]}],
                             "usage": {"prompt_tokens": 20, "total_tokens": 20}}), 1.3)
    meter.finish(1.3)
    r = meter.record()
    assert (r.status, r.first_token_s, r.chunks, r.prompt_tokens, r.output_tokens) == (
        "ok", 1.3, 1, 20, None)


def test_timeout_and_cancel_are_recorded_as_such() -> None:
    meter = _meter()
    meter.feed(_chat(" x"), 1.1)
    meter.timed_out(9.0)
    assert (meter.record().status, meter.record().reason) == ("timeout", "client_timeout")
    never_sent = StreamMeter(PLAN, "run", "scn")
    never_sent.cancelled(3.0)
    r = never_sent.record()
    assert (r.status, r.sent_s, r.http_status) == ("cancelled", None, None)


def test_record_before_the_end_is_a_bug() -> None:
    with pytest.raises(RuntimeError):
        _meter().record()


@settings(max_examples=50)
@given(st.lists(st.floats(0, 100, allow_nan=False), max_size=20),
       st.lists(st.floats(0, 100, allow_nan=False), max_size=20))
def test_contents_in_bulk_measures_as_chunk_by_chunk(first: list[float],
                                                     then: list[float]) -> None:
    one, bulk = _meter(), _meter()
    for t in first + then:
        one.content(t)
    bulk.contents(first)
    bulk.contents(then)
    for m in (one, bulk):
        m.finish(200.0)
    assert bulk.record() == one.record()
