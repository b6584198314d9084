"""``weighbridge dashboards push`` against a stand-in Grafana HTTP API on loopback: the
requests push sends (token, folder, every dashboard saved with overwrite), and a
refused token failing with Grafana's message.

No Grafana server can run here (no package, no Docker), so the stand-in answers the three
endpoints push uses as Grafana 10 documents them: GET /api/folders/:uid, POST /api/folders,
POST /api/dashboards/db.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from typer.testing import CliRunner

from weighbridge.app.cli import app
from weighbridge.dashboards.generate import DASHBOARDS

TOKEN = "glsa_test-token"


@dataclass
class FakeGrafana:
    url: str
    requests: list[tuple[str, str, dict[str, Any] | None, str]] = field(default_factory=list)
    folders: set[str] = field(default_factory=set)


@pytest.fixture
def grafana() -> Iterator[FakeGrafana]:
    state = FakeGrafana(url="")

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _record(self) -> dict[str, Any] | None:
            length = int(self.headers.get("content-length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            state.requests.append((self.command, self.path, body,
                                   self.headers.get("authorization", "")))
            return body

        def do_GET(self) -> None:
            self._record()
            if self.headers.get("authorization") != f"Bearer {TOKEN}":
                return self._answer(401, {"message": "invalid API key"})
            uid = self.path.removeprefix("/api/folders/")
            if uid in state.folders:
                return self._answer(200, {"uid": uid, "title": uid})
            return self._answer(404, {"message": "folder not found"})

        def do_POST(self) -> None:
            body = self._record() or {}
            if self.path == "/api/folders":
                state.folders.add(body["uid"])
                return self._answer(200, {"uid": body["uid"], "title": body["title"]})
            if self.path == "/api/dashboards/db":
                uid = body["dashboard"]["uid"]
                return self._answer(200, {"status": "success", "uid": uid,
                                          "url": f"/d/{uid}/x", "version": 1})
            return self._answer(404, {"message": "not found"})

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield state
    server.shutdown()
    server.server_close()


def test_push_creates_the_folder_and_saves_every_dashboard(grafana: FakeGrafana) -> None:
    result = CliRunner().invoke(app, ["dashboards", "push", "--url", grafana.url,
                                      "--token", TOKEN])
    assert result.exit_code == 0, result.output
    assert all(auth == f"Bearer {TOKEN}" for *_, auth in grafana.requests)
    calls = [(method, path) for method, path, *_ in grafana.requests]
    assert calls[:2] == [("GET", "/api/folders/weighbridge"), ("POST", "/api/folders")]
    saved = [body for method, path, body, _ in grafana.requests
             if path == "/api/dashboards/db"]
    assert sorted(b["dashboard"]["uid"] for b in saved) == sorted(d.uid for d in DASHBOARDS)
    for body in saved:
        assert body["overwrite"] is True
        assert body["folderUid"] == "weighbridge"
        assert body["dashboard"]["id"] is None
        assert body["dashboard"]["panels"]
    for dashboard in DASHBOARDS:
        assert f"{grafana.url}/d/{dashboard.uid}/x" in result.output

    # A second push finds the folder and overwrites the same uids.
    grafana.requests.clear()
    result = CliRunner().invoke(app, ["dashboards", "push", "--url", grafana.url,
                                      "--token", TOKEN])
    assert result.exit_code == 0, result.output
    assert ("POST", "/api/folders") not in [(m, p) for m, p, *_ in grafana.requests]


def test_push_with_a_bad_token_fails_with_grafanas_answer(grafana: FakeGrafana) -> None:
    result = CliRunner().invoke(app, ["dashboards", "push", "--url", grafana.url,
                                      "--token", "wrong"])
    assert result.exit_code == 2
    assert "Unauthorized" in result.output
    assert not [p for _, p, *_ in grafana.requests if p == "/api/dashboards/db"]


def test_push_takes_the_token_from_the_environment(grafana: FakeGrafana) -> None:
    result = CliRunner().invoke(app, ["dashboards", "push", "--url", grafana.url],
                                env={"GRAFANA_TOKEN": TOKEN})
    assert result.exit_code == 0, result.output
