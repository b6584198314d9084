"""A Kubernetes API server on loopback for the picker's pod discovery: the two resources the
picker reads (pods, and the InferencePool custom resource) served with the API's list and
watch protocol, as a real API server speaks it to a client such as ``kubernetes_asyncio``:

- a list answers the items matching ``labelSelector`` / ``fieldSelector`` (equality terms)
  and the collection's ``resourceVersion``;
- a watch (``watch=true``) streams one JSON event a line, ``ADDED`` / ``MODIFIED`` /
  ``DELETED`` with the object at its new version, from the ``resourceVersion`` asked for;
  an object that stops matching the selector is ``DELETED`` to that watch, one that starts
  matching ``ADDED`` (the watch cache's rule); ``BOOKMARK`` events carry the latest version
  when ``allowWatchBookmarks`` is set; the server ends the watch after ``timeoutSeconds``;
- a watch from a version older than the history kept (``compact``) gets an ``ERROR`` event
  whose Status is ``410 Expired``, as etcd's compaction gives;
- every request needs the kubeconfig's bearer token (401 otherwise).

The tests change the cluster through :meth:`KubeApi.apply` and :meth:`KubeApi.delete`, and
break it through :meth:`KubeApi.compact` and :meth:`KubeApi.drop_watches`. The server runs
on its own event loop in a thread of the test process."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import secrets
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import yaml
from aiohttp import web

from weighbridge.launch import free_port

POD = "pods"
POOL = "inferencepools"
_PATHS = {
    POD: "/api/v1/namespaces/{namespace}/pods",
    POOL: "/apis/inference.networking.k8s.io/v1/namespaces/{namespace}/inferencepools",
}
_LIST_KINDS = {POD: ("v1", "PodList"), POOL: ("inference.networking.k8s.io/v1",
                                               "InferencePoolList")}
BOOKMARK_S = 0.5


@dataclass
class _Event:
    version: int
    kind: str  # the resource
    type: str  # ADDED, MODIFIED, DELETED
    old: dict[str, Any] | None
    new: dict[str, Any]


@dataclass(eq=False)
class _Watch:
    resource: str
    namespace: str
    matches: Any  # Callable[[dict], bool]
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    response: web.StreamResponse | None = None


class KubeApi:
    """The API server; a context manager that serves on ``url`` from a thread."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(16)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._history: list[_Event] = []
        self._version = itertools.count(100)
        self._current = 99
        self._compacted = 0  # watches from before this version get 410
        self._watches: set[_Watch] = set()
        self.lists: dict[str, int] = {POD: 0, POOL: 0}
        self.watches: dict[str, int] = {POD: 0, POOL: 0}
        self.expired = 0  # watches answered 410
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    # -- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> KubeApi:
        self._thread.start()
        self._call(self._start())
        return self

    def __exit__(self, *_exc: object) -> None:
        self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(10)

    async def _start(self) -> None:
        app = web.Application()
        for resource, path in _PATHS.items():
            app.router.add_get(path, functools.partial(self._serve, resource=resource))
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None,
                                     shutdown_timeout=0.5)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _stop(self) -> None:
        await self._drop()
        assert self._runner is not None
        await self._runner.cleanup()

    def kubeconfig(self, directory: Path) -> Path:
        path = directory / "kubeconfig"
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": self.url}}],
            "users": [{"name": "picker", "user": {"token": self.token}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "picker"}}],
        }))
        return path

    # -- the cluster, as the tests change it ----------------------------------------------

    def apply(self, resource: str, obj: Mapping[str, Any]) -> None:
        """Create or replace an object (``ADDED`` or ``MODIFIED``)."""
        self._call(self._record(resource, dict(obj), deleted=False))

    def delete(self, resource: str, namespace: str, name: str) -> None:
        obj = self._objects.get((resource, namespace, name))
        assert obj is not None, (resource, namespace, name)
        self._call(self._record(resource, obj, deleted=True))

    def compact(self) -> None:
        """Forget the history: a watch resumed from any version seen so far gets 410."""
        self._call(self._compact())

    def drop_watches(self) -> None:
        """Cut every open watch's connection, as an API server restart does."""
        self._call(self._drop())

    async def _record(self, resource: str, obj: dict[str, Any], deleted: bool) -> None:
        metadata = obj["metadata"]
        key = (resource, metadata.get("namespace", "default"), metadata["name"])
        old = self._objects.get(key)
        version = next(self._version)
        new = {**obj, "metadata": {**metadata, "namespace": key[1],
                                   "resourceVersion": str(version)}}
        if deleted:
            self._objects.pop(key, None)
            kind = "DELETED"
        else:
            self._objects[key] = new
            kind = "MODIFIED" if old is not None else "ADDED"
        self._current = version
        self._history.append(_Event(version, resource, kind, old, new))
        for watch in self._watches:
            watch.wake.set()

    async def _compact(self) -> None:
        # The store moves on a version: a list from now is current, and no watch from a
        # version seen before can resume.
        self._current = self._compacted = next(self._version)
        self._history.clear()

    async def _drop(self) -> None:
        for watch in list(self._watches):
            if watch.response is not None and watch.response.task is not None:
                watch.response.task.cancel()  # the handler's task: its connection closes
        self._watches.clear()

    # -- the protocol ---------------------------------------------------------------------

    async def _serve(self, request: web.Request, resource: str) -> web.StreamResponse:
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return _status(401, "Unauthorized", "Unauthorized")
        namespace = request.match_info["namespace"]
        query = request.query
        try:
            matches = _selector(query.get("labelSelector", ""), query.get("fieldSelector", ""))
        except ValueError as e:
            return _status(400, "BadRequest", str(e))
        if query.get("watch") in ("true", "1", "True"):
            return await self._watch(request, resource, namespace, matches)
        self.lists[resource] += 1
        api_version, kind = _LIST_KINDS[resource]
        items = [obj for (r, ns, _), obj in sorted(self._objects.items())
                 if r == resource and ns == namespace and matches(obj)]
        return web.Response(body=orjson.dumps({
            "apiVersion": api_version, "kind": kind,
            "metadata": {"resourceVersion": str(self._current)}, "items": items}),
            content_type="application/json")

    async def _watch(self, request: web.Request, resource: str, namespace: str,
                     matches: Any) -> web.StreamResponse:
        self.watches[resource] += 1
        query = request.query
        since = int(query.get("resourceVersion") or self._current)
        timeout = float(query.get("timeoutSeconds") or 1800)
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1", "True")
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        if since < self._compacted:
            self.expired += 1
            await _send(response, {"type": "ERROR", "object": {
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": f"too old resource version: {since} ({self._compacted})",
                "reason": "Expired", "code": 410}})
            return response
        watch = _Watch(resource, namespace, matches, response=response)
        self._watches.add(watch)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        with contextlib.suppress(ConnectionResetError):  # the client left
            await self._stream(watch, since, deadline, bookmarks)
        return response

    async def _stream(self, watch: _Watch, since: int, deadline: float, bookmarks: bool
                      ) -> None:
        resource, namespace, matches = watch.resource, watch.namespace, watch.matches
        response = watch.response
        assert response is not None
        loop = asyncio.get_running_loop()
        try:
            while loop.time() < deadline:
                for event in [e for e in self._history if e.version > since]:
                    since = event.version
                    shown = _as_seen(event, resource, namespace, matches)
                    if shown is not None:
                        await _send(response, shown)
                watch.wake.clear()
                try:
                    async with asyncio.timeout(min(BOOKMARK_S, deadline - loop.time())):
                        await watch.wake.wait()
                except TimeoutError:
                    if bookmarks:
                        since = max(since, self._current)
                        await _send(response, {"type": "BOOKMARK", "object": {
                            "kind": "Pod" if resource == POD else "InferencePool",
                            "apiVersion": _LIST_KINDS[resource][0],
                            "metadata": {"resourceVersion": str(since)}}})
        finally:
            self._watches.discard(watch)


