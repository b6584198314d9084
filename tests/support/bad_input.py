"""Malformed and edge-case requests and the reason the sidecar refuses each with: the rows of
tests/integration/sidecar/test_bad_input.py (the live sidecar in front of the emulator) and
of tests/unit/sidecar/test_session.py (the live app and the simulator, side by side).

The bodies are sent by the tenant owning ``KEY`` to a sidecar whose config has
``max_body_bytes: MAX_BODY_BYTES`` and ``max_tokens_limit: MAX_TOKENS_LIMIT``.
"""

from __future__ import annotations

MAX_BODY_BYTES = 4096
MAX_TOKENS_LIMIT = 64
KEY = "sk-bad-input"

# (name, body, reason) of /v1/completions, /v1/chat/completions and /v1/embeddings bodies.
BAD_BODIES: list[tuple[str, bytes, str]] = [
    ("malformed", b'{"prompt": "hi", ', "invalid_json"),
    ("not-json", b"prompt=hi", "invalid_json"),
    ("empty", b"", "invalid_json"),
    ("not-utf8", b'{"prompt": "\xff\xfe"}', "invalid_json"),
    ("too-deep", b"[" * 2000 + b"]" * 2000, "invalid_json"),
    # orjson reads integers beyond 64 bits as floats.
    ("huge-int", b'{"prompt": [1], "max_tokens": 100000000000000000000000}',
     "invalid_max_tokens"),
    ("array", b"[1, 2, 3]", "invalid_body"),
    ("string", b'"a prompt"', "invalid_body"),
    ("null", b"null", "invalid_body"),
    ("number", b"42", "invalid_body"),
    ("max_tokens-0", b'{"prompt": [1], "max_tokens": 0}', "invalid_max_tokens"),
    ("max_tokens-negative", b'{"prompt": [1], "max_tokens": -1}', "invalid_max_tokens"),
    ("max_tokens-string", b'{"prompt": [1], "max_tokens": "ten"}', "invalid_max_tokens"),
    ("max_tokens-true", b'{"prompt": [1], "max_tokens": true}', "invalid_max_tokens"),
    ("max_tokens-float", b'{"prompt": [1], "max_tokens": 1.5}', "invalid_max_tokens"),
    ("max_tokens-list", b'{"prompt": [1], "max_tokens": [5]}', "invalid_max_tokens"),
    ("max_tokens-over-limit", b'{"prompt": [1], "max_tokens": 65}', "max_tokens_too_large"),
    ("priority-string", b'{"prompt": [1], "priority": "high"}', "invalid_priority"),
    ("priority-false", b'{"prompt": [1], "priority": false}', "invalid_priority"),
    # One below int64's range: the JSON parser rounds it to -2**63, which is in range.
    ("priority-below-int64", b'{"prompt": [1], "priority": -9223372036854775809}',
     "invalid_priority"),
    ("max_tokens-above-int64", b'{"prompt": [1], "max_tokens": 9223372036854775808}',
     "invalid_max_tokens"),
    ("stream-string", b'{"prompt": [1], "stream": "yes"}', "invalid_stream"),
    # Live charging counts a streamed chunk's tokens by it; vLLM refuses these too.
    ("stream_interval-0", b'{"prompt": [1], "stream": true, "stream_interval": 0}',
     "invalid_stream_interval"),
    ("stream_interval-string", b'{"prompt": [1], "stream": true, "stream_interval": "4"}',
     "invalid_stream_interval"),
    ("stream_interval-true", b'{"prompt": [1], "stream": true, "stream_interval": true}',
     "invalid_stream_interval"),
    ("stream_interval-float", b'{"prompt": [1], "stream": true, "stream_interval": 2.5}',
     "invalid_stream_interval"),
    ("user-number", b'{"prompt": [1], "user": 5}', "invalid_user"),
    # vLLM types vllm_xargs as strings, numbers and flat lists of them (an object
    # agentic_context is forwarded as its JSON string instead: sidecar.programs).
    ("vllm_xargs-list", b'{"prompt": [1], "vllm_xargs": [1]}', "invalid_vllm_xargs"),
    ("vllm_xargs-object-value", b'{"prompt": [1], "vllm_xargs": {"k": {"a": 1}}}',
     "invalid_vllm_xargs"),
    ("vllm_xargs-nested-list", b'{"prompt": [1], "vllm_xargs": {"k": [[1]]}}',
     "invalid_vllm_xargs"),
    ("vllm_xargs-null-value", b'{"prompt": [1], "vllm_xargs": {"k": null}}',
     "invalid_vllm_xargs"),
    ("agentic_context-not-json", b'{"prompt": [1], "vllm_xargs": {"agentic_context": "{"}}',
     "invalid_agentic_context"),
    ("agentic_context-program-object",
     b'{"prompt": [1], "vllm_xargs": {"agentic_context": {"program_id": {"a": 1}}}}',
     "invalid_agentic_context"),
    ("agentic_context-program-too-long",
     b'{"prompt": [1], "vllm_xargs": {"agentic_context": {"program_id": "' + b"p" * 300
     + b'"}}}', "invalid_agentic_context"),
    ("model-number", b'{"prompt": [1], "model": 5}', "invalid_model"),
    ("prompt-missing", b'{"max_tokens": 4}', "invalid_prompt"),
    ("prompt-empty", b'{"prompt": ""}', "invalid_prompt"),
    ("prompt-empty-list", b'{"prompt": []}', "invalid_prompt"),
    ("prompt-mixed", b'{"prompt": [1, "a"]}', "invalid_prompt"),
    ("prompt-object", b'{"prompt": {"text": "hi"}}', "invalid_prompt"),
    ("prompt-bools", b'{"prompt": [true, false]}', "invalid_prompt"),
    # Token ids as vLLM refuses them (out of vocabulary); beyond 64 bits the parser's float
    # would not serialise again for the backend.
    ("token-id-beyond-64-bits", b'{"prompt": [18446744073709551616], "max_tokens": 1}',
     "invalid_prompt"),
    ("token-id-beyond-int64", b'{"prompt": [9223372036854775808], "max_tokens": 1}',
     "invalid_prompt"),
    ("token-id-negative", b'{"prompt": [5, -1], "max_tokens": 1}', "invalid_prompt"),
    ("token-id-batch-beyond-64-bits",
     b'{"prompt": [[1], [18446744073709551616]], "max_tokens": 1}', "invalid_prompt"),
    # A field the sidecar never reads, nested deeper than it can forward (orjson reads 1,024
    # levels and writes 255).
    ("unread-field-too-deep", b'{"prompt": [1], "max_tokens": 1, "x": ' + b"[" * 300
     + b"]" * 300 + b"}", "invalid_body"),
    ("n-0", b'{"prompt": [1], "n": 0}', "invalid_n"),
    ("n-string", b'{"prompt": [1], "n": "2"}', "invalid_n"),
]

