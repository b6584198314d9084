"""The config schema: the issue-3 YAML loads, and every mistake names its field path."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from weighbridge.endpoints import EndpointKind
from weighbridge.keys import hash_api_key
from weighbridge.sidecar.config import (
    Config,
    ConfigError,
    load_config,
    parse_config,
)

REPO = Path(__file__).resolve().parents[2]

KEY_A = "sk-acme-secret"
KEY_ADMIN = "sk-admin-secret"

# Verbatim from issue 3; its `sha256:<hex>` placeholders are filled in below.
ISSUE_YAML_VERBATIM = """\
tiers:
  interactive: {rank: 1, ttft_slo_ms: 500, vllm_priority: 0}
  standard:    {rank: 2, e2e_slo_ms: 10000, vllm_priority: 5}
  batch:       {rank: 3, vllm_priority: 10}
tenants:
  acme:
    tier: interactive            # the highest tier this tenant may use; its default
    weight: 1                    # share within its tier
    api_keys: ["sha256:<hex>"]   # or "env:VAR"; "plain:<key>" accepted with a startup warning (tests, demos)
    limits: {requests_per_minute: 600, tokens_per_minute: 500000, tokens_per_day: 50000000, max_queued: 1000}
endpoints:
  /v1/chat/completions: {cost: tokens, quantum: 2048}   # cost: tokens | requests
  /v1/completions:      {cost: tokens, quantum: 2048}
backends:
  - {url: "http://127.0.0.1:8001", priority_scheduling: false}