def _as_seen(event: _Event, resource: str, namespace: str, matches: Any
             ) -> dict[str, Any] | None:
    """The event as a watch with this filter sees it, or None."""
    if event.kind != resource or event.new["metadata"]["namespace"] != namespace:
        return None
    was = event.old is not None and matches(event.old)
    now = event.type != "DELETED" and matches(event.new)
    if event.type == "DELETED":
        return {"type": "DELETED", "object": event.new} if was else None
    if now:
        return {"type": "MODIFIED" if was else "ADDED", "object": event.new}
    return {"type": "DELETED", "object": event.new} if was else None


def _selector(labels: str, fields: str) -> Any:
    """Equality terms of a label and a field selector (``k=v,k2=v2``; ``==`` too)."""
    def terms(text: str) -> Iterator[tuple[str, str]]:
        for term in filter(None, (t.strip() for t in text.split(","))):
            key, sep, value = term.replace("==", "=").partition("=")
            if not sep or "!" in key:
                raise ValueError(f"unsupported selector term {term!r}")
            yield key.strip(), value.strip()

    wanted_labels = dict(terms(labels))
    wanted_fields = dict(terms(fields))

    def matches(obj: dict[str, Any]) -> bool:
        metadata = obj.get("metadata", {})
        have = metadata.get("labels") or {}
        if any(have.get(k) != v for k, v in wanted_labels.items()):
            return False
        fields_of = {"metadata.name": metadata.get("name"),
                     "metadata.namespace": metadata.get("namespace")}
        return all(fields_of.get(k) == v for k, v in wanted_fields.items())

    return matches


async def _send(response: web.StreamResponse, event: dict[str, Any]) -> None:
    await response.write(orjson.dumps(event) + b"\n")


def _status(code: int, reason: str, message: str) -> web.Response:
    return web.Response(status=code, content_type="application/json", body=orjson.dumps({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code}))


def pod(name: str, ip: str | None, labels: Mapping[str, str], *, ready: bool = True,
        deleting: bool = False, namespace: str = "default") -> dict[str, Any]:
    """A pod as the API shows it: its labels, its IP, its Ready condition."""
    metadata: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(labels)}
    if deleting:
        metadata["deletionTimestamp"] = "2026-12-07T00:00:00Z"
    status: dict[str, Any] = {"phase": "Running", "conditions": [
        {"type": "PodScheduled", "status": "True"},
        {"type": "Ready", "status": "True" if ready else "False"}]}
    if ip is not None:
        status["podIP"] = ip
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata,
            "spec": {"containers": [{"name": "vllm", "image": "vllm"}]}, "status": status}


def inference_pool(name: str, labels: Mapping[str, str], port: int,
                   namespace: str = "default") -> dict[str, Any]:
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"selector": {"matchLabels": dict(labels)},
                     "targetPorts": [{"number": port}],
                     "endpointPickerRef": {"name": "weighbridge-epp", "portNumber": 9002}}}
