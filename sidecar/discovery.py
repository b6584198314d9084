"""The picker's backends as the InferencePool's ready pods, watched in the Kubernetes API as
the Gateway API Inference Extension's own endpoint picker watches them.

``weighbridge epp --pool-name NAME`` reads the InferencePool ``NAME`` and the pods of its
namespace that its ``selector.matchLabels`` selects. A pod is an endpoint while its
``Ready`` condition is ``True``, it is not being deleted and it has an IP: one endpoint
``ip:port`` for each of the pool's ``targetPorts`` (the GIE EPP's rule). The endpoints
become the picker's backends, each named by its ``ip:port`` (the value the picker gives the
gateway) and with the settings of the config file's first backend, the pool's template (its
``url`` is not used): a pod that turns ready is added (probed before it takes work), one that
stops being ready or goes away is removed and drains, as a reload adds and removes backends
(sidecar/reload.py). A file reload keeps the discovered backends.

The protocol is the API server's list-then-watch (client-go's reflector): list with a
``resourceVersion``, watch from it (``allowWatchBookmarks``, a server-side timeout after which
the watch resumes from the last version seen), list again on ``410 Gone`` or any error, after
a capped back-off. The client is ``kubernetes_asyncio``, the maintained asyncio client; it
reads the in-cluster service account, or a kubeconfig file (``--kubeconfig``).

What the pure part decides (:class:`PoolSpec`, :func:`pod_endpoints`, :class:`PoolMembers`,
:func:`with_endpoints`) is tested alone (tests/unit/sidecar/test_discovery.py); the watch
against an API server on loopback that speaks the watch protocol
(tests/integration/epp/test_discovery.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from weighbridge.sidecar.config import Backend, Config
from weighbridge.sidecar.reload import ReloadRefused

if TYPE_CHECKING:
    from weighbridge.sidecar.app import Sidecar

log = logging.getLogger("weighbridge.epp.discovery")

__all__ = ["PodEndpoint", "PoolDiscovery", "PoolMembers", "PoolRef", "PoolSpec",
           "pod_endpoints", "with_endpoints"]

GROUP, VERSION, PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
# A watch the server ends after this long (with jitter, as client-go's reflector does); it
# then resumes from the last version seen, so a silent connection is noticed.
WATCH_TIMEOUT_S = 300
# The back-off after a failed list or watch, doubled up to the cap.
RETRY_S, MAX_RETRY_S = 0.5, 30.0
# An endpoint whose name still drains (a pod's IP given back to a new pod before the old
# one's requests finished) is added this long after, at the earliest.
DRAIN_RETRY_S = 1.0


@dataclass(frozen=True, slots=True)
class PoolRef:
    """The InferencePool the picker serves."""

    namespace: str
    name: str


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What the picker reads of an InferencePool: which pods, and their ports."""

    selector: tuple[tuple[str, str], ...]  # matchLabels, sorted
    target_ports: tuple[int, ...]

    @classmethod
    def of(cls, pool: Mapping[str, Any]) -> PoolSpec:
        """An InferencePool object's spec; ValueError when it has no usable selector or
        port (the API server validates both; this bounds what a bad one can do)."""
        spec = pool.get("spec") or {}
        labels = (spec.get("selector") or {}).get("matchLabels") or {}
        if not isinstance(labels, Mapping) or not labels or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
            raise ValueError("the pool's selector.matchLabels names no labels")
        ports = [p.get("number") for p in spec.get("targetPorts") or ()
                 if isinstance(p, Mapping)]
        numbers = tuple(p for p in ports if isinstance(p, int) and 0 < p < 65536)
        if not numbers or len(numbers) != len(ports):
            raise ValueError("the pool's targetPorts name no port")
        return cls(tuple(sorted(labels.items())), numbers)

    def label_selector(self) -> str:
        """The selector as the API's ``labelSelector`` parameter."""
        return ",".join(f"{k}={v}" for k, v in self.selector)

    def selects(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.selector)


@dataclass(frozen=True, slots=True, order=True)
class PodEndpoint:
    """One of a ready pod's target ports."""

    address: str  # the pod's IP
    port: int
    pod: str  # its name, for the log

    @property
    def name(self) -> str:
        """``ip:port`` (an IPv6 address in brackets): the backend's name and the value the
        picker gives the gateway."""
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.name}"


