"""Keys and prompts stay secret: keys are stored as hashes made by ``weighbridge hash-key``
(or read from the environment and hashed at load), compared in constant time, and neither a
key nor a prompt reaches the configuration on disk, the log, /metrics, /admin/state or the
traces — for served requests, for every kind of rejection and failure, and for request heads
aiohttp's parser refuses with a key in the refused line (nor does any answer).

The served-request case of traces is also in tests/integration/exporters/test_otlp_traces.py
and the log, /metrics and /admin/state case for a served and a 401 request in
tests/integration/sidecar/test_auth.py.
"""

from __future__ import annotations

import hmac
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.exporters.test_otlp_traces import Receiver
from tests.support.answers import assert_rejected, assert_served
from tests.support.ledger import settled
from tests.support.stack import SMALL_ENGINE, auth
from weighbridge.launch import emulator_process, sidecar_process, weighbridge_argv
from weighbridge.sidecar import config as config_module
from weighbridge.sidecar.config import parse_config

pytestmark = pytest.mark.timeout(120)

HASHED_KEY = "sk-hashed-8c1e"  # configured as `weighbridge hash-key` prints it
ENV_KEY = "sk-from-env-51d0"  # configured as env:WB_SECRET_KEY
ADMIN = "sk-admin-hashed-77aa"
TYPO_KEY = "sk-typo-0e9d"
PROMPT = "PROMPT-SECRET-c41f"
SECRETS = (HASHED_KEY, ENV_KEY, ADMIN, TYPO_KEY, PROMPT)


def hash_key(key: str) -> str:
    result = subprocess.run(weighbridge_argv("hash-key", key), capture_output=True, text=True,
                            timeout=60, check=True)
    return result.stdout.strip()


def malformed_heads(key: str) -> list[bytes]:
    """Request heads aiohttp's parser refuses, the key in the line it refuses: a key file's
    CRLF line end, a NUL after the key, a space before the colon, bare LF line ends."""
    start = b"POST /v1/completions HTTP/1.1\r\nHost: sidecar\r\n"
    end = b"Content-Length: 2\r\n\r\n{}"
    lines = [f"Authorization: Bearer {key}\r\r\n", f"Authorization: Bearer {key}\x00\r\n",
             f"Authorization : Bearer {key}\r\n", f"X-Api-Key: {key}\x01\r\n"]
    bare_lf = f"POST /v1/completions HTTP/1.1\nHost: s\nAuthorization: Bearer {key}\n\n"
    return [start + line.encode("latin-1") + end for line in lines] + [bare_lf.encode()]


def exchange(url: str, raw: bytes) -> bytes:
    """``raw`` sent on a new connection; what came back until the server closed it."""
    target = httpx.URL(url)
    with socket.create_connection((target.host, target.port), timeout=10) as sock:
        sock.sendall(raw)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        return received


def test_hash_key_prints_the_stored_form() -> None:
    stored = hash_key(HASHED_KEY)
    assert stored.startswith("sha256:") and len(stored) == len("sha256:") + 64
    assert HASHED_KEY not in stored
    config = parse_config({"backends": [{"url": "http://127.0.0.1:1"}],
                           "tenants": {"t": {"tier": "standard", "api_keys": [stored]}}})
    assert config.tenant_for_key(HASHED_KEY) == "t"
    assert config.tenant_for_key(HASHED_KEY + "x") is None


def test_keys_are_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tenant keys: found by digest, then confirmed with hmac.compare_digest. Admin keys:
    every stored digest is compared, whichever matches (or none), so the time does not
    depend on the key's position or on how much of it is right."""
    admins = [f"plain:sk-admin-{i}" for i in range(5)]
    config = parse_config({"backends": [{"url": "http://127.0.0.1:1"}],
                           "tenants": {"t": {"tier": "standard", "api_keys": ["plain:sk-t"]}},
                           "admin_api_keys": admins})
    calls: list[tuple[str, str]] = []
    compare = hmac.compare_digest

    def recording(a: str, b: str) -> bool:
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(config_module.hmac, "compare_digest", recording)
    assert config.tenant_for_key("sk-t") == "t"
    assert len(calls) == 1
    for key in ("sk-admin-0", "sk-admin-4", "sk-admin-", "nothing", "sk-t"):
        calls.clear()
        assert config.is_admin_key(key) == (key in ("sk-admin-0", "sk-admin-4"))
        assert len(calls) == len(admins), key
        # Digests of equal length are compared, never the raw keys.
        assert all(len(a) == len(b) == 64 for a, b in calls)


