"""The sidecar's live view of its backends: a metrics poller, a health prober and a model
reader (/v1/models) each.

The loops belong to :class:`BackendPool`, which the application starts on startup and
cancels on shutdown; they only fetch and hand what they learn to the scheduling core, then
ask the dispatcher to look again (a fresh scrape, a recovered backend or a newly served model
may open a gate). Every fetch goes through the relay's own client (sidecar.upstream), each
within its deadline: a probe ``health_probe.timeout_ms``, a model list
``model_discovery.timeout_ms``, a scrape two poll periods.

A reload (sidecar.reload) adds and removes backends while the pool runs (``reconfigure``):
an added backend takes no work until one scrape of its /metrics has been read (its shape
begins to be learned: KV cache, block size) and one probe has answered; a removed one keeps
its loops while the core drains it, and is forgotten at the first probe after the core has.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import orjson

from weighbridge.sidecar.config import Backend, Config
from weighbridge.sidecar.core import SchedulingCore
from weighbridge.sidecar.upstream import Upstream, UpstreamConnectError, UpstreamError
from weighbridge.vllm_metrics import BackendSample, ScrapeError, parse_vllm_metrics

log = logging.getLogger("weighbridge.sidecar")


@dataclass(slots=True)
class BackendState:
    """What the pool knows about one backend beyond the core's view."""

    config: Backend
    healthy: bool = True
    last_sample: BackendSample | None = None
    scrape_errors: int = 0
    probe_failures: int = 0