def pod_endpoints(pod: Mapping[str, Any], spec: PoolSpec) -> tuple[PodEndpoint, ...]:
    """The endpoints of a pod: one per target port while it is selected, ready, not being
    deleted and has an IP; none otherwise."""
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if metadata.get("deletionTimestamp") or not spec.selects(metadata.get("labels") or {}):
        return ()
    ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                for c in status.get("conditions") or () if isinstance(c, Mapping))
    address = status.get("podIP")
    if not ready or not isinstance(address, str):
        return ()
    try:
        ip = str(ipaddress.ip_address(address))
    except ValueError:
        return ()
    return tuple(PodEndpoint(ip, port, str(metadata.get("name", ""))) for port in
                 spec.target_ports)


class PoolMembers:
    """The pool's pods as the list and the watch events tell them, by namespace and name."""

    def __init__(self, spec: PoolSpec) -> None:
        self.spec = spec
        self._pods: dict[str, tuple[PodEndpoint, ...]] = {}

    def listed(self, pods: Iterable[Mapping[str, Any]]) -> None:
        """A full list: what it does not hold is gone."""
        self._pods = {}
        for pod in pods:
            self.apply("ADDED", pod)

    def apply(self, kind: str, pod: Mapping[str, Any]) -> bool:
        """A watch event (``ADDED``, ``MODIFIED``, ``DELETED``); whether the endpoints
        changed."""
        key = str((pod.get("metadata") or {}).get("name", ""))
        before = self._pods.get(key, ())
        after = () if kind == "DELETED" else pod_endpoints(pod, self.spec)
        if after:
            self._pods[key] = after
        else:
            self._pods.pop(key, None)
        return before != after

    def endpoints(self) -> tuple[PodEndpoint, ...]:
        """Every ready endpoint, in a stable order (by address and port)."""
        return tuple(sorted(e for endpoints in self._pods.values() for e in endpoints))


def with_endpoints(config: Config, endpoints: Sequence[PodEndpoint], template: Backend
                   ) -> Config:
    """``config`` whose backends are ``endpoints``, each with ``template``'s settings; its
    own backends when there is no endpoint (a configuration has at least one backend: the
    picker refuses requests while none is ready instead)."""
    if not endpoints:
        return config
    settings = template.model_dump(exclude={"url", "name"})
    # One backend an address, though two pods claim it (an IP given to a new pod before the
    # old one's deletion is seen).
    names = dict.fromkeys(e.name for e in endpoints)
    backends = [Backend.model_validate({**settings, "url": f"http://{name}", "name": name})
                for name in names]
    # The backends are valid one by one and unique by name; model_copy keeps the rest as
    # validated.
    return config.model_copy(update={"backends": backends})


