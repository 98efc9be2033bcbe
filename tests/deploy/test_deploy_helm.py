"""deploy/k8s/vime: helm lint, schema validation of the rendered manifests, and the invariants.

Invariants (DESIGN.md §8): trainer and rollout are two containers of one pod with
shareProcessNamespace; the GPUs are requested once (the device plugin gives them to one
container); no Service exposes an engine port and a NetworkPolicy keeps them to the router; every
container is probed; the token comes from a Secret; the mounted run config is the one deploy/
ships.
"""

from __future__ import annotations

import base64
import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from deploy_support import CHART, ROOT, Render, run_tool

from vime.config import EngineConfig, load_config

ENGINE_BASE = EngineConfig().base_port
VALUES = {"default": (), "cpu": ("values-cpu.yaml",)}
RUN_CONFIG = {"default": "gpu.yaml", "cpu": "cpu.yaml"}
KUBE_VERSIONS = ["1.29.0", "1.37.0"]


@pytest.fixture(scope="module", params=["default", "cpu"])
def variant(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def manifests(variant: str, default_manifests: list, cpu_manifests: list) -> list[dict[str, Any]]:
    return default_manifests if variant == "default" else cpu_manifests


def _kind(manifests: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [m for m in manifests if m["kind"] == kind]


def _pod_specs(manifests: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> pod spec of every workload."""
    return {
        m["metadata"]["name"]: m["spec"]["template"]["spec"]
        for m in manifests
        if m["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")
    }


def _colocated(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    (pod,) = [
        s
        for s in _pod_specs(manifests).values()
        if {"rollout", "trainer"} & {c["name"] for c in s["containers"]}
    ]
    return pod


def _gpu_requests(manifests: list[dict[str, Any]]) -> list[tuple[str, int]]:
    found = []
    for name, spec in _pod_specs(manifests).items():
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            res = c.get("resources") or {}
            for part in ("limits", "requests"):
                for key, value in (res.get(part) or {}).items():
                    if "gpu" in key:
                        found.append((f"{name}/{c['name']}/{part}/{key}", int(value)))
    return found


# --- tools ------------------------------------------------------------------------------------------


def test_helm_lint_strict(helm: str, helm_env: dict, variant: str) -> None:
    argv = [helm, "lint", "--strict", str(CHART)]
    for v in VALUES[variant]:
        argv += ["-f", str(CHART / v)]
    out = run_tool(argv, env=helm_env).stdout
    assert "1 chart(s) linted, 0 chart(s) failed" in out


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_manifests_validate_against_kubernetes_schemas(manifests: list, kube_version: str) -> None:
    kinds = set()
    for m in manifests:
        kubernetes_validate.validate(m, kube_version, strict=True)
        kinds.add(m["kind"])
    assert {"Deployment", "Service", "ConfigMap", "NetworkPolicy", "StatefulSet"} <= kinds


def test_schema_validation_rejects_a_broken_manifest(default_manifests: list) -> None:
    """Negative control: strict validation catches an unknown field and a wrong type."""
    bad = copy.deepcopy(next(m for m in default_manifests if m["kind"] == "Deployment"))
    bad["spec"]["template"]["spec"]["containers"][0]["gpus"] = 8
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, "1.29.0", strict=True)
    bad = copy.deepcopy(next(m for m in default_manifests if m["kind"] == "Deployment"))
    bad["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, "1.29.0", strict=True)


def test_chart_refuses_clusters_older_than_its_kube_version(helm: str, helm_env: dict) -> None:
    proc = run_tool(
        [helm, "template", "vime", str(CHART), "--kube-version", "1.28.0"], env=helm_env, check=False
    )
    assert proc.returncode != 0 and "kubeVersion" in proc.stderr


# --- the colocated pod -------------------------------------------------------------------------------


def test_trainer_and_rollout_are_one_pod_sharing_pids_and_shm(manifests: list) -> None:
    pod = _colocated(manifests)
    assert [c["name"] for c in pod["containers"]] == ["rollout", "trainer"]
    assert pod["shareProcessNamespace"] is True
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    for c in pod["containers"]:
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"], c["name"]
    owner = next(m for m in manifests if m["kind"] == "Deployment" and m["spec"]["template"]["spec"] == pod)
    assert owner["spec"]["replicas"] == 1
    assert owner["spec"]["strategy"] == {"type": "Recreate"}


def test_both_containers_mount_the_compile_cache(manifests: list, variant: str) -> None:
    pod = _colocated(manifests)
    for c in pod["containers"]:
        assert {"name": "cache", "mountPath": "/cache"} in c["volumeMounts"], c["name"]
    cache = next(v for v in pod["volumes"] if v["name"] == "cache")
    if variant == "default":  # a claim of its own, kept on uninstall
        claim = cache["persistentVolumeClaim"]["claimName"]
        pvc = next(m for m in _kind(manifests, "PersistentVolumeClaim") if m["metadata"]["name"] == claim)
        assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    else:  # the CPU step compiles nothing
        assert cache == {"name": "cache", "emptyDir": {}}


def test_gpus_requested_once_and_seen_by_both_containers(default_manifests: list) -> None:
    assert _gpu_requests(default_manifests) == [("vime-colocated/rollout/limits/nvidia.com/gpu", 8)]
    pod = _colocated(default_manifests)
    trainer = next(c for c in pod["containers"] if c["name"] == "trainer")
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]


def test_cpu_values_request_no_gpu(cpu_manifests: list) -> None:
    assert _gpu_requests(cpu_manifests) == []
    pod = _colocated(cpu_manifests)
    assert "nodeSelector" not in pod and "tolerations" not in pod
    for c in pod["containers"]:
        assert all(e["name"] != "NVIDIA_VISIBLE_DEVICES" for e in c["env"])
        assert c["image"].startswith("vime-cpu-all:")


def test_engines_bind_to_the_pod_ip(manifests: list) -> None:
    rollout = _colocated(manifests)["containers"][0]
    env = {e["name"]: e for e in rollout["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["VIME_ENGINE__HOST"]["value"] == "$(POD_IP)"
    names = [e["name"] for e in rollout["env"]]
    assert names.index("POD_IP") < names.index("VIME_ENGINE__HOST"), "$(POD_IP) needs POD_IP defined first"


# --- exposure ----------------------------------------------------------------------------------------


def _selected(manifests: list, selector: dict[str, str]) -> list[dict[str, Any]]:
    """Pod specs whose template labels match a Service / NetworkPolicy selector."""
    return [
        m["spec"]["template"]["spec"]
        for m in manifests
        if m["kind"] in ("Deployment", "StatefulSet")
        and selector.items() <= m["spec"]["template"]["metadata"]["labels"].items()
    ]


def _container_port(spec: dict[str, Any], target: int | str) -> int:
    if isinstance(target, int):
        return target
    for c in spec["containers"]:
        for p in c.get("ports", []):
            if p.get("name") == target:
                return int(p["containerPort"])
    raise AssertionError(f"named port {target} not declared")


def test_no_service_exposes_engine_or_rollout_ports(manifests: list) -> None:
    engine_ports = range(ENGINE_BASE, ENGINE_BASE + 64)
    for svc in _kind(manifests, "Service"):
        pods = _selected(manifests, svc["spec"]["selector"])
        assert pods, f"Service {svc['metadata']['name']} selects nothing"
        for port in svc["spec"]["ports"]:
            for spec in pods:
                target = _container_port(spec, port.get("targetPort", port["port"]))
                assert target not in engine_ports, f"{svc['metadata']['name']} exposes engine port {target}"
                assert target != 18083, f"{svc['metadata']['name']} exposes the rollout API"
    trainer = next(s for s in _kind(manifests, "Service") if s["metadata"]["name"] == "vime-trainer")
    assert [p["port"] for p in trainer["spec"]["ports"]] == [18084]


def test_network_policy_keeps_engine_ports_to_router_and_pod(manifests: list) -> None:
    pod_labels = next(
        m["spec"]["template"]["metadata"]["labels"]
        for m in manifests
        if m["kind"] == "Deployment" and m["metadata"]["name"] == "vime-colocated"
    )
    policies = [
        p
        for p in _kind(manifests, "NetworkPolicy")
        if p["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    ]
    assert len(policies) == 1 and policies[0]["spec"]["policyTypes"] == ["Ingress"]
    engines = set(range(ENGINE_BASE, ENGINE_BASE + 8))
    covered: set[int] = set()
    for rule in policies[0]["spec"]["ingress"]:
        for port in rule["ports"]:
            opened = set(range(port["port"], port.get("endPort", port["port"]) + 1))
            if opened & (engines | {18083}):
                assert rule.get("from"), f"engine/rollout ports {sorted(opened)} open to every source"
                components = {
                    peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for peer in rule["from"]
                }
                assert components <= {"router", "colocated"}, components
                covered |= opened
    assert engines <= covered, "engine ports not covered by an explicit rule"


# --- probes, token, config ------------------------------------------------------------------------------


def test_every_container_is_probed(manifests: list) -> None:
    for name, spec in _pod_specs(manifests).items():
        for c in spec["containers"]:
            assert c.get("readinessProbe") and c.get("livenessProbe"), f"{name}/{c['name']}"
            if c["name"] == "redis":
                continue
            declared = {p["containerPort"] for p in c["ports"]}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                get = c[probe]["httpGet"]
                assert get["path"] == "/health" and get["port"] in declared, f"{name}/{c['name']} {probe}"


def test_token_comes_from_the_chart_secret(manifests: list) -> None:
    secrets = {s["metadata"]["name"]: s for s in _kind(manifests, "Secret")}
    vime_containers = [
        c for s in _pod_specs(manifests).values() for c in s["containers"] if c["name"] != "redis"
    ]
    assert {c["name"] for c in vime_containers} == {"rollout", "trainer", "router", "reward"}
    for c in vime_containers:
        (token,) = [e for e in c["env"] if e["name"] == "VIME_API_TOKEN"]
        ref = token["valueFrom"]["secretKeyRef"]
        assert "value" not in token
        assert ref["key"] in secrets[ref["name"]]["data"], c["name"]
    (secret,) = secrets.values()
    assert len(base64.b64decode(secret["data"]["token"])) == 48


def test_token_value_and_existing_secret(render: Render) -> None:
    given = render(set=["apiToken.value=s3cret"])
    (secret,) = _kind(given, "Secret")
    assert base64.b64decode(secret["data"]["token"]) == b"s3cret"
    external = render(set=["apiToken.existingSecret=my-token"])
    assert _kind(external, "Secret") == []
    refs = {
        e["valueFrom"]["secretKeyRef"]["name"]
        for s in _pod_specs(external).values()
        for c in s["containers"]
        for e in c.get("env", [])
        if e["name"] == "VIME_API_TOKEN"
    }
    assert refs == {"my-token"}


def test_mounted_run_config_is_the_one_deploy_ships(manifests: list, variant: str, tmp_path: Path) -> None:
    """values.yaml / values-cpu.yaml repeat deploy/config/{gpu,cpu}.yaml: keep them equal."""
    (cm,) = _kind(manifests, "ConfigMap")
    shipped = ROOT / "deploy" / "config" / RUN_CONFIG[variant]
    rendered = tmp_path / "run.yaml"
    rendered.write_text(cm["data"]["run.yaml"])
    assert yaml.safe_load(rendered.read_text()) == yaml.safe_load(shipped.read_text())
    assert load_config(rendered, environ={}).model_dump() == load_config(shipped, environ={}).model_dump()


def test_external_redis(render: Render, helm: str, helm_env: dict) -> None:
    proc = run_tool(
        [helm, "template", "vime", str(CHART), "--set", "redis.enabled=false"], env=helm_env, check=False
    )
    assert proc.returncode != 0 and "redis.url is required" in proc.stderr
    out = render(set=["redis.enabled=false", "redis.url=redis://cache.example:6379/2"])
    assert _kind(out, "StatefulSet") == []
    urls = {
        e["value"]
        for s in _pod_specs(out).values()
        for c in s["containers"]
        for e in c["env"]
        if e["name"] == "VIME_SERVICES__REDIS_URL"
    }
    assert urls == {"redis://cache.example:6379/2"}


def test_redis_statefulset_persists_with_aof(default_manifests: list) -> None:
    (sts,) = _kind(default_manifests, "StatefulSet")
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"


def test_notes_print_the_curl_that_starts_a_run(helm: str, helm_env: dict) -> None:
    out = run_tool([helm, "install", "vime", str(CHART), "--dry-run=client"], env=helm_env).stdout
    notes = out[out.index("NOTES:") :]
    assert "curl -X POST http://127.0.0.1:18084/v1/runs" in notes
    assert "Authorization: Bearer $VIME_API_TOKEN" in notes
    assert "get secret vime-api-token" in notes
