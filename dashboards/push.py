"""Upload the dashboard JSON files to a Grafana instance over its HTTP API (grafana-client).

All dashboards go into one folder (created when missing), overwriting earlier versions with
the same uid, so pushing again after ``weighbridge dashboards generate`` updates them in
place. The dashboards pick their Prometheus through the ``datasource`` variable, so nothing
in them names the target instance's data sources.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from grafana_client import GrafanaApi
from grafana_client.client import GrafanaClientError, GrafanaException

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


def connect(url: str, token: str, timeout_s: float = 10.0) -> GrafanaApi:
    """A client for the Grafana at ``url`` authenticating with a service-account token."""
    if not token:
        raise PushError("token: a Grafana service-account token is required")
    return GrafanaApi.from_url(url, credential=token, timeout=timeout_s)


def push(api: GrafanaApi, dashboards: Iterable[Mapping[str, Any]],
         folder_uid: str = FOLDER_UID, folder_title: str = FOLDER_TITLE) -> list[Pushed]:
    """Create ``folder_uid`` if missing and save every dashboard into it (overwrite)."""
    try:
        try:
            api.folder.get_folder(folder_uid)
        except GrafanaClientError as exc:
            if exc.status_code != 404:
                raise
            api.folder.create_folder(folder_title, uid=folder_uid)
        pushed = []
        for dashboard in dashboards:
            # id identifies a dashboard within one Grafana database; the uid is portable.
            body = {"dashboard": {**dashboard, "id": None}, "folderUid": folder_uid,
                    "overwrite": True, "message": "weighbridge dashboards push"}
            answer = api.dashboard.update_dashboard(body)
            pushed.append(Pushed(str(dashboard["uid"]), str(dashboard.get("title", "")),
                                 str(answer.get("url", ""))))
        return pushed
    except GrafanaException as exc:
        raise PushError(f"Grafana at {api.client.url}: {exc.message}") from exc
