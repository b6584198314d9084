"""One conformance suite, two backends: the emulator and the real vLLM CPU build.

Both are started once per session with the same small engine shape, so that queueing
happens with a handful of requests. The real-vLLM backend carries the ``vllm`` marker; when
vLLM cannot start, its tests fail (never skip).

A real vLLM start-up costs 30-60 s, so a server serves every module whose flags it can:
the default pair serves test_conformance.py, test_output_budget.py and, with
``--enable-prompt-tokens-details`` (which only adds a field to the usage), real vLLM's side
of test_prefix_cache.py (whose tests hold whatever earlier requests cached); the flagged pair
(``backends.SERVER_STREAM_INTERVAL``) serves LoRA, the prefix cache off and
``--stream-interval``. Pooling is a runner of its own: ``--convert embed`` serves
test_embeddings.py and test_pooling.py, ``--convert classify`` the latter's /classify.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conformance import backends
from tests.conformance.adapter import ADAPTER, write_zero_lora
from tests.conformance.backends import Backend, real_vllm
from weighbridge.emulator.real_vllm import tiny_model_dir


@pytest.fixture(scope="session")
def emulator_backend() -> Iterator[Backend]:
    with backends.emulator_backend(enable_prompt_tokens_details=True) as backend:
        yield backend


@pytest.fixture(scope="session")
def vllm_backend() -> Iterator[Backend]:
    # Its development endpoints too: /server_info names the scheduling policy.
    with real_vllm(enable_prompt_tokens_details=True,
                   extra_env=backends.DEV_MODE) as server:
        yield Backend("vllm", server.url, server.model_name)


@pytest.fixture(params=["emulator", pytest.param("vllm", marks=pytest.mark.vllm)])
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue(f"{request.param}_backend")


@pytest.fixture(scope="session")
def vllm_pooling_backend() -> Iterator[Backend]:
    """Real vLLM serving the tiny model as an embedding model: /v1/embeddings, /pooling,
    and /score and /rerank as a bi-encoder."""
    with real_vllm(extra_args=list(backends.EMBED_MODEL)) as server:
        yield Backend("vllm", server.url, server.model_name)


@pytest.fixture(scope="session")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_zero_lora(tmp_path_factory.mktemp("lora") / ADAPTER, tiny_model_dir())


@pytest.fixture(scope="session")
def emulator_flagged_backend(adapter_dir: Path) -> Iterator[Backend]:
    with backends.flagged_emulator(adapter_dir) as backend:
        yield backend


@pytest.fixture(scope="session")
def vllm_flagged_backend(adapter_dir: Path) -> Iterator[Backend]:
    with backends.flagged_vllm(adapter_dir) as server:
        yield Backend("vllm", server.url, server.model_name)


@pytest.fixture(params=["emulator", pytest.param("vllm", marks=pytest.mark.vllm)])
def flagged_backend(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue(f"{request.param}_flagged_backend")
