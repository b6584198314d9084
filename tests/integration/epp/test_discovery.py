"""Pod discovery (``weighbridge epp --pool-name``; sidecar/discovery.py) against an API server
on loopback that speaks the list and watch protocol (tests/integration/epp/kube_api.py).

The "pods" are emulated engines on their own loopback addresses (127.0.0.2, .3, ...), all on
one port, as pods share the pool's target port: the picker reads the InferencePool, lists
and watches the pods its selector selects, and binds requests only to the ready ones, as they
become ready, go away, change labels, or the pool's selector changes; after the API server
cuts its watches, or the watch history expires (410), it lists again and misses nothing."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.integration.epp.data_plane import bind, channel, destination
from tests.integration.epp.kube_api import POD, POOL, KubeApi, inference_pool, pod
from tests.support.ledger import ledger, settled
from tests.support.metrics import scrape
from tests.support.stack import tenant
from tests.support.wait import wait_for
from weighbridge.launch import ServerProcess, emulator_process, epp_process

pytestmark = pytest.mark.timeout(180)

ADDRESSES = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
VLLM = {"app": "vllm"}


def shared_port() -> int:
    """A port free on every pod address."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((ADDRESSES[0], 0))
            port = int(probe.getsockname()[1])
        try:
            for address in ADDRESSES[1:]:
                with socket.socket() as other:
                    other.bind((address, port))
        except OSError:
            continue
        return port
    raise RuntimeError("no port free on every pod address")


@dataclass(frozen=True)
class Cluster:
    api: KubeApi
    picker: ServerProcess
    target: str  # the picker's gRPC address
    port: int  # the pods' port

    def endpoint(self, address: str) -> str:
        return f"{address}:{self.port}"

    def backends(self) -> set[str]:
        """The picker's backends, as its metrics label them."""
        return set(scrape(self.picker.url).by("weighbridge_backend_healthy", "backend"))

    def await_backends(self, *addresses: str) -> None:
        wanted = {self.endpoint(a) for a in addresses}
        wait_for(lambda: self.backends() == wanted or None, 20,
                 what=f"the picker's backends {sorted(wanted)} (has {sorted(self.backends())})")


@pytest.fixture(scope="module")
def cluster(processes: contextlib.ExitStack) -> Iterator[Cluster]:
    port = shared_port()
    for i, address in enumerate(ADDRESSES):
        processes.enter_context(emulator_process(name=f"pod-{i}", host=address, port=port))
    api = processes.enter_context(KubeApi())
    api.apply(POOL, inference_pool("vllm", VLLM, port))
    api.apply(POD, pod("vllm-0", ADDRESSES[0], VLLM))
    api.apply(POD, pod("vllm-1", ADDRESSES[1], VLLM))
    api.apply(POD, pod("vllm-2", ADDRESSES[2], VLLM, ready=False))
    api.apply(POD, pod("other-0", "127.0.0.9", {"app": "other"}))
    kubeconfig = api.kubeconfig(Path(tempfile.mkdtemp(prefix="weighbridge-kube-")))
    picker, grpc_port = epp_process(
        {"tenants": {"a": tenant("standard", "sk-a")},
         # The pool's template: its url is never used (nothing listens there).
         "backends": [{"url": "http://127.0.0.1:9", "stream_interval": 1}],
         # One request a backend at a time: requests held at once spread over the backends.
         "admission": {"max_inflight_per_backend": 1}},
        args=("--pool-name", "vllm", "--pool-namespace", "default",
              "--kubeconfig", str(kubeconfig)))
    processes.enter_context(picker)
    yield Cluster(api, picker, f"127.0.0.1:{grpc_port}", port)
    assert picker.log_path is not None and "Traceback" not in picker.log_path.read_text()


async def bound_to(cluster: Cluster, requests: int) -> set[str]:
    """Where the picker binds ``requests`` requests held at once: with one request a backend
    at a time, as many backends as requests (a request beyond the backends ready would wait
    for a slot, and time out here)."""
    seen, streams = set(), []
    async with channel(cluster.target) as stub:
        for _ in range(requests):
            stream, answer = await asyncio.wait_for(bind(stub), 30)
            assert answer.HasField("request_headers"), answer
            seen.add(destination(answer)[0])
            await stream.read()
            streams.append(stream)
        for stream in streams:
            await stream.finish()
    return seen


async def test_the_ready_selected_pods_are_the_backends(cluster: Cluster) -> None:
    """Of four pods, the two ready ones the selector selects: not the unready one, not the
    one another app's labels name; the config's own backend is replaced."""
    cluster.await_backends(ADDRESSES[0], ADDRESSES[1])
    assert await bound_to(cluster, 2) == {cluster.endpoint(a) for a in ADDRESSES[:2]}
    settled(cluster.picker.url)