BAD_CHAT_BODIES: list[tuple[str, bytes, str]] = [
    ("messages-missing", b'{"max_tokens": 4}', "invalid_prompt"),
    ("messages-empty", b'{"messages": []}', "invalid_prompt"),
    ("messages-not-list", b'{"messages": "hi"}', "invalid_prompt"),
    ("message-not-object", b'{"messages": ["hi"]}', "invalid_prompt"),
    ("content-number", b'{"messages": [{"role": "user", "content": 5}]}', "invalid_prompt"),
    ("part-not-object", b'{"messages": [{"role": "user", "content": ["hi"]}]}',
     "invalid_prompt"),
    ("max_completion_tokens-0",
     b'{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}',
     "invalid_max_tokens"),
    ("max_completion_tokens-string",
     b'{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": "5"}',
     "invalid_max_completion_tokens"),
    ("max_completion_tokens-over-limit",
     b'{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1000}',
     "max_tokens_too_large"),
    # vLLM generates max_completion_tokens when it is set, whatever max_tokens says.
    ("max_completion_tokens-over-limit-beside-max_tokens",
     b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,'
     b' "max_completion_tokens": 5000}', "max_tokens_too_large"),
    ("unread-field-too-deep", b'{"messages": [{"role": "user", "content": "hi"}], "x": '
     + b"{\"a\": " * 300 + b"1" + b"}" * 300 + b"}", "invalid_body"),
]

BAD_EMBEDDING_BODIES: list[tuple[str, bytes, str]] = [
    ("token-id-beyond-64-bits", b'{"input": [18446744073709551616]}', "invalid_prompt"),
    ("token-id-negative", b'{"input": [-3]}', "invalid_prompt"),
    ("unread-field-too-deep", b'{"input": "hi", "x": ' + b"[" * 300 + b"]" * 300 + b"}",
     "invalid_body"),
]

# (name, path, body, reason) of vLLM's pooling endpoints: what the charge is read from, as
# vLLM would refuse it, and the fields the sidecar reads.
BAD_POOLING_BODIES: list[tuple[str, str, bytes, str]] = [
    ("rerank-no-query", "/rerank", b'{"documents": ["a"]}', "invalid_prompt"),
    ("rerank-query-list", "/v1/rerank", b'{"query": ["a"], "documents": ["b"]}',
     "invalid_prompt"),
    ("rerank-no-documents", "/v2/rerank", b'{"query": "q", "documents": []}',
     "invalid_prompt"),
    ("rerank-document-number", "/rerank", b'{"query": "q", "documents": [1]}',
     "invalid_prompt"),
    ("score-two-to-three", "/score", b'{"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}',
     "invalid_prompt"),
    ("score-one-side", "/v1/score", b'{"text_1": "a"}', "invalid_prompt"),
    ("pooling-no-input", "/pooling", b'{"input": []}', "invalid_prompt"),
    ("classify-token-negative", "/classify", b'{"input": [-3]}', "invalid_prompt"),
    ("rerank-priority-float", "/rerank", b'{"query": "q", "documents": ["a"], "priority": 1.5}',
     "invalid_priority"),
    ("score-user-number", "/score", b'{"text_1": "a", "text_2": "b", "user": 5}',
     "invalid_user"),
    ("pooling-model-number", "/pooling", b'{"input": "a", "model": 7}', "invalid_model"),
    ("rerank-malformed", "/rerank", b'{"query": ', "invalid_json"),
    ("classify-array", "/classify", b"[1]", "invalid_body"),
    ("pooling-too-deep", "/pooling", b'{"input": "hi", "x": ' + b"[" * 300 + b"]" * 300 + b"}",
     "invalid_body"),
]

# x-weighbridge-deadline-ms values refused as invalid_deadline.
BAD_DEADLINES = ["abc", "-5", "0", "nan", "inf", "-inf", "", "1e400", "10ms", "0x10"]
