"""Upload the dashboard JSON files to a Grafana instance over its HTTP API.

All dashboards go into one folder (created when missing), overwriting earlier versions with
the same uid, so pushing again after ``weighbridge dashboards generate`` updates them in
place. The dashboards pick their Prometheus through the ``datasource`` variable, so nothing
in them names the target instance's data sources.

The client is httpx, already a dependency of the base, speaking the three endpoints of
Grafana's HTTP API that a push needs. grafana-client, used before, pulls niquests and with
it urllib3-future, which installs its files over urllib3's and breaks requests-based tools
in the same environment (docs/dashboards.md, "Pushing").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

__all__ = ["FOLDER_TITLE", "FOLDER_UID", "PushError", "Pushed", "connect", "push"]

FOLDER_UID = "weighbridge"
FOLDER_TITLE = "weighbridge"


class PushError(RuntimeError):
    """Grafana refused a request; the message says which and why."""


@dataclass(frozen=True)
class Pushed:
    uid: str
    title: str
    url: str  # as Grafana reports it, relative to its root


def connect(url: str, token: str, timeout_s: float = 10.0) -> httpx.Client:
    """A client for the Grafana at ``url`` authenticating with a service-account token."""
    if not token:
        raise PushError("token: a Grafana service-account token is required")
    return httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s,
                        headers={"authorization": f"Bearer {token}",
                                 "accept": "application/json"})


def _refused(response: httpx.Response) -> PushError:
    """Grafana's own words: the status, its reason and the body's ``message``."""
    try:
        message = str(response.json().get("message", ""))
    except ValueError:
        message = response.text[:200]
    request = response.request
    return PushError(f"Grafana at {request.url.scheme}://{request.url.netloc.decode()}: "
                     f"{request.method} {request.url.path}: {response.status_code} "
                     f"{response.reason_phrase}: {message}")


def push(client: httpx.Client, dashboards: Iterable[Mapping[str, Any]],
         folder_uid: str = FOLDER_UID, folder_title: str = FOLDER_TITLE) -> list[Pushed]:
    """Create ``folder_uid`` if missing and save every dashboard into it (overwrite)."""
    try:
        with client:
            found = client.get(f"/api/folders/{folder_uid}")
            if found.status_code == 404:
                created = client.post("/api/folders",
                                      json={"uid": folder_uid, "title": folder_title})
                if created.is_error:
                    raise _refused(created)
            elif found.is_error:
                raise _refused(found)
            pushed = []
            for dashboard in dashboards:
                # id identifies a dashboard within one Grafana database; the uid is portable.
                body = {"dashboard": {**dashboard, "id": None}, "folderUid": folder_uid,
                        "overwrite": True, "message": "weighbridge dashboards push"}
                saved = client.post("/api/dashboards/db", json=body)
                if saved.is_error:
                    raise _refused(saved)
                pushed.append(Pushed(str(dashboard["uid"]), str(dashboard.get("title", "")),
                                     str(saved.json().get("url", ""))))
            return pushed
    except httpx.HTTPError as exc:
        raise PushError(f"Grafana at {client.base_url}: {exc}") from exc