async def test_pods_come_and_go(cluster: Cluster) -> None:
    """A pod turning ready is bound to; one deleted, or relabelled out of the pool, no longer
    is; none is lost from the ledger."""
    api = cluster.api
    api.apply(POD, pod("vllm-2", ADDRESSES[2], VLLM))
    cluster.await_backends(*ADDRESSES)
    assert await bound_to(cluster, 3) == {cluster.endpoint(a) for a in ADDRESSES}
    api.delete(POD, "default", "vllm-0")
    api.apply(POD, pod("vllm-1", ADDRESSES[1], {"app": "retired"}))
    cluster.await_backends(ADDRESSES[2])
    assert await bound_to(cluster, 1) == {cluster.endpoint(ADDRESSES[2])}
    api.apply(POD, pod("vllm-0", ADDRESSES[0], VLLM))
    api.apply(POD, pod("vllm-1", ADDRESSES[1], VLLM))
    cluster.await_backends(*ADDRESSES)
    settled(cluster.picker.url)


async def test_a_pod_being_deleted_is_left_at_once(cluster: Cluster) -> None:
    api = cluster.api
    api.apply(POD, pod("vllm-2", ADDRESSES[2], VLLM, deleting=True))
    cluster.await_backends(ADDRESSES[0], ADDRESSES[1])
    assert await bound_to(cluster, 2) == {cluster.endpoint(a) for a in ADDRESSES[:2]}
    api.apply(POD, pod("vllm-2", ADDRESSES[2], VLLM))
    cluster.await_backends(*ADDRESSES)


async def test_the_pool_s_selector_moves_the_backends(cluster: Cluster) -> None:
    api = cluster.api
    api.apply(POD, pod("vllm-2", ADDRESSES[2], {**VLLM, "shard": "b"}))
    api.apply(POOL, inference_pool("vllm", {"shard": "b"}, cluster.port))
    cluster.await_backends(ADDRESSES[2])
    assert await bound_to(cluster, 1) == {cluster.endpoint(ADDRESSES[2])}
    api.apply(POOL, inference_pool("vllm", VLLM, cluster.port))
    cluster.await_backends(*ADDRESSES)


async def test_no_ready_pod_is_the_protocol_s_503(cluster: Cluster) -> None:
    """Every pod unready: the picker answers 503 no_eligible_endpoint at once and its
    readiness is NOT_SERVING; a pod ready again serves."""
    api = cluster.api
    for i, address in enumerate(ADDRESSES):
        api.apply(POD, pod(f"vllm-{i}", address, VLLM, ready=False))
    wait_for(lambda: readiness(cluster) == health_pb2.HealthCheckResponse.NOT_SERVING or None,
             20, what="not ready")
    before = ledger(cluster.picker.url)
    async with channel(cluster.target) as stub:
        _stream, answer = await bind(stub)
    assert answer.immediate_response.status.code == 503
    assert (ledger(cluster.picker.url) - before).rejected == {"no_eligible_endpoint": 1}
    api.apply(POD, pod("vllm-1", ADDRESSES[1], VLLM))
    wait_for(lambda: readiness(cluster) == health_pb2.HealthCheckResponse.SERVING or None,
             20, what="ready again")
    assert await bound_to(cluster, 1) == {cluster.endpoint(ADDRESSES[1])}
    for i, address in enumerate(ADDRESSES):
        api.apply(POD, pod(f"vllm-{i}", address, VLLM))
    cluster.await_backends(*ADDRESSES)


def readiness(cluster: Cluster) -> int:
    with grpc.insecure_channel(cluster.target) as ch:
        return int(health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="readiness")).status)


async def test_a_cut_watch_resumes_where_it_was(cluster: Cluster) -> None:
    """The API server cuts every watch, and a change lands before the picker is back: its
    watch resumes from the last version it saw (no list again) and sees the change."""
    api = cluster.api
    lists = api.lists[POD]
    api.drop_watches()
    api.apply(POD, pod("vllm-0", ADDRESSES[0], VLLM, ready=False))
    cluster.await_backends(ADDRESSES[1], ADDRESSES[2])
    api.apply(POD, pod("vllm-0", ADDRESSES[0], VLLM))
    cluster.await_backends(*ADDRESSES)
    assert api.lists[POD] == lists


async def test_an_expired_history_lists_again(cluster: Cluster) -> None:
    """The history is compacted and the watches cut: the resumed watch gets 410 Gone, the
    picker lists again, and sees the change made meanwhile."""
    api = cluster.api
    lists, expired = api.lists[POD], api.expired
    api.compact()
    api.drop_watches()
    api.apply(POD, pod("vllm-0", ADDRESSES[0], VLLM, ready=False))
    cluster.await_backends(ADDRESSES[1], ADDRESSES[2])
    assert api.expired > expired and api.lists[POD] > lists, (api.expired, api.lists)
    api.apply(POD, pod("vllm-0", ADDRESSES[0], VLLM))
    cluster.await_backends(*ADDRESSES)


async def test_a_file_reload_keeps_the_discovered_backends(cluster: Cluster) -> None:
    reloads = scrape(cluster.picker.url).value("weighbridge_config_reloads_total",
                                               result="ok")
    cluster.picker.signal(signal.SIGHUP)
    wait_for(lambda: scrape(cluster.picker.url).value(
        "weighbridge_config_reloads_total", result="ok") > reloads or None, 20,
        what="the reload")
    cluster.await_backends(*ADDRESSES)
    assert await bound_to(cluster, 3) == {cluster.endpoint(a) for a in ADDRESSES}
