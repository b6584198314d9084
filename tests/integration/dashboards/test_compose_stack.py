"""Acceptance 3: docker-compose.yml and the provisioning files are valid and agree with each
other, without Docker: every file parses, every mounted or copied path exists, every
command's options exist, and service names and ports line up between the compose file, the
Prometheus scrape configuration, Grafana's data source and dashboard provider, and the
sidecar's backend URLs."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import typer.main
import yaml

from tests.support.prometheus import check_config
from weighbridge.app.cli import app
from weighbridge.dashboards.generate import DASHBOARDS, JSON_DIR, file_name
from weighbridge.keys import hash_api_key
from weighbridge.launch import haproxy_config
from weighbridge.sidecar.config import load_config

REPO = Path(__file__).resolve().parents[3]
COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
PROMETHEUS = REPO / "deploy" / "compose" / "prometheus.yml"
SIDECAR = REPO / "deploy" / "compose" / "sidecar.yaml"
HAPROXY = REPO / "deploy" / "compose" / "haproxy.cfg"
GRAFANA = REPO / "deploy" / "grafana" / "provisioning"
ENGINES = ("engine-0", "engine-1")
LOCUST = Path(sys.executable).with_name("locust")

_VARIABLE = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def _defaults(text: str) -> str:
    """Compose's ${NAME:-default} interpolation with nothing set in the environment."""
    return _VARIABLE.sub(lambda m: m.group(2) or "", text)


def _compose() -> dict[str, Any]:
    return yaml.safe_load(_defaults(COMPOSE.read_text()))


def _services() -> dict[str, dict[str, Any]]:
    return _compose()["services"]


def _argv(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    return command.split() if isinstance(command, str) else list(command)


def _option(argv: list[str], name: str) -> str:
    for i, arg in enumerate(argv):
        if arg == name:
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} not in {argv}")


def _names(service_name: str, service: dict[str, Any]) -> set[str]:
    """The host names a service answers to on the compose network."""
    aliases = (service.get("networks") or {}).get("default", {}) or {}
    return {service_name, *aliases.get("aliases", [])}


def _listen_port(service: dict[str, Any]) -> int:
    image = service.get("image", "")
    for known, port in (("prom/prometheus", 9090), ("grafana/grafana", 3000),
                        ("redis:", 6379)):
        if image.startswith(known):
            return port
    if image.startswith("haproxy:"):
        (bind,) = re.findall(r"^\s*bind\s+\S*:(\d+)", HAPROXY.read_text(), re.M)
        return int(bind)
    return int(_option(_argv(service), "--port"))


def _resolve(host: str, profile: str) -> dict[str, Any]:
    """The service that ``host`` reaches with ``profile`` active (exactly one)."""
    matches = [(name, s) for name, s in _services().items()
               if host in _names(name, s) and profile_active(s, profile)]
    assert len(matches) == 1, f"{host} under profile {profile}: {[n for n, _ in matches]}"
    return matches[0][1]


def profile_active(service: dict[str, Any], profile: str) -> bool:
    return not service.get("profiles") or profile in service["profiles"]


# ----------------------------------------------------------------------------- parse + paths


def test_every_file_parses() -> None:
    assert _services()
    for path in [PROMETHEUS, SIDECAR, *GRAFANA.rglob("*.yml")]:
        assert yaml.safe_load(path.read_text()), path
    load_config(SIDECAR)  # the sidecar's own schema: every field valid


def test_every_mounted_path_and_the_build_context_exist() -> None:
    for name, service in _services().items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (REPO / source).exists() or source == "./runs", (name, source)
        if "build" in service:
            build = service["build"]
            build = build if isinstance(build, dict) else {"context": build}
            assert (REPO / build["context"] / "Dockerfile").is_file()
            if "target" in build:
                assert f" AS {build['target']}" in DOCKERFILE.read_text(), (name, build)
    named = {v.split(":")[0] for s in _services().values() for v in s.get("volumes", [])
             if not v.startswith((".", "/", "~"))}
    assert named <= set(_compose().get("volumes", {})), named


def test_dockerfile_copies_existing_paths_and_every_package() -> None:
    copied = set()
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY "):
            *sources, _ = line.split()[1:]
            for source in sources:
                assert (REPO / source).exists(), source
                copied.add(source)
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    # Every package's top source folder: weighbridge/, or the root folder its link points to.
    folders = {(REPO / p.replace(".", "/")).resolve().relative_to(REPO).parts[0]
               for p in setuptools["packages"]}
    assert folders <= copied, folders - copied


def test_the_sidecar_image_installs_the_sidecars_dependencies_only() -> None:
    stages = re.split(r"^FROM ", DOCKERFILE.read_text(), flags=re.M)
    sidecar = next(s for s in stages if s.split("\n", 1)[0].endswith(" AS sidecar"))
    assert "pip install '.[sidecar]'" in sidecar
    assert _services()["sidecar"]["build"]["target"] == "sidecar"


# ----------------------------------------------------------------------------- commands