class BackendPool:
    def __init__(self, config: Config, core: SchedulingCore, upstream: Upstream,
                 on_change: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic,
                 on_sample: Callable[[str, BackendSample], None] | None = None) -> None:
        """``on_change``: something that may open a gate happened; ``on_sample``: a
        successful scrape (besides the core, which always gets it). Scrapes, probes and model
        lists go through ``upstream``, the relay's own client."""
        self.config = config
        self.core = core
        self.upstream = upstream
        self.on_change = on_change
        self.on_sample = on_sample
        self.clock = clock
        self.states = {b.name: BackendState(b) for b in config.backends}
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}  # each backend's loops

    def url(self, backend: str, path: str) -> str:
        return self.states[backend].config.url + path

    def any_healthy(self) -> bool:
        return any(s.healthy for s in self.states.values())

    async def start(self) -> None:
        # One probe before serving, so a backend that is down at start-up is not tried first
        # (no threshold here: nothing has been heard from it yet).
        await asyncio.gather(*(self._probe(s, threshold=1) for s in self.states.values()),
                             *(self._discover(s) for s in self.states.values()))
        for state in self.states.values():
            self._start_loops(state)

    def _start_loops(self, state: BackendState) -> None:
        name = state.config.name
        self._tasks.setdefault(name, []).extend((
            asyncio.create_task(self._discover_models(state), name=f"models:{name}"),
            asyncio.create_task(self._poll_metrics(state), name=f"metrics:{name}"),
            asyncio.create_task(self._probe_health(state), name=f"health:{name}")))

    async def stop(self) -> None:
        tasks = [task for loops in self._tasks.values() for task in loops]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    # -- reload -------------------------------------------------------------------------------

    def reconfigure(self, config: Config) -> None:
        """The core has taken ``config`` (``SchedulingCore.reconfigure``): join its new
        backends, and forget the removed ones the core has already forgotten."""
        self.config = config
        for backend in config.backends:
            if backend.name not in self.states:
                state = self.states[backend.name] = BackendState(backend, healthy=False)
                self._tasks[backend.name] = [asyncio.create_task(
                    self._join(state), name=f"join:{backend.name}")]
        for name in [n for n in self.states if not self.core.has_backend(n)]:
            self._forget(name)

    async def _join(self, state: BackendState) -> None:
        """An added backend: scraped until a scrape is read, its models read, probed once
        (the probe marks it healthy), then polled as every backend is."""
        while state.last_sample is None:
            started = self.clock()
            await self._scrape(state)
            if state.last_sample is None:
                poll = self.core.poll_period_s(state.config.name)
                await asyncio.sleep(max(0.0, poll - (self.clock() - started)))
        await self._discover(state)
        await self._probe(state, threshold=1)
        self._start_loops(state)

    def _forget(self, name: str) -> None:
        """A drained backend leaves: its loops end (but the caller's own) and its state goes."""
        current = asyncio.current_task()
        for task in self._tasks.pop(name, ()):
            if task is not current:
                task.cancel()
        self.states.pop(name, None)
        log.info("backend %s drained and forgotten", name)

    # -- health -------------------------------------------------------------------------------

    def mark_failed(self, backend: str, why: str) -> None:
        """A request to the backend failed: stop routing to it until a probe succeeds."""
        state = self.states.get(backend)
        if state is None:
            return  # removed by a reload and drained since
        if state.healthy:
            log.warning("backend %s marked unhealthy: %s", backend, why)
        state.healthy = False
        self.core.mark_backend_unhealthy(backend)

    async def _probe(self, state: BackendState, threshold: int | None = None) -> None:
        """One probe; a failure marks the backend unhealthy once ``threshold`` (by default
        the config's ``unhealthy_threshold``) probes in a row have failed."""
        probe = self.config.health_probe
        if threshold is None:
            threshold = probe.unhealthy_threshold
        url = state.config.url + probe.path
        try:
            status, _ = await self.upstream.get(url, probe.timeout_ms / 1000)
            ok = status == 200
        except (TimeoutError, UpstreamError, UpstreamConnectError, OSError):
            ok = False
        if ok:
            state.probe_failures = 0
            if not state.healthy:
                log.warning("backend %s healthy again", state.config.name)
                state.healthy = True
                self.core.mark_backend_healthy(state.config.name)
                self.on_change()
        else:
            state.probe_failures += 1
            if state.healthy and state.probe_failures >= threshold:
                # The path, not the URL: a URL's user:password is never logged.
                self.mark_failed(state.config.name,
                                 f"{state.probe_failures} health probes of {probe.path} failed")

    async def _probe_health(self, state: BackendState) -> None:
        interval = self.config.health_probe.interval_ms / 1000
        while True:
            await asyncio.sleep(interval)
            if not self.core.has_backend(state.config.name):
                self._forget(state.config.name)  # removed by a reload, and drained
                return
            await self._probe(state)

    # -- models -------------------------------------------------------------------------------

    async def _discover(self, state: BackendState) -> None:
        """Read what the backend serves (base models and adapters) into the core's catalog.
        A failure changes nothing: the last list stays, or the backend stays unknown (taken
        to serve every model, sidecar.catalog)."""
        if state.config.models is not None:
            return  # declared in the config
        discovery = self.config.model_discovery
        try:
            models = [str(card["id"]) for card in await self.models_of(
                state.config.name, discovery.timeout_ms / 1000)]
        except (TimeoutError, UpstreamError, UpstreamConnectError, OSError, ScrapeError,
                ValueError, KeyError, TypeError) as e:
            log.debug("/v1/models of %s failed: %s", state.config.name, e)
            return
        if self.core.on_backend_models(state.config.name, models):
            log.info("backend %s serves %s", state.config.name, ", ".join(models) or "nothing")
            self.on_change()

    async def models_of(self, backend: str, timeout_s: float) -> list[Any]:
        """The model cards of ``backend``'s /v1/models (its ``data``). Raises what
        :meth:`Upstream.get` raises, :class:`ScrapeError` for an answer other than 200, and
        ValueError, KeyError or TypeError for a body that is not a model list."""
        status, body = await self.upstream.get(self.url(backend, "/v1/models"), timeout_s)
        if status != 200:
            raise ScrapeError(f"status {status}")
        data = orjson.loads(body)["data"]
        if not isinstance(data, list):
            raise TypeError(f"data is {type(data).__name__}, not a list")
        return data

    async def _discover_models(self, state: BackendState) -> None:
        interval = self.config.model_discovery.interval_ms / 1000
        while True:
            await asyncio.sleep(interval)
            await self._discover(state)

    # -- metrics ------------------------------------------------------------------------------

    async def _scrape(self, state: BackendState) -> None:
        poll = self.core.poll_period_s(state.config.name)
        sent = self.clock()  # dispatches after this instant are certainly not in the sample
        text = await self._scrape_text(state, poll)
        if text is None:
            return
        try:
            sample = replace(parse_vllm_metrics(text, sent), scrape_s=self.clock() - sent)
        except ScrapeError as e:
            state.scrape_errors += 1
            log.debug("scrape of %s failed: %s", state.config.name, e)
            return
        self._sampled(state, sample)

    async def _scrape_text(self, state: BackendState, poll: float) -> str | None:
        """The text of a backend's /metrics, or None after counting the failure."""
        try:
            status, body = await self.upstream.get(state.config.url + "/metrics", poll * 2)
            if status != 200:
                raise ScrapeError(f"status {status}")
            # UTF-8 as the exposition format says: no charset sniffing per scrape.
            return body.decode()
        except (TimeoutError, UpstreamError, UpstreamConnectError, OSError, ScrapeError,
                UnicodeDecodeError) as e:
            # No call into the core: the last sample goes stale and the fallback cap applies.
            state.scrape_errors += 1
            log.debug("scrape of %s failed: %s", state.config.name, e)
            return None

    def _sampled(self, state: BackendState, sample: BackendSample) -> None:
        state.last_sample = sample
        self.core.on_backend_metrics(state.config.name, sample)
        if self.on_sample is not None:
            self.on_sample(state.config.name, sample)

    async def _poll_metrics(self, state: BackendState) -> None:
        while True:
            started = self.clock()
            await self._scrape(state)
            self.on_change()
            # Derived from the engine's step time once known (GateLimits.poll_s).
            poll = self.core.poll_period_s(state.config.name)
            await asyncio.sleep(max(0.0, poll - (self.clock() - started)))
