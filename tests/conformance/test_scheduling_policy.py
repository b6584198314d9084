"""The scheduling policy as both backends apply and show it (issue 41, point 2), on the
suite's servers, which run fcfs: a request with a non-zero priority is accepted and
answered (vLLM 0.32's V1 engine ignores the field under fcfs; its V0 engine refused it,
which the emulator does only with ``--refuse-priority-under-fcfs``), and the development
endpoint ``/server_info`` (``VLLM_SERVER_DEV_MODE=1``) names the policy where the sidecar
reads it (sidecar.engine_policy)."""

from __future__ import annotations

import httpx
import pytest

from tests.conformance.backends import Backend
from weighbridge.sidecar.engine_policy import policy_of_server_info

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("priority", [5, -3])
@pytest.mark.parametrize("stream", [False, True])
def test_a_priority_under_fcfs_is_accepted(backend: Backend, priority: int,
                                           stream: bool) -> None:
    for path, body in (("/v1/completions", {"prompt": [7, 8, 9]}),
                       ("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}]})):
        r = httpx.post(backend.url + path, timeout=60, json={
            "model": backend.model, "max_tokens": 2, "ignore_eos": True, "stream": stream,
            "priority": priority, **body})
        assert r.status_code == 200, (backend.kind, path, r.text)
        assert ("data: [DONE]" in r.text) if stream else r.json()["usage"]["completion_tokens"] == 2


def test_server_info_names_the_scheduling_policy(backend: Backend) -> None:
    r = httpx.get(backend.url + "/server_info", params={"config_format": "json"}, timeout=60)
    assert r.status_code == 200, (backend.kind, r.text[:300])
    assert policy_of_server_info(r.content) == "fcfs"