def _check_weighbridge(argv: list[str]) -> None:
    assert argv[0] == "weighbridge", argv
    group = typer.main.get_command(app)
    ctx = group.make_context("weighbridge", argv[1:2], resilient_parsing=True)
    command = group.get_command(ctx, argv[1])
    assert command is not None, argv
    command.make_context(argv[1], argv[2:])  # unknown options or bad values raise


def test_weighbridge_commands_parse() -> None:
    commands = [_argv(s) for s in _services().values() if _argv(s)[:1] == ["weighbridge"]]
    assert {c[1] for c in commands} == {"emulator", "sidecar"}
    for argv in commands:
        _check_weighbridge(argv)
    with pytest.raises(Exception, match="bogus"):
        _check_weighbridge(["weighbridge", "emulator", "--bogus"])


def test_locust_options_exist() -> None:
    """Locust's own options from its --help; weighbridge's (loadgen/locust_plugin.py) are
    added when a locustfile loads, which --help does not do."""
    help_text = subprocess.run([str(LOCUST), "--help"], cwd=REPO, capture_output=True,
                               text=True, timeout=120, check=True).stdout
    help_text += (REPO / "loadgen" / "locust_plugin.py").read_text()
    for name in ("locust-master", "locust-worker"):
        argv = _argv(_services()[name])
        assert argv[0] == "locust" and "/app/scenarios/" in argv
        for arg in argv[1:]:
            if arg.startswith("--"):
                assert arg.split("=")[0] in help_text, arg
        assert "./scenarios:/app/scenarios:ro" in _services()[name]["volumes"]


def test_the_gpu_engines_run_vllm_with_priority_scheduling_and_a_gpu_each() -> None:
    gpus = []
    services = _services()
    for name in ("vllm-0", "vllm-1"):
        service = services[name]
        assert service["image"].startswith("vllm/vllm-openai:")
        assert service["profiles"] == ["gpu"]
        argv = _argv(service)
        assert _option(argv, "--scheduling-policy") == "priority"
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"] and devices[0]["driver"] == "nvidia"
        gpus += devices[0]["device_ids"]
    assert len(set(gpus)) == 2  # one GPU each


def test_one_model_variable_serves_the_same_name_in_both_profiles() -> None:
    raw = COMPOSE.read_text()
    models = set(re.findall(r"--model(?:-name)? (\$\{MODEL[^}]*\})", raw))
    assert len(models) == 1, models
    assert len(re.findall(r"--model(?:-name)? \$\{MODEL", raw)) == 4
    services = _services()
    assert (_option(_argv(services["vllm-0"]), "--model")
            == _option(_argv(services["emulator-0"]), "--model-name"))


def test_the_emulated_profile_swaps_every_engine() -> None:
    for profile in ("gpu", "emulated"):
        for engine in ENGINES:
            service = _resolve(engine, profile)
            assert service["profiles"] == [profile]
            assert _listen_port(service) == 8001
            argv = _argv(service)
            assert _option(argv, "--scheduling-policy") == "priority"


# ----------------------------------------------------------------------------- agreement


def _target_hosts(job: str) -> list[tuple[str, int, dict[str, str]]]:
    config = yaml.safe_load(PROMETHEUS.read_text())
    (scrape,) = [j for j in config["scrape_configs"] if j["job_name"] == job]
    found = []
    for static in scrape.get("static_configs", []):
        for target in static["targets"]:
            host, port = target.rsplit(":", 1)
            found.append((host, int(port), static.get("labels", {})))
    for sd in scrape.get("dns_sd_configs", []):
        found += [(name, int(sd["port"]), {}) for name in sd["names"]]
    return found


@pytest.mark.parametrize("profile", ["gpu", "emulated"])
def test_prometheus_scrapes_what_the_services_listen_on(profile: str) -> None:
    for host, port, _ in _target_hosts("weighbridge-sidecar") + _target_hosts("vllm"):
        assert _listen_port(_resolve(host, profile)) == port, (host, port)
    # The loadgen exporters: worker N listens on the master's --exporter-port + N.
    base = int(_option(_argv(_services()["locust-master"]), "--exporter-port"))
    ports = sorted(port for _, port, _ in _target_hosts("weighbridge-loadgen"))
    assert {h for h, _, _ in _target_hosts("weighbridge-loadgen")} == {"locust-worker"}
    workers = int(_services()["locust-worker"]["deploy"]["replicas"])
    assert ports == list(range(base, base + workers))


def test_engine_targets_carry_the_sidecars_backend_names() -> None:
    config = load_config(SIDECAR)
    by_host = {urlsplit(str(b.url)).hostname: b.name for b in config.backends}
    targets = _target_hosts("vllm")
    assert sorted(h for h, _, _ in targets) == sorted(by_host)
    for host, _, labels in targets:
        assert labels == {"backend": by_host[host]}


@pytest.mark.parametrize("profile", ["gpu", "emulated"])
def test_sidecar_backends_are_the_engines(profile: str) -> None:
    config = load_config(SIDECAR)
    assert [b.name for b in config.backends] == list(ENGINES)
    for backend in config.backends:
        url = urlsplit(str(backend.url))
        service = _resolve(url.hostname or "", profile)
        assert _listen_port(service) == url.port
        assert backend.priority_scheduling  # the engines run --scheduling-policy priority


