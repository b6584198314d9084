"""A backend's priority_scheduling against the policy its engine runs (issue 41, point 2):
the sidecar reads it from the engine's /server_info at start-up, or learns it from the first
answer refusing a priority, and says a mismatch in one log line, on
``weighbridge_backend_policy_mismatch`` and in /admin/state. Real processes on loopback:
emulated engines (with vLLM's development switch where they should show their policy) and
one sidecar."""

from __future__ import annotations

import contextlib
from typing import Any

import httpx
import pytest

from tests.support.ledger import admin_state
from tests.support.metrics import scrape
from tests.support.stack import ADMIN_KEY, auth, completion, start_sidecar, tenant
from tests.support.wait import wait_for
from weighbridge.launch import ServerProcess, emulator_process

pytestmark = pytest.mark.timeout(120)

DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}


def engine(processes: contextlib.ExitStack, env: dict[str, str] | None = None,
           **flags: Any) -> ServerProcess:
    process = emulator_process(max_num_seqs=4, num_kv_blocks=256, **flags)
    process.env = env
    return processes.enter_context(process)


@pytest.fixture(scope="module")
def sidecar(processes: contextlib.ExitStack) -> ServerProcess:
    backends = [
        # Flag on, engine fcfs: read at start-up.
        ("on-fcfs", engine(processes, DEV_MODE), True),
        # Flag off, engine priority: read at start-up.
        ("off-priority", engine(processes, DEV_MODE, scheduling_policy="priority"), False),
        # Both priority: they agree.
        ("agrees", engine(processes, DEV_MODE, scheduling_policy="priority"), True),
        # Flag on, an fcfs engine that refuses priorities and has no /server_info.
        ("refuses", engine(processes, refuse_priority_under_fcfs=True), True),
    ]
    return start_sidecar(processes, {
        "tenants": {"t": tenant("standard", "sk-t")},  # standard: vllm_priority 5
        "backends": [{"url": e.url, "name": name, "priority_scheduling": flag}
                     for name, e, flag in backends],
        "admin_api_keys": [f"plain:{ADMIN_KEY}"],
        "routing": "round_robin",
    })


def mismatch(url: str, backend: str) -> float:
    return scrape(url).value("weighbridge_backend_policy_mismatch", backend=backend)


def test_a_mismatch_read_at_start_up_is_said_once(sidecar: ServerProcess) -> None:
    wait_for(lambda: mismatch(sidecar.url, "on-fcfs") == 1
             and mismatch(sidecar.url, "off-priority") == 1, 20,
             what="both mismatches read from /server_info")
    assert mismatch(sidecar.url, "agrees") == 0
    assert mismatch(sidecar.url, "refuses") == 0  # nothing shown yet
    policies = {name: b["scheduling_policy"]
                for name, b in admin_state(sidecar.url)["backends"].items()}
    assert policies["on-fcfs"] == {"configured": "priority", "engine": "fcfs",
                                   "source": "server_info", "agrees": False, "refusals": 0}
    assert policies["agrees"]["agrees"] is True
    assert policies["refuses"]["engine"] is None
    assert sidecar.log_path is not None
    text = sidecar.log_path.read_text()
    assert text.count("backend on-fcfs: priority_scheduling says priority") == 1
    assert text.count("backend off-priority: priority_scheduling says fcfs") == 1
    assert "backend agrees:" not in text


def test_the_first_refusal_is_said_and_the_tier_never_fails_silently(
        sidecar: ServerProcess) -> None:
    statuses = []
    with httpx.Client(timeout=30) as client:
        for _ in range(8):  # round robin: twice through each backend
            r = client.post(sidecar.url + "/v1/completions", json=completion(2),
                            headers=auth("sk-t"))
            statuses.append(r.status_code)
    # The refusing engine's answers reach the client as it gave them (400), and are said.
    assert statuses.count(400) == 2 and statuses.count(200) == 6, statuses
    assert mismatch(sidecar.url, "refuses") == 1
    assert scrape(sidecar.url).value("weighbridge_backend_priority_refusals_total",
                                     backend="refuses") == 2
    state = admin_state(sidecar.url)["backends"]["refuses"]["scheduling_policy"]
    assert state["engine"] == "fcfs" and state["source"] == "refusal"
    assert sidecar.log_path is not None
    assert sidecar.log_path.read_text().count(
        "backend refuses: priority_scheduling says priority") == 1
