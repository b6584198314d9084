"""Headless Chromium driven over the DevTools protocol, for the report's browser test: open a
page as a person would (a 1400x900 window), see what it logged and fetched, ask the page
questions in JavaScript, click and hover with the real mouse events, take a screenshot.

Chromium is the Debian ``chromium`` package (.ci/run installs it); the protocol runs over
the websocket Chromium opens on loopback, with aiohttp's client (a project dependency).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import re
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
         "--remote-debugging-port=0")
LISTENING = re.compile(r"DevTools listening on (ws://\S+)")
STEP_TIMEOUT_S = 60.0  # any one protocol answer; generous for a loaded 2-core machine


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail("headless Chromium is missing: apt-get install -y chromium")
    return found


@dataclass
class Page:
    ws: aiohttp.ClientWebSocketResponse
    session: str
    console_errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)  # every URL the page asked for
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    _waiting: dict[int, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)
    _loaded: asyncio.Event = field(default_factory=asyncio.Event)

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        n = next(self._ids)
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[n] = answer
        message = {"id": n, "method": method, "params": params}
        if self.session:  # else a command to the browser itself
            message["sessionId"] = self.session
        await self.ws.send_str(json.dumps(message))
        reply = await asyncio.wait_for(answer, STEP_TIMEOUT_S)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return dict(reply.get("result", {}))

    def _event(self, message: dict[str, Any]) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            self.console_errors.append(" ".join(str(a.get("value", a.get("description")))
                                                for a in params["args"]))
        elif method == "Runtime.exceptionThrown":
            self.console_errors.append(params["exceptionDetails"].get("text", "exception"))
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            self.console_errors.append(params["entry"]["text"])
        elif method == "Network.requestWillBeSent":
            self.requests.append(params["request"]["url"])
        elif method == "Page.loadEventFired":
            self._loaded.set()

    async def _read(self) -> None:
        async for msg in self.ws:
            message = json.loads(msg.data)
            if "id" in message and message["id"] in self._waiting:
                self._waiting.pop(message["id"]).set_result(message)
            elif message.get("sessionId") == self.session:
                self._event(message)

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression (awaited when it is a promise)."""
        result = await self.send("Runtime.evaluate", expression=expression,
                                 awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}...: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def navigate(self, url: str) -> None:
        self._loaded.clear()
        await self.send("Page.navigate", url=url)
        await asyncio.wait_for(self._loaded.wait(), STEP_TIMEOUT_S)

    async def click(self, x: float, y: float) -> None:
        for kind in ("mousePressed", "mouseReleased"):
            await self.send("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left",
                            clickCount=1)

    async def hover(self, x: float, y: float) -> None:
        await self.send("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)

    async def screenshot(self, path: Path) -> None:
        shot = await self.send("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(shot["data"]))


@contextlib.asynccontextmanager
async def open_page(profile: Path, width: int = 1400, height: int = 900
                    ) -> AsyncIterator[Page]:
    """A fresh Chromium (its own profile directory) with one blank tab of ``width`` x
    ``height``; closed, and its process ended, on the way out."""
    proc = await asyncio.create_subprocess_exec(
        chromium(), *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
        "about:blank", stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    assert proc.stderr is not None
    drain: asyncio.Task[None] | None = None
    try:
        url = None
        while url is None:  # Chromium says where it listens on its first lines
            line = await asyncio.wait_for(proc.stderr.readline(), STEP_TIMEOUT_S)
            if not line:
                raise RuntimeError("chromium exited before it listened")
            found = LISTENING.search(line.decode(errors="replace"))
            url = found.group(1) if found else None

        async def discard() -> None:  # a full stderr pipe would stall Chromium
            while await proc.stderr.readline():  # type: ignore[union-attr]
                pass

        drain = asyncio.create_task(discard())
        async with aiohttp.ClientSession() as http, http.ws_connect(url, max_msg_size=0) as ws:
            page = Page(ws, session="")
            reader = asyncio.create_task(page._read())
            target = await page.send("Target.createTarget", url="about:blank")
            attached = await page.send("Target.attachToTarget", targetId=target["targetId"],
                                       flatten=True)
            page.session = attached["sessionId"]
            for domain in ("Runtime", "Log", "Network", "Page"):
                await page.send(f"{domain}.enable")
            await page.send("Emulation.setDeviceMetricsOverride", width=width, height=height,
                            deviceScaleFactor=1, mobile=False)
            try:
                yield page
            finally:
                reader.cancel()
    finally:
        if proc.returncode is None:
            proc.terminate()
            await proc.wait()
        if drain is not None:
            drain.cancel()
