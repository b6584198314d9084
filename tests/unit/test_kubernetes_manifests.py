"""deploy/kubernetes validated offline (docs/deploy-kubernetes.md): every resource each
kustomization lists, the core kinds against Kubernetes' own schemas (kubernetes-validate,
strict: an unknown field fails), the InferencePool and the HTTPRoute against the schemas
vendored beside them; the references between them resolve, and the weighbridge config the
ConfigMaps carry is one the picker and the sidecar load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from weighbridge.sidecar.config import parse_config

REPO = Path(__file__).resolve().parents[2]
KUBERNETES = REPO / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.37.0"  # kubernetes-validate's newest schemas at the time of writing
SCHEMAS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-v1.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute-v1.json",
}
MODES = ["epp", "sidecar"]


def resources(mode: str) -> list[dict[str, Any]]:
    """Every resource of ``mode``'s kustomization, in its order."""
    kustomization = yaml.safe_load((KUBERNETES / mode / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    found = []
    for name in kustomization["resources"]:
        found += [doc for doc in yaml.safe_load_all((KUBERNETES / mode / name).read_text())
                  if doc is not None]
    return found


def by_kind(mode: str, kind: str) -> list[dict[str, Any]]:
    return [r for r in resources(mode) if r["kind"] == kind]


@pytest.mark.parametrize("mode", MODES)
def test_every_file_is_listed(mode: str) -> None:
    kustomization = yaml.safe_load((KUBERNETES / mode / "kustomization.yaml").read_text())
    on_disk = {p.name for p in (KUBERNETES / mode).glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == on_disk


@pytest.mark.parametrize("mode", MODES)
def test_each_resource_validates(mode: str) -> None:
    for resource in resources(mode):
        vendored = SCHEMAS.get((resource["apiVersion"], resource["kind"]))
        if vendored is None:
            kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
        else:
            schema = json.loads((KUBERNETES / "schemas" / vendored).read_text())
            jsonschema.validate(resource, schema, cls=jsonschema.Draft202012Validator)


def test_the_vendored_schemas_refuse_what_the_api_refuses() -> None:
    """The InferencePool schema is not vacuous: two target ports, a port out of range, an
    unknown failure mode and a stray field each fail."""
    (pool,) = by_kind("epp", "InferencePool")
    schema = json.loads((KUBERNETES / "schemas" / "inferencepool-v1.json").read_text())
    spec = pool["spec"]
    for bad in ({**spec, "targetPorts": [{"number": 8000}, {"number": 8001}]},
                {**spec, "targetPorts": [{"number": 70000}]},
                {**spec, "endpointPickerRef": {**spec["endpointPickerRef"],
                                               "failureMode": "Sometimes"}},
                {**spec, "selectors": spec["selector"]}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**pool, "spec": bad}, schema,
                                cls=jsonschema.Draft202012Validator)


def test_the_pool_names_the_picker_and_the_route_the_pool() -> None:
    (pool,) = by_kind("epp", "InferencePool")
    (service,) = by_kind("epp", "Service")
    (deployment,) = by_kind("epp", "Deployment")
    (route,) = by_kind("epp", "HTTPRoute")
    picker = pool["spec"]["endpointPickerRef"]
    assert picker["name"] == service["metadata"]["name"]
    grpc = next(p for p in service["spec"]["ports"] if p["port"] == picker["portNumber"])
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[grpc["targetPort"]] == picker["portNumber"]
    assert container["args"][container["args"].index("--port") + 1] == str(ports["grpc"])
    assert service["spec"]["selector"].items() <= \
        deployment["spec"]["template"]["metadata"]["labels"].items()
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert backends == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                         "name": pool["metadata"]["name"]}]


def test_the_picker_may_watch_its_pool_and_nothing_more() -> None:
    """The picker watches the pool its Deployment names (--pool-name) in its own namespace,
    as the service account it runs as: its Role lets it get, list and watch that pool's kind
    and pods, and write nothing."""
    (pool,) = by_kind("epp", "InferencePool")
    (deployment,) = by_kind("epp", "Deployment")
    (account,) = by_kind("epp", "ServiceAccount")
    (role,) = by_kind("epp", "Role")
    (binding,) = by_kind("epp", "RoleBinding")
    pod = deployment["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--pool-name") + 1] == pool["metadata"]["name"]
    (namespace,) = [e for e in pod["containers"][0]["env"] if e["name"] == "POD_NAMESPACE"]
    assert namespace["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount",
                                    "name": account["metadata"]["name"]}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    granted = {(group, resource): set(rule["verbs"]) for rule in role["rules"]
               for group in rule["apiGroups"] for resource in rule["resources"]}
    pool_group = pool["apiVersion"].partition("/")[0]
    assert granted == {("", "pods"): {"get", "list", "watch"},
                       (pool_group, "inferencepools"): {"get", "list", "watch"}}


@pytest.mark.parametrize("mode", MODES)
def test_the_config_map_is_a_weighbridge_config(mode: str) -> None:
    (config_map,) = by_kind(mode, "ConfigMap")
    (deployment,) = by_kind(mode, "Deployment")
    ((name, text),) = config_map["data"].items()
    config = parse_config(yaml.safe_load(text))
    assert config.backends and config.tenants
    assert "plain:" not in text  # keys as digests only, in a shipped manifest
    pod = deployment["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if "configMap" in v]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    args = pod["containers"][0]["args"]
    assert args[args.index("--config") + 1] == f"{mount['mountPath']}/{name}"
    # The quota file is on a writable volume (a ConfigMap's is not; a relative name is
    # beside the config file, in the ConfigMap's).
    quota_file = config.state.quota_file
    if config.state.backend == "local" and quota_file is not None:
        path = str(Path(mount["mountPath"]) / quota_file)  # an absolute name stays
        mounts = {m["mountPath"]: m for m in pod["containers"][0]["volumeMounts"]}
        (directory,) = [p for p in mounts if path.startswith(p + "/")]
        assert not mounts[directory].get("readOnly"), (mode, path)
