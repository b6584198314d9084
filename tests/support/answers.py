"""What a served or a rejected answer of the sidecar must look like."""

from __future__ import annotations

from typing import Any

import httpx


def assert_rejected(response: httpx.Response, status: int, reason: str) -> dict[str, Any]:
    """An OpenAI error body and the reject-reason header; returns the error object."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["x-weighbridge-reject-reason"] == reason
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"}, error
    assert error["code"] == reason
    assert isinstance(error["message"], str) and error["message"]
    return error


def assert_served(response: httpx.Response, tenant_name: str, backend: str | None = None
                  ) -> None:
    assert response.status_code == 200, (response.status_code, response.text)
    assert response.headers["x-weighbridge-tenant"] == tenant_name
    assert float(response.headers["x-weighbridge-queue-ms"]) >= 0
    if backend is not None:
        assert response.headers["x-weighbridge-backend"] == backend
    else:
        assert response.headers["x-weighbridge-backend"]
