"""The live isolation benchmarks' sizes: the ideal flood's cap and the session victims' shape
(benchmarks/isolation.py, benchmarks/isolation_sessions.py)."""

from __future__ import annotations

from pathlib import Path

import yaml

from benchmarks import isolation, isolation_sessions
from benchmarks.isolation import flood_streams_in_kv
from weighbridge.loadgen.tenants import parse_tenants


def test_the_cap_leaves_the_victims_room_in_kv() -> None:
    # Issue 14's shape: KV for 26 flood sequences of 22 blocks, room for two of them.
    assert flood_streams_in_kv(572, 32, 704, 2 * 704, 32, 2) == isolation.IDEAL_STREAMS == 24
    # A partial block of room takes a whole block: 571 usable blocks hold 25 of 22, not 26.
    assert flood_streams_in_kv(572, 32, 704, 1, 32, 0) == 25


def test_the_cap_leaves_the_victims_sequence_slots() -> None:
    assert flood_streams_in_kv(10_000, 32, 800, 0, 32, 8) == 24


def test_the_cap_is_never_negative() -> None:
    assert flood_streams_in_kv(100, 32, 800, 4_000, 32, 8) == 0


def test_the_session_shape() -> None:
    shape = isolation_sessions.ENGINE
    # (640 blocks - 8 histories of 928 tokens = 232 blocks) // 25 blocks per flood sequence
    assert isolation_sessions.IDEAL_STREAMS == (640 - 232) // 25 == 16
    assert shape["max_model_len"] >= isolation_sessions.VICTIM_HISTORY
    assert shape["max_model_len"] \
        >= isolation_sessions.FLOOD_PROMPT + isolation_sessions.FLOOD_OUTPUT
    assert shape["block_size"] % 32 == 0  # vLLM's CPU attention backend needs it


def test_the_victims_tenants_file_parses_and_every_tenant_has_a_key() -> None:
    parsed = parse_tenants(yaml.safe_load(isolation_sessions.tenants_yaml()),
                           base_dir=Path("."), source="isolation_sessions")
    names = {t.name for t in parsed.tenants}
    assert names == {"victim", "steady-a", "steady-b"}
    keys = isolation_sessions.SETUP.keys
    assert names | {"flood"} == set(keys)
    assert {t.api_key for t in parsed.tenants} == {keys[n] for n in names}
    assert all(t.sessions is not None for t in parsed.tenants)
