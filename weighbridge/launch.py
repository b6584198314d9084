"""Child server processes on loopback: start, wait until healthy, stop, whatever happens.

Every process started here has an owner (a ``with`` block or an explicit ``stop()``), runs in
its own process group so that its children die with it, and is killed at interpreter exit
if its owner forgot. Used by the test fixtures, the real-vLLM harness and the local stack.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType

import httpx
import yaml


class LaunchError(RuntimeError):
    """A child server could not be started, or died before it became healthy."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def log_tail(path: Path | None, lines: int = 60) -> str:
    if path is None or not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


_LIVE: set[ServerProcess] = set()


@atexit.register
def _stop_all() -> None:  # pragma: no cover - safety net for crashed sessions
    for proc in list(_LIVE):
        with contextlib.suppress(Exception):
            proc.stop()


@dataclass(eq=False)
class ServerProcess:
    """One child server. ``health_url`` answering 200 means it is ready, or ``ready`` saying
    so for a server that does not speak HTTP (Redis)."""

    name: str
    argv: Sequence[str]
    url: str  # the server's base URL
    health_path: str = "/health"
    env: Mapping[str, str] | None = None  # added to this process's environment
    inherit_env: bool = True  # False: ``env`` is the child's whole environment
    cwd: Path | None = None
    log_path: Path | None = None  # default: a temporary file, kept for post-mortems
    startup_timeout_s: float = 60.0
    stop_timeout_s: float = 10.0  # after SIGTERM, before SIGKILL
    ready: Callable[[], bool] | None = None  # instead of the HTTP health check
    startup_s: float | None = field(default=None, init=False)  # how long start() took
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def health_url(self) -> str:
        return self.url.rstrip("/") + self.health_path

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> ServerProcess:
        if self._proc is not None:
            raise LaunchError(f"{self.name} already started")
        if self.log_path is None:
            fd, path = tempfile.mkstemp(prefix=f"weighbridge-{self.name}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(path)
        env = {**os.environ, **(self.env or {})} if self.inherit_env else dict(self.env or {})
        started = time.monotonic()
        with open(self.log_path, "wb") as log:
            log.write(("$ " + " ".join(self.argv) + "\n").encode())
            log.flush()
            self._proc = subprocess.Popen(
                list(self.argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, cwd=self.cwd, start_new_session=True,
            )
        _LIVE.add(self)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - started
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                assert self._proc is not None
                if self._proc.poll() is not None:
                    raise LaunchError(
                        f"{self.name} exited with status {self._proc.returncode} before it "
                        f"became healthy; log {self.log_path}:\n{log_tail(self.log_path)}")
                if self.ready is not None:
                    if self.ready():
                        return
                else:
                    with contextlib.suppress(httpx.HTTPError):
                        if client.get(self.health_url).status_code == 200:
                            return
                time.sleep(0.1)
        raise LaunchError(
            f"{self.name} not healthy at {self.health_url} after {self.startup_timeout_s:.0f} s;"
            f" log {self.log_path}:\n{log_tail(self.log_path)}")

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the whole process group (chaos tests use SIGKILL/SIGSTOP)."""
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, sig)

    def stop(self, timeout_s: float | None = None) -> None:
        timeout_s = self.stop_timeout_s if timeout_s is None else timeout_s
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                proc.wait(timeout=timeout_s)
        # Children that ignored SIGTERM with their parent gone.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        _LIVE.discard(self)
        self._proc = None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


def weighbridge_argv(*args: str) -> list[str]:
    """The command line that runs ``weighbridge ARGS`` with this interpreter."""
    return [sys.executable, "-m", "weighbridge", *args]


def emulator_process(name: str = "emulator", host: str = "127.0.0.1", port: int | None = None,
                     **flags: object) -> ServerProcess:
    """A ``weighbridge emulator`` child; ``flags`` are its options in Python spelling
    (``max_num_seqs=4``, ``no_chunked_prefill=True``, ``lora_modules=["a=/p", "b=/q"]``:
    a list is the flag repeated; ``enable_prefix_caching=False`` is vLLM's negative spelling,
    ``--no-enable-prefix-caching``, as for every ``enable_*`` switch)."""
    port = port or free_port(host)
    argv = weighbridge_argv("emulator", "--host", host, "--port", str(port))
    for key, value in flags.items():
        option = "--" + key.replace("_", "-")
        if value is True:
            argv.append(option)
        elif value is False and key.startswith("enable_"):
            argv.append("--no-" + option.removeprefix("--"))
        elif isinstance(value, list | tuple):
            for item in value:
                argv += [option, str(item)]
        elif value is not False and value is not None:  # 0 is a value, not absence
            argv += [option, str(value)]
    return ServerProcess(name=name, argv=argv, url=f"http://{host}:{port}")


def sidecar_process(config: Mapping[str, object], name: str = "sidecar",
                    host: str = "127.0.0.1", port: int | None = None,
                    config_dir: Path | None = None) -> ServerProcess:
    """A ``weighbridge sidecar`` child serving ``config`` (a mapping in the YAML schema,
    written to a file next to its log)."""
    port = port or free_port(host)
    directory = Path(config_dir or tempfile.mkdtemp(prefix="weighbridge-sidecar-"))
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(dict(config), sort_keys=False))
    argv = weighbridge_argv("sidecar", "--config", str(path), "--host", host, "--port",
                            str(port))
    return ServerProcess(name=name, argv=argv, url=f"http://{host}:{port}",
                         health_path="/healthz")


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so every ``with`` block stops its children."""
    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def redis_answers(host: str, port: int) -> bool:
    """Whether a Redis server answers PING there: redis-py's client, one connection, a 1 s
    timeout and no retry; False on any connection or protocol error, never raised."""
    # redis-py is the sidecar extra's, not the base's: imported at the call, made only where
    # a Redis is started for sidecar replicas (`weighbridge up` needs that extra; the tests).
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    client = redis.Redis(host=host, port=port, socket_timeout=1.0, socket_connect_timeout=1.0,
                         retry=Retry(NoBackoff(), 0))
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def redis_process(directory: Path, name: str = "redis", host: str = "127.0.0.1",
                  port: int | None = None) -> ServerProcess:
    """A ``redis-server`` child (Debian's package) with its own directory and no
    persistence, ready when it answers PING; stop and start it again on the same port, as an
    outage is. ``url`` is ``redis://host:port/0``."""
    path = shutil.which("redis-server")
    if path is None:
        raise LaunchError("redis-server not found on PATH: install Redis (Debian: apt-get "
                          "install redis-server)")
    port = port or free_port(host)
    directory.mkdir(parents=True, exist_ok=True)
    return ServerProcess(
        name=name, url=f"redis://{host}:{port}/0",
        argv=[path, "--port", str(port), "--bind", host, "--dir", str(directory),
              "--save", "", "--appendonly", "no"],
        ready=lambda: redis_answers(host, port), startup_timeout_s=20.0)


def _haproxy_maxconn() -> int:
    """As many connections as the open-files limit allows (HAProxy refuses to start when
    maxconn needs more: each connection is two descriptors, plus its own)."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = 65_536 if hard == resource.RLIM_INFINITY else hard
    return max(64, min(20_000, (limit - 64) // 2))


def haproxy_config(port: int, backends: Sequence[str], host: str = "127.0.0.1",
                   health_path: str = "/healthz") -> str:
    """HAProxy in front of sidecar replicas (or of any HTTP servers answering
    ``health_path``): round robin, each checked on ``health_path``, streams allowed to run
    long (the timeouts bound a silent connection, not a long answer)."""
    servers = "\n".join(
        f"  server replica-{i} {httpx.URL(url).host}:{httpx.URL(url).port} check inter 1s"
        for i, url in enumerate(backends))
    return f"""global
  maxconn {_haproxy_maxconn()}

defaults
  mode http
  # Each SSE event goes on at once: without it HAProxy holds a stream's small writes back
  # to fill packets (TTFT +128 ms p50 at 200 streams/s, benchmarks/sidecar_overhead.py).
  option http-no-delay
  timeout connect 2s
  timeout client 600s
  timeout server 600s
  timeout http-request 60s

frontend weighbridge
  bind {host}:{port}
  default_backend replicas

backend replicas
  balance roundrobin
  option httpchk GET {health_path}
  retry-on conn-failure
  retries 2
  option redispatch
{servers}
"""


def haproxy_process(backends: Sequence[str], directory: Path, host: str = "127.0.0.1",
                    port: int | None = None, health_path: str = "/healthz") -> ServerProcess:
    """An ``haproxy`` child (Debian's package) load-balancing ``backends``; healthy when a
    backend answers ``health_path`` through it."""
    path = shutil.which("haproxy")
    if path is None:
        raise LaunchError("haproxy not found on PATH (Debian: apt-get install haproxy)")
    port = port or free_port(host)
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "haproxy.cfg"
    config.write_text(haproxy_config(port, backends, host, health_path))
    return ServerProcess(name="haproxy", argv=[path, "-db", "-f", str(config)],
                         url=f"http://{host}:{port}", health_path=health_path)
