"""The security tests use the sidecar suite's process fixtures and helpers."""

from tests.integration.sidecar.conftest import processes  # noqa: F401
