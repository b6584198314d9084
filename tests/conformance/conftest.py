"""One conformance suite, two backends: the emulator and the real vLLM CPU build.

Both are started once per session with the same small engine shape, so that queueing
happens with a handful of requests. The real-vLLM backend carries the ``vllm`` marker; when
vLLM cannot start, its tests fail (never skip).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conformance import backends
from tests.conformance.backends import Backend, real_vllm


@pytest.fixture(scope="session")
def emulator_backend() -> Iterator[Backend]:
    with backends.emulator_backend() as backend:
        yield backend


@pytest.fixture(scope="session")
def vllm_backend() -> Iterator[Backend]:
    with real_vllm() as server:
        yield Backend("vllm", server.url, server.model_name)


@pytest.fixture(params=["emulator", pytest.param("vllm", marks=pytest.mark.vllm)])
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue(f"{request.param}_backend")