def test_locust_and_the_sidecar_agree() -> None:
    services = _services()
    host = urlsplit(_option(_argv(services["locust-master"]), "--host"))
    assert _listen_port(_resolve(host.hostname or "", "emulated")) == host.port
    sidecar = _argv(services["sidecar"])
    mounted = {v.split(":")[1]: v.split(":")[0] for v in services["sidecar"]["volumes"]}
    assert mounted[_option(sidecar, "--config")] == "./deploy/compose/sidecar.yaml"
    master = _option(_argv(services["locust-worker"]), "--master-host")
    assert master in services


def test_the_gateway_fronts_the_sidecar_replicas_and_they_share_redis() -> None:
    services = _services()
    gateway = services["gateway"]
    mounted = {v.split(":")[1]: v.split(":")[0] for v in gateway["volumes"]}
    assert mounted["/usr/local/etc/haproxy/haproxy.cfg"] == "./deploy/compose/haproxy.cfg"
    (host, port), = re.findall(r"^\s*server-template\s+\S+\s+\S+\s+([\w-]+):(\d+)",
                               HAPROXY.read_text(), re.M)
    assert _listen_port(_resolve(host, "emulated")) == int(port)
    assert host == "sidecar" and "replicas" in services["sidecar"]["deploy"]
    assert "ports" not in services["sidecar"]  # replicas cannot share a host port
    state = load_config(SIDECAR).state
    assert state.backend == "redis" and state.url is not None
    url = urlsplit(state.url)
    assert _listen_port(_resolve(url.hostname or "", "emulated")) == url.port


def _haproxy_defaults(text: str) -> set[str]:
    section = text.split("\ndefaults\n", 1)[1].split("\n\n", 1)[0]
    return {line.strip() for line in section.splitlines()
            if line.strip() and not line.strip().startswith("#")}


def test_the_gateway_passes_stream_events_on_at_once_as_the_launched_front_does() -> None:
    """The compose gateway's HAProxy defaults are the ones tests/integration/sidecar/
    test_haproxy_front.py checks live through launch.haproxy_config: among them
    ``option http-no-delay``, without which each SSE event was held back ~200 ms."""
    compose = _haproxy_defaults(HAPROXY.read_text())
    launched = _haproxy_defaults(haproxy_config(8000, ["http://127.0.0.1:8001"]))
    assert "option http-no-delay" in compose
    assert compose == launched


def test_every_scenario_tenant_has_its_key_in_the_compose_sidecar() -> None:
    config = load_config(SIDECAR)
    seen = 0
    for path in sorted((REPO / "scenarios" / "tenants").glob("*.yaml")):
        for tenant in yaml.safe_load(path.read_text())["tenants"]:
            configured = config.tenants.get(tenant["name"])
            assert configured is not None, (path.name, tenant["name"])
            assert configured.tier == tenant["tier"], tenant["name"]
            assert configured.weight == tenant.get("weight", 1), tenant["name"]
            digest = hash_api_key(tenant["api_key"]).removeprefix("sha256:")
            assert digest in {k.digest for k in configured.api_keys}, tenant["name"]
            seen += 1
    assert seen >= 10


def test_prometheus_mounts_the_rules_and_the_config_is_valid(tmp_path: Path) -> None:
    services = _services()
    mounts = {v.split(":")[1]: v.split(":")[0] for v in services["prometheus"]["volumes"]}
    config = yaml.safe_load(PROMETHEUS.read_text())
    assert mounts[_option(_argv(services["prometheus"]), "--config.file")] == \
        "./deploy/compose/prometheus.yml"
    (rules_glob,) = config["rule_files"]
    rules_dir = mounts[str(Path(rules_glob).parent)]
    assert list((REPO / rules_dir).glob(Path(rules_glob).name))
    # promtool on the same file with the rules at their checkout path.
    config["rule_files"] = [str(REPO / rules_dir / Path(rules_glob).name)]
    local = tmp_path / "prometheus.yml"
    local.write_text(yaml.safe_dump(config))
    assert shutil.which("promtool"), "promtool (Debian's prometheus package) is required"
    check_config(local)


def test_grafana_provisions_the_datasource_and_the_dashboards() -> None:
    grafana = _services()["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    assert mounts["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"
    (datasource,) = yaml.safe_load(
        (GRAFANA / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert datasource["type"] == "prometheus" and datasource["isDefault"]
    url = urlsplit(datasource["url"])
    assert _listen_port(_resolve(url.hostname or "", "emulated")) == url.port
    scrape = yaml.safe_load(PROMETHEUS.read_text())["global"]["scrape_interval"]
    assert datasource["jsonData"]["timeInterval"] == scrape

    (provider,) = yaml.safe_load(
        (GRAFANA / "dashboards" / "weighbridge.yml").read_text())["providers"]
    assert provider["type"] == "file"
    assert mounts[provider["options"]["path"]] == "./" + str(JSON_DIR.relative_to(REPO))
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert Path(home).parent == Path(provider["options"]["path"])
    assert Path(home).name in {file_name(d) for d in DASHBOARDS}
