"""The processes of a test stack: emulated engines and a sidecar on loopback, the
config pieces every sidecar test writes (tenants, keys, request bodies), and ``Stack``,
the one factory for an engine(s) + sidecar stack."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weighbridge.launch import ServerProcess, emulator_process, sidecar_process

# The emulator shape most modules use: few sequences, so that holding the backend busy
# takes one or two requests. t_fixed sets the decode speed: 1 / t_fixed tokens/s per sequence.
SMALL_ENGINE: dict[str, object] = {"max_num_seqs": 4, "max_num_batched_tokens": 512,
                                   "num_kv_blocks": 256, "max_model_len": 2048}


ADMIN_KEY = "sk-admin-test"


def tenant(tier: str, key: str, **extra: object) -> dict[str, object]:
    """A tenant entry for the config mapping (plain keys: tests only)."""
    return {"tier": tier, "api_keys": [f"plain:{key}"], **extra}


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def completion(max_tokens: int = 4, *, prompt_tokens: int = 4, stream: bool = False,
               **extra: object) -> dict[str, object]:
    """A /v1/completions body with a token-id prompt, so the sidecar's prompt count is exact,
    and ignore_eos, so the output is exactly max_tokens."""
    return {"prompt": [7] * prompt_tokens, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": stream, **extra}


def start_emulator(stack: contextlib.ExitStack, **flags: object) -> ServerProcess:
    shape: dict[str, Any] = {**SMALL_ENGINE, **flags}  # emulator_process checks the values
    return stack.enter_context(emulator_process(**shape))


def start_sidecar(stack: contextlib.ExitStack, config: Mapping[str, object]) -> ServerProcess:
    return stack.enter_context(sidecar_process(config))


@dataclass(frozen=True)
class Stack:
    """Emulated engines and a sidecar in front of them, as ``start_stack`` started them."""

    sidecar_process: ServerProcess
    engine_processes: tuple[ServerProcess, ...]

    @property
    def sidecar(self) -> str:
        return self.sidecar_process.url

    @property
    def engines(self) -> tuple[str, ...]:
        return tuple(e.url for e in self.engine_processes)

    @property
    def emulator(self) -> str:
        """The first (often the only) engine's URL."""
        return self.engines[0]

    @property
    def pid(self) -> int:
        assert self.sidecar_process.pid is not None
        return self.sidecar_process.pid

    @property
    def log(self) -> Path:
        assert self.sidecar_process.log_path is not None
        return self.sidecar_process.log_path


def start_stack(processes: contextlib.ExitStack, config: Mapping[str, object], *,
                engines: int = 1, **engine_flags: object) -> Stack:
    """``engines`` emulators of the ``SMALL_ENGINE`` shape (``engine_flags`` override it) and
    a sidecar with ``config``, whose ``backends`` are the emulators unless it names its own;
    all owned by ``processes`` (stopped at the end of the module)."""
    started = tuple(start_emulator(processes, **engine_flags) for _ in range(engines))
    if "backends" not in config:
        config = {**config, "backends": [{"url": e.url} for e in started]}
    return Stack(start_sidecar(processes, config), started)