scheduler: {policy: drr}         # drr | rr | fcfs | passthrough  (the last three are baselines)
admission: {max_backend_waiting: 2, min_decode_tokens_per_s: 7, metrics_poll_ms: 250, max_inflight_per_backend: 64}
routing: least_tokens            # least_tokens | least_requests | round_robin
admin_api_keys: ["sha256:<hex>"]
"""  # noqa: E501
ISSUE_YAML = ISSUE_YAML_VERBATIM.replace("sha256:<hex>", hash_api_key(KEY_A), 1).replace(
    "sha256:<hex>", hash_api_key(KEY_ADMIN), 1
)


def minimal(**extra: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "tenants": {"acme": {"tier": "interactive", "api_keys": [hash_api_key(KEY_A)]}},
        "backends": [{"url": "http://127.0.0.1:8001"}],
    }
    data.update(extra)
    return data


def config_error(load: Callable[..., Config], *args: Any, **kwargs: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load(*args, **kwargs)
    return info.value


def errors_of(data: dict[str, Any], **kwargs: Any) -> list[str]:
    err = config_error(parse_config, data, **kwargs)
    return [f"{path}: {message}" for path, message in err.errors]


@pytest.fixture
def issue_file(tmp_path: Path) -> Path:
    path = tmp_path / "sidecar.yaml"
    path.write_text(ISSUE_YAML)
    return path


# ----------------------------------------------------------------------------- loading


def test_issue_yaml_loads(issue_file: Path) -> None:
    config = load_config(issue_file)

    assert [name for name, _ in config.tiers_by_rank()] == ["interactive", "standard", "batch"]
    assert config.tiers["interactive"].ttft_slo_ms == 500
    assert config.tiers["standard"].e2e_slo_ms == 10_000
    assert config.tiers["batch"].vllm_priority == 10
    acme = config.tenants["acme"]
    assert (acme.tier, acme.weight) == ("interactive", 1.0)
    assert acme.limits.requests_per_minute == 600
    assert acme.limits.tokens_per_day == 50_000_000
    assert acme.limits.max_queued == 1000
    assert config.endpoints["/v1/chat/completions"].cost == "tokens"
    assert config.endpoints["/v1/completions"].quantum == 2048
    assert config.backends[0].url == "http://127.0.0.1:8001"
    assert config.backends[0].priority_scheduling is False
    assert config.scheduler.policy == "drr"
    assert config.admission.max_backend_waiting == 2
    assert config.admission.min_decode_tokens_per_s == 7
    assert config.admission.metrics_poll_ms == 250
    assert config.admission.max_inflight_per_backend == 64
    assert config.routing == "least_tokens"
    assert config.warnings == ()


def test_a_kind_s_other_paths_name_its_own() -> None:
    """A limit or a cost model written on /v1/rerank is /rerank's, which every path of the
    kind is read as (weighbridge.endpoints)."""
    raw = minimal(endpoints={"/v1/score": {"quantum": 7}})
    raw["tenants"]["acme"]["endpoint_limits"] = {"/v2/rerank": {"requests_per_minute": 3}}
    config = parse_config(raw)
    assert config.endpoints["/score"].quantum == 7 and "/v1/score" not in config.endpoints
    assert set(config.tenants["acme"].endpoint_limits) == {"/rerank"}


def test_defaults_fill_everything_optional() -> None:
    config = parse_config(minimal())

    assert {n: t.rank for n, t in config.tiers.items()} == {
        "interactive": 1,
        "standard": 2,
        "batch": 3,
    }
    assert set(config.endpoints) == {kind.value for kind in EndpointKind}
    assert all(e.cost == "tokens" and e.quantum == 2048 for e in config.endpoints.values())
    # The pooling kinds generate nothing.
    assert {path for path, e in config.endpoints.items() if e.initial_output_estimate == 0} \
        == {kind.value for kind in EndpointKind if not kind.generates}
    assert config.scheduler.policy == "drr"
    assert config.routing == "prefix_aware"
    # Unset admission knobs are derived from each engine's learned shape (test_shape.py).
    assert config.admission.max_backend_waiting is None
    assert config.admission.headroom_slots is None and config.admission.kv_aware
    assert config.admission.min_decode_tokens_per_s == 7
    assert config.backends[0].name == "127.0.0.1:8001"
    assert config.admin_api_keys == []


def test_endpoints_merge_over_defaults_and_requests_cost_defaults_to_quantum_one() -> None:
    config = parse_config(minimal(endpoints={"/v1/embeddings": {"cost": "requests"}}))

    assert config.endpoints["/v1/embeddings"].quantum == 1
    assert config.endpoints["/v1/completions"].quantum == 2048


def test_dumped_config_reloads_without_leaking_plain_keys() -> None:
    config = parse_config(minimal(admin_api_keys=["plain:hunter2"]))
    dumped = config.model_dump()

    assert "hunter2" not in repr(dumped)
    assert dumped["admin_api_keys"] == [hash_api_key("hunter2")]
    assert parse_config(dumped).model_dump() == dumped


def test_backend_name_defaults_without_credentials() -> None:
    config = parse_config(
        minimal(backends=[{"url": "http://user:pw@gpu-1:8000/"}, {"url": "http://[::1]:8002"}])
    )

    assert [b.name for b in config.backends] == ["gpu-1:8000", "[::1]:8002"]
    assert config.backends[0].url == "http://user:pw@gpu-1:8000"


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            lambda d: d["tenants"]["acme"].update(weight=0),
            "tenants.acme.weight: Input should be greater than 0",
        ),
        (
            lambda d: d["tenants"]["acme"].update(weight=-1.5),
            "tenants.acme.weight: Input should be greater than 0",
        ),
        (
            lambda d: d["tenants"]["acme"].update(tier="gold"),
            "tenants.acme.tier: unknown tier 'gold'",
        ),
        (
            lambda d: d["backends"][0].update(url="ftp://x"),
            "backends.0.url: must be an http(s) URL",
        ),
        (lambda d: d["backends"][0].update(url="not a url"), "backends.0.url: must be an http(s)"),
        (lambda d: d.update(backends=[]), "backends: List should have at least 1 item"),
        (lambda d: d.pop("backends"), "backends: Field required"),
        (lambda d: d.update(scheduler={"policy": "wfq"}),
         "scheduler.policy: unknown fairness policy 'wfq'"),
        (lambda d: d.update(routing="random"), "routing: unknown routing 'random'"),
        (
            lambda d: d.update(endpoints={"/v1/completions": {"cost": "bytes"}}),
            "endpoints./v1/completions.cost: Input should be 'tokens' or 'requests'",
        ),
        (
            lambda d: d.update(endpoints={"v1/completions": {}}),
            "endpoints.v1/completions.[key]: endpoint must be a URL path",
        ),
        (
            lambda d: d.update(admission={"max_backend_waiting": -1}),
            "admission.max_backend_waiting: Input should be greater than or equal to 0",
        ),
        (
            lambda d: d.update(admission={"metrics_poll_ms": 500, "metrics_stale_ms": 100}),
            "admission.metrics_stale_ms: must be at least metrics_poll_ms",
        ),
        (
            lambda d: d["tenants"]["acme"].update(api_keys=[]),
            "tenants.acme.api_keys: List should have at least 1 item",
        ),
        (
            lambda d: d["tenants"]["acme"].update(api_keys=["sha256:abc"]),
            "tenants.acme.api_keys.0: sha256 key must be 'sha256:' followed by 64 hex digits",
        ),
        (
            lambda d: d.update(admin_api_keys=["sk-pasted-raw-key"]),
            "admin_api_keys.0: API key must start with 'sha256:', 'env:' or 'plain:'",
        ),
        (
            lambda d: d["tenants"]["acme"].update(api_keys=["env:1BAD"]),
            "tenants.acme.api_keys.0: env key must name an environment variable",
        ),
        (
            lambda d: d["tenants"]["acme"].update(api_keys=["plain:"]),
            "tenants.acme.api_keys.0: plain key must not be empty",
        ),
        (
            lambda d: d["tenants"]["acme"].update(weight="2"),
            "tenants.acme.weight: Input should be a valid number",
        ),
        (
            lambda d: d["tenants"].update({"bad name": d["tenants"]["acme"]}),
            "tenants.bad name.[key]: name must be",
        ),
        (
            lambda d: d["tenants"]["acme"].update(limits={"tokens_per_minute": 0}),
            "tenants.acme.limits.tokens_per_minute: Input should be greater than 0",
        ),
    ],
)
def test_each_error_names_its_field_path(change: Any, expected: str) -> None:
    data = copy.deepcopy(minimal())
    change(data)

    errors = errors_of(data)

    assert any(e.startswith(expected) for e in errors), errors


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (minimal(routnig="round_robin"), "routnig: Extra inputs are not permitted"),
        (
            minimal(scheduler={"polcy": "rr"}),
            "scheduler.polcy: Extra inputs are not permitted",
        ),
        (
            minimal(tenants={"a": {"tier": "batch", "api_keys": ["plain:k"], "wieght": 2}}),
            "tenants.a.wieght: Extra inputs are not permitted",
        ),
        (
            minimal(backends=[{"url": "http://h:1", "priority_sched": True}]),
            "backends.0.priority_sched: Extra inputs are not permitted",
        ),
    ],
)
def test_unknown_keys_are_errors(data: dict[str, Any], expected: str) -> None:
    assert expected in errors_of(data)


def test_all_errors_are_reported_at_once() -> None:
    data = minimal(routing="random", scheduler={"policy": "wfq"})
    data["tenants"]["acme"]["weight"] = 0

    message = str(config_error(parse_config, data))

    assert "(3 errors)" in message
    assert "\n  tenants.acme.weight: Input should be greater than 0" in message
    assert "\n  routing: " in message
    assert "\n  scheduler.policy: " in message


def test_tier_ranks_must_be_unique() -> None:
    tiers = {"gold": {"rank": 1}, "silver": {"rank": 1}}
    data = minimal(tiers=tiers)
    data["tenants"]["acme"]["tier"] = "gold"

    assert errors_of(data) == [
        "tiers.silver.rank: rank 1 is also used by tier 'gold'; ranks must be unique"
    ]


def test_a_tiers_vllm_priority_defaults_from_its_rank() -> None:
    """A better tier is ahead inside a priority-scheduling engine too, unless told otherwise;
    the steps leave room for over_share_priority_demotion within a tier."""
    tiers = {"gold": {"rank": 1}, "silver": {"rank": 2}, "bronze": {"rank": 4, "vllm_priority": 3}}
    data = minimal(tiers=tiers)
    data["tenants"]["acme"]["tier"] = "gold"
    config = parse_config(data)

    assert {n: t.vllm_priority for n, t in config.tiers.items()} == {
        "gold": 0, "silver": 5, "bronze": 3}
    assert parse_config(minimal()).tiers["standard"].vllm_priority == 5  # the default tiers'


def test_duplicate_backends_are_errors() -> None:
    errors = errors_of(minimal(backends=[{"url": "http://h:1"}, {"url": "http://h:1/"}]))

    assert errors == [
        "backends.1.name: duplicate backend name 'h:1' (also backends.0.name)",
        "backends.1.url: duplicate backend url 'http://h:1' (also backends.0.url)",
    ]


# ----------------------------------------------------------------------------- keys


def test_key_shared_by_two_tenants_is_an_error() -> None:
    data = minimal()
    # The same key in two spellings: compared by digest, they are one key.
    data["tenants"]["globex"] = {"tier": "batch", "api_keys": [f"plain:{KEY_A}"]}

    assert errors_of(data) == [
        "tenants.globex.api_keys.0: same key as tenants.acme.api_keys.0; "
        "a key may belong to one tenant (or admin) only"
    ]


def test_admin_key_may_not_be_a_tenant_key() -> None:
    errors = errors_of(minimal(admin_api_keys=[hash_api_key(KEY_A)]))

    assert errors[0].startswith("admin_api_keys.0: same key as tenants.acme.api_keys.0")


def test_env_keys_resolve_at_load_time() -> None:
    data = minimal()
    data["tenants"]["acme"]["api_keys"] = ["env:ACME_KEY"]

    config = parse_config(data, environ={"ACME_KEY": "sk-from-env"})

    assert config.tenant_for_key("sk-from-env") == "acme"
    assert config.resolve_key_digests() == {hash_api_key("sk-from-env")[7:]: "acme"}
    assert str(config.tenants["acme"].api_keys[0]) == "env:ACME_KEY"


def test_env_keys_read_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WB_TEST_KEY", "sk-os-env")
    data = minimal()
    data["tenants"]["acme"]["api_keys"] = ["env:WB_TEST_KEY"]

    assert parse_config(data).tenant_for_key("sk-os-env") == "acme"


@pytest.mark.parametrize("environ", [{}, {"ACME_KEY": ""}])
def test_missing_env_var_names_the_field(environ: dict[str, str]) -> None:
    data = minimal()
    data["tenants"]["acme"]["api_keys"] = [hash_api_key("other"), "env:ACME_KEY"]

    assert errors_of(data, environ=environ) == [
        "tenants.acme.api_keys.1: environment variable ACME_KEY is not set or empty"
    ]


def test_plain_keys_warn_without_revealing_the_key() -> None:
    data = minimal(admin_api_keys=["plain:sk-admin-visible"])

    config = parse_config(data)

    assert len(config.warnings) == 1
    assert config.warnings[0].startswith("admin_api_keys.0: plain-text API key")
    assert "sk-admin-visible" not in " ".join(config.warnings)
    assert "sk-admin-visible" not in repr(config)
    assert config.is_admin_key("sk-admin-visible")


def test_errors_never_echo_a_key() -> None:
    message = str(config_error(parse_config, minimal(admin_api_keys=["sk-raw"])))

    assert "sk-raw" not in message


def test_hash_api_key_is_sha256_hex() -> None:
    # sha256("abc"), a standard test vector.
    assert hash_api_key("abc") == (
        "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    )


def test_key_lookups() -> None:
    data = minimal(admin_api_keys=[hash_api_key(KEY_ADMIN)])
    # Digests are case-insensitive hex.
    data["tenants"]["acme"]["api_keys"].append("sha256:" + hash_api_key("sk-second")[7:].upper())
    config = parse_config(data)
    digest = hash_api_key(KEY_A)

    assert config.tenant_for_key(KEY_A) == "acme"
    assert config.tenant_for_key("sk-second") == "acme"
    assert config.tenant_for_digest(digest) == "acme"
    assert config.tenant_for_digest(digest.removeprefix("sha256:")) == "acme"
    assert config.tenant_for_key("sk-wrong") is None
    assert config.tenant_for_key(KEY_ADMIN) is None
    assert config.is_admin_key(KEY_ADMIN)
    assert not config.is_admin_key(KEY_A)


def test_tier_allowed_only_downwards() -> None:
    data = minimal()
    data["tenants"]["beta"] = {"tier": "standard", "api_keys": ["plain:b"]}
    config = parse_config(data)

    assert config.tier_allowed("beta", "standard")
    assert config.tier_allowed("beta", "batch")
    assert not config.tier_allowed("beta", "interactive")
    assert not config.tier_allowed("beta", "platinum")


# ----------------------------------------------------------------------------- files


def test_missing_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"

    err = config_error(load_config, path)

    assert str(path) in str(err)
    assert err.errors == [(str(path), "No such file or directory")]


def test_yaml_syntax_error_names_file_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("backends:\n  - {url: http://h:1\nrouting: [\n")

    err = config_error(load_config, path)

    ((where, _),) = err.errors
    assert where.startswith(f"{path}:")
    assert where.count(":") >= 2  # file:line:column


def test_duplicate_yaml_keys_are_errors(tmp_path: Path) -> None:
    path = tmp_path / "dup.yaml"
    path.write_text(
        "tenants:\n"
        "  acme: {tier: batch, api_keys: ['plain:a']}\n"
        "  acme: {tier: batch, api_keys: ['plain:b']}\n"
        "backends: [{url: 'http://h:1'}]\n"
    )

    err = config_error(load_config, path)

    assert err.errors == [(f"{path}:3:3", "duplicate key 'acme'")]


@pytest.mark.parametrize(
    ("text", "expected"), [("", "file is empty"), ("- 1\n", "must be a mapping")]
)
def test_empty_or_non_mapping_file(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "odd.yaml"
    path.write_text(text)

    err = config_error(load_config, path)

    assert expected in str(err)
    assert str(path) in str(err)


def test_validation_error_from_file_names_file_and_path(issue_file: Path) -> None:
    issue_file.write_text(ISSUE_YAML.replace("weight: 1 ", "weight: 0 "))

    message = str(config_error(load_config, issue_file))

    assert message.startswith(f"{issue_file}: cannot load configuration (1 error)")
    assert "tenants.acme.weight: Input should be greater than 0" in message


def test_example_config_loads() -> None:
    config = load_config(REPO / "deploy" / "examples" / "tenants.yaml")

    tiers = {name: tenant.tier for name, tenant in config.tenants.items()}
    assert sorted(tiers.values()) == sorted(config.tiers)  # one tenant per tier
    assert all(config.tenant_for_key(f"sk-{name}-demo") == name for name in config.tenants)
    assert len(config.warnings) == len(config.tenants) + 1  # every plain key warns
    assert isinstance(config, Config)


def test_routing_names_a_preset_or_its_parts() -> None:
    assert parse_config(minimal(routing="round_robin")).routing == "round_robin"
    parts = parse_config(minimal(routing={"picker": "bounded_load",
                                          "scorers": {"least_tokens": 1, "prefix_affinity": 3}}))
    assert parts.routing.picker == "bounded_load"  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match=r"routing.scorers.nope.*unknown scorer 'nope'"):
        parse_config(minimal(routing={"picker": "bounded_load", "scorers": {"nope": 1}}))
    with pytest.raises(ConfigError, match=r"routing.picker: unknown picker"):
        parse_config(minimal(routing={"picker": "closest"}))