def test_no_key_or_prompt_in_config_log_metrics_state_or_traces(tmp_path: Path) -> None:
    config = {
        "tenants": {
            "hashed": {"tier": "standard", "api_keys": [hash_key(HASHED_KEY)],
                       "limits": {"max_queued": 1}},
            "envkey": {"tier": "batch", "api_keys": ["env:WB_SECRET_KEY"]},
        },
        "admin_api_keys": [hash_key(ADMIN)],
        "max_tokens_limit": 16,
    }
    with Receiver() as receiver, emulator_process(**SMALL_ENGINE, t_fixed=0.02) as emulator:
        config["backends"] = [{"url": emulator.url, "name": "emu"}]
        config["telemetry"] = {"otlp_endpoint": f"http://127.0.0.1:{receiver.port}"}
        sidecar = sidecar_process(config, config_dir=tmp_path)
        sidecar.env = {"WB_SECRET_KEY": ENV_KEY}
        with sidecar:
            url = sidecar.url
            body = {"prompt": PROMPT, "max_tokens": 4, "user": "u-1"}
            with httpx.Client(base_url=url, timeout=30) as client:
                assert_served(client.post("/v1/completions", json=body,
                                          headers=auth(HASHED_KEY)), "hashed")
                assert_served(client.post("/v1/completions", json={**body, "stream": True},
                                          headers=auth(ENV_KEY)), "envkey")
                assert_served(client.post("/v1/chat/completions", headers=auth(ENV_KEY),
                                          json={"messages": [{"role": "user",
                                                              "content": PROMPT}],
                                                "max_tokens": 2}), "envkey")
                # Rejections of every kind, each carrying the prompt.
                assert_rejected(client.post("/v1/completions", json=body,
                                            headers=auth(TYPO_KEY)), 401, "unauthorized")
                assert_rejected(client.post("/v1/completions", headers=auth(HASHED_KEY),
                                            json={**body, "max_tokens": 999}),
                                400, "max_tokens_too_large")
                assert_rejected(client.post("/v1/completions", headers=auth(HASHED_KEY),
                                            content=b'{"prompt": "' + PROMPT.encode()),
                                400, "invalid_json")
                assert_rejected(client.post("/v1/completions", json=body, headers={
                    **auth(ENV_KEY), "x-weighbridge-tier": "interactive"}),
                    403, "tier_not_allowed")
                # A backend's own error answer, with the prompt in the request.
                failed = client.post("/v1/completions", headers=auth(HASHED_KEY),
                                     json={"prompt": PROMPT * 400, "max_tokens": 4})
                assert 400 <= failed.status_code < 500
                assert_rejected(client.get("/admin/state", headers=auth(HASHED_KEY)), 403,
                                "forbidden")
            # Heads aiohttp's parser refuses, each quoting a key in the offending line.
            answers = [exchange(url, head) for key in (HASHED_KEY, ENV_KEY, ADMIN)
                       for head in malformed_heads(key)]
            assert all(a.split(b" ")[1] == b"400" for a in answers), answers
            with httpx.Client(base_url=url, timeout=30) as client:
                state = client.get("/admin/state", headers=auth(ADMIN))
                assert state.status_code == 200
                metrics = client.get("/metrics").text
            settled(url)
            log_path = sidecar.log_path
        deadline = time.monotonic() + 20  # spans are flushed when the sidecar stops
        while len(receiver.roots()) < 8 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(receiver.roots()) >= 8, [r["attributes"] for r in receiver.roots()]
        raw_spans = b"".join(receiver.raw)
    assert log_path is not None
    texts = {
        "config": (tmp_path / "sidecar.yaml").read_text(),
        "log": log_path.read_text(errors="replace"),
        "metrics": metrics,
        "state": state.text,
        "answers": b"".join(answers).decode("latin-1"),
        "spans": raw_spans.decode("latin-1"),
    }
    for where, text in texts.items():
        for secret in SECRETS:
            if where == "config" and secret == PROMPT:
                continue
            assert secret not in text, f"{secret!r} appears in the {where}"
    # The config on disk holds neither raw key: only the digest and the variable's name.
    assert "env:WB_SECRET_KEY" in texts["config"] and "sha256:" in texts["config"]