class PoolDiscovery:
    """The watch of one InferencePool and its pods, putting the ready endpoints in force
    as a sidecar's backends; ``ready`` is what the picker may bind to now.

    :meth:`start` begins the watch and returns the configuration to start the sidecar with
    (the pods of the first list, when it comes soon); :meth:`attach` then gives it the
    sidecar, whose backends follow the pods from there."""

    def __init__(self, pool: PoolRef, api: Callable[[], Awaitable[Any]]) -> None:
        """``api``: makes the ``kubernetes_asyncio`` ApiClient (in-cluster, or from a
        kubeconfig file)."""
        self.pool = pool
        self._api_factory = api
        self.sidecar: Sidecar | None = None
        self._template: Backend | None = None
        self._spec: PoolSpec | None = None
        self._spec_changed = asyncio.Event()
        self._members: PoolMembers | None = None
        self._dirty = asyncio.Event()
        self._attached = asyncio.Event()
        self._retry_s = RETRY_S
        self._first_list = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # The backends the picker may bind to: None until the pool and its pods are listed.
        self.ready: frozenset[str] | None = None

    async def start(self, config: Config, wait_s: float) -> Config:
        """Start watching; ``config`` with the pods of the first list as its backends, or
        as it is when the API server has not answered within ``wait_s`` (the pods come
        when it does, and the picker refuses requests until then)."""
        self._template = config.backends[0]
        self._task = asyncio.create_task(self.run(), name="epp-pool")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                await self._first_list.wait()
        return self._with_endpoints(config)

    def attach(self, sidecar: Sidecar) -> None:
        """From now, the endpoints' changes are ``sidecar``'s backends, and a file reload
        keeps them."""
        self.sidecar = sidecar
        sidecar.holder.overlay = self._overlay
        self._attached.set()
        self._dirty.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # -- the backends ---------------------------------------------------------------------------

    def _with_endpoints(self, config: Config) -> Config:
        """``config`` with the ready endpoints as its backends; ``ready`` what it holds."""
        endpoints = self._members.endpoints() if self._members is not None else ()
        if self._first_list.is_set():
            self.ready = frozenset(e.name for e in endpoints)
        assert self._template is not None
        return with_endpoints(config, endpoints, self._template)

    def _overlay(self, read: Config) -> Config:
        """A reloaded file with the backends discovered (its first backend the new
        template); runs in a reload's thread, reading only immutable state."""
        assert self.sidecar is not None
        self._template = read.backends[0]
        discovered = [b for b in self.sidecar.config.backends if b.name in (self.ready or ())]
        return with_endpoints(read, [_endpoint_of(b) for b in discovered], self._template)

    async def _apply_changes(self) -> None:
        """Puts each change of the endpoints in force, one at a time; an endpoint whose name
        still drains is added once it has drained."""
        await self._attached.wait()
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            pending = await self._put_in_force()
            if pending:
                await asyncio.sleep(DRAIN_RETRY_S)
                self._dirty.set()

    async def _put_in_force(self) -> bool:
        """The endpoints now, in force; whether some wait for their name to drain."""
        assert self.sidecar is not None and self._template is not None
        if not self._first_list.is_set():
            return False
        members = self._members
        endpoints = members.endpoints() if members is not None else ()
        config = self.sidecar.config
        in_force = {b.name: b.url for b in config.backends}
        draining = self.sidecar.core.draining
        usable = [e for e in endpoints if e.name in in_force or e.name not in draining]
        new = with_endpoints(config, usable, self._template)
        if {b.name: b.url for b in new.backends} != in_force:
            try:
                changes = await self.sidecar.put_in_force(new, f"InferencePool {self.pool.name}")
            except ReloadRefused as e:  # a template a reload changed: needs a restart
                log.error("the pool's endpoints could not be put in force: %s", e)
                return True
            log.info("InferencePool %s/%s: %s", self.pool.namespace, self.pool.name,
                     changes.summary())
        self.ready = frozenset(e.name for e in usable)
        return len(usable) < len(endpoints)

    # -- the watch ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Watch until cancelled: the applier, and the lists and watches, again after every
        failure."""
        applier = asyncio.create_task(self._apply_changes(), name="epp-pool-apply")
        try:
            while True:
                try:
                    async with _ApiClient(self._api_factory) as api, \
                            asyncio.TaskGroup() as tasks:
                        tasks.create_task(self._follow_pool(api))
                        tasks.create_task(self._follow_pods(api))
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # the API server's errors, the network's, a bad pool
                    log.warning("InferencePool %s/%s: %s; listing again in %.1f s",
                                self.pool.namespace, self.pool.name, _describe(e),
                                self._retry_s)
                await asyncio.sleep(self._retry_s * random.uniform(0.8, 1.2))
                self._retry_s = min(MAX_RETRY_S, self._retry_s * 2)
        finally:
            applier.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await applier

    async def _follow_pool(self, api: Any) -> None:
        from kubernetes_asyncio import client

        objects = client.CustomObjectsApi(api)
        selector = f"metadata.name={self.pool.name}"

        def listing(**kwargs: Any) -> Awaitable[Any]:
            return objects.list_namespaced_custom_object(
                GROUP, VERSION, self.pool.namespace, PLURAL, field_selector=selector,
                **kwargs)

        async for kind, pool in _informer(listing):
            if kind == "LISTED":
                self._retry_s = RETRY_S
                # Listed again (a new round): the pods are listed again too.
                self._set_spec(PoolSpec.of(pool[0]) if pool else None, listed=True)
            else:
                self._set_spec(None if kind == "DELETED" else PoolSpec.of(pool))

    def _set_spec(self, spec: PoolSpec | None, listed: bool = False) -> None:
        if spec is None:
            log.warning("InferencePool %s/%s not found: no endpoint is ready",
                        self.pool.namespace, self.pool.name)
        if listed or spec != self._spec:
            self._spec = spec
            self._spec_changed.set()

    async def _follow_pods(self, api: Any) -> None:
        from kubernetes_asyncio import client

        pods = client.CoreV1Api(api)
        while True:
            await self._spec_changed.wait()
            self._spec_changed.clear()
            spec = self._spec
            if spec is None:
                self._members = None  # no pool: no endpoint
                self._first_list.set()
                self._dirty.set()
                continue

            def listing(spec: PoolSpec = spec, **kwargs: Any) -> Awaitable[Any]:
                return pods.list_namespaced_pod(self.pool.namespace,
                                                label_selector=spec.label_selector(),
                                                **kwargs)

            watching = asyncio.create_task(self._follow_members(listing, spec))
            changed = asyncio.create_task(self._spec_changed.wait())
            try:
                await asyncio.wait({watching, changed}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                changed.cancel()
                watching.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watching  # a watch's own failure is raised here

    async def _follow_members(self, listing: Callable[..., Awaitable[Any]],
                              spec: PoolSpec) -> None:
        members = PoolMembers(spec)
        async for kind, pod in _informer(listing):
            if kind == "LISTED":
                self._retry_s = RETRY_S
                members.listed(pod)
                self._members = members
                self._first_list.set()
                self._dirty.set()
            elif members.apply(kind, pod):
                self._dirty.set()


async def _informer(listing: Callable[..., Awaitable[Any]]
                    ) -> AsyncIterator[tuple[str, Any]]:
    """List, then watch from the list's version: ``("LISTED", items)`` then ``(event type,
    object)``. A watch the server ends, or whose connection breaks, resumes from the last
    version seen (after a back-off when broken); ``410 Gone`` lists again; a failed list, or
    an error status on a watch, is raised."""
    import aiohttp
    from kubernetes_asyncio import watch
    from kubernetes_asyncio.client.exceptions import ApiException

    while True:
        response = await listing(_preload_content=False)
        listed = await response.json()
        response.release()
        version = (listed.get("metadata") or {}).get("resourceVersion")
        yield "LISTED", list(listed.get("items") or ())
        delay = RETRY_S
        while True:
            timeout = int(WATCH_TIMEOUT_S * random.uniform(1.0, 2.0))
            stream = watch.Watch(return_type="object")
            try:
                async with stream:
                    async for event in stream.stream(
                            listing, resource_version=version, allow_watch_bookmarks=True,
                            timeout_seconds=timeout, _request_timeout=(10, timeout + 30)):
                        delay = RETRY_S
                        kind = event["type"]
                        if kind in ("ADDED", "MODIFIED", "DELETED"):
                            yield kind, event["raw_object"]
            except ApiException as e:
                if e.status != 410:
                    raise
                log.info("watch expired (410 Gone): listing again")
                break
            except (aiohttp.ClientError, OSError, TimeoutError) as e:
                log.info("watch cut (%s): resuming in %.1f s", _describe(e), delay)
                await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                delay = min(MAX_RETRY_S, delay * 2)
            finally:
                version = stream.resource_version or version


class _ApiClient:
    """The API client for one round of lists and watches, closed at its end."""

    def __init__(self, factory: Callable[[], Awaitable[Any]]) -> None:
        self._factory = factory
        self._api: Any = None

    async def __aenter__(self) -> Any:
        self._api = await self._factory()
        return self._api

    async def __aexit__(self, *_exc: object) -> None:
        await self._api.close()


def _endpoint_of(backend: Backend) -> PodEndpoint:
    host, _, port = backend.name.rpartition(":")
    return PodEndpoint(host.strip("[]"), int(port), "")


def _describe(error: BaseException) -> str:
    """An error for the log: an API error's status and reason, never a header."""
    if isinstance(error, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in error.exceptions)
    status = getattr(error, "status", None)
    if status is not None:
        return f"HTTP {status} {getattr(error, 'reason', '')}".strip()
    return f"{type(error).__name__}: {error}"


async def api_client(kubeconfig: str | None) -> Any:
    """A ``kubernetes_asyncio`` ApiClient: the pod's service account in a cluster, else the
    kubeconfig file (``None``: ``$KUBECONFIG`` or ``~/.kube/config``)."""
    from kubernetes_asyncio import client, config

    configuration = client.Configuration()
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=configuration)
    else:
        await config.load_kube_config(config_file=kubeconfig,
                                      client_configuration=configuration)
    return client.ApiClient(configuration)
