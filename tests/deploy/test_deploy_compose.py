"""deploy/compose.yaml: `docker compose config` accepts it, and it keeps the colocation invariants.

CUDA IPC needs the trainer and the rollout manager (vLLM's parent) to share IPC + PID namespaces
and see the same GPUs; engine ports (unauthenticated control routes) are never published; every
service is health-checked and starts only after what it needs is healthy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
from deploy_support import ComposeConfig, run_tool

from vime.config import EngineConfig

ENGINE_BASE = EngineConfig().base_port
ENGINE_PORTS = range(ENGINE_BASE, ENGINE_BASE + 64)
PAIRS = {"gpu": ("rollout", "trainer"), "cpu": ("rollout-cpu", "trainer-cpu")}
SHARED = {"redis", "router", "reward"}


@pytest.fixture(scope="module", params=["gpu", "cpu"])
def profile(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def config(compose_config: ComposeConfig, profile: str) -> dict[str, Any]:
    return compose_config(None if profile == "gpu" else profile)


def _names(config: dict[str, Any]) -> set[str]:
    """Every DNS name on the compose network: service names and their aliases."""
    names = set(config["services"])
    for svc in config["services"].values():
        for net in (svc.get("networks") or {}).values():
            names.update((net or {}).get("aliases") or [])
    return names


def test_plain_up_runs_gpu_pair_and_cpu_profile_runs_cpu_pair(config: dict, profile: str) -> None:
    assert set(config["services"]) == SHARED | set(PAIRS[profile])


def test_pair_shares_ipc_and_pid_namespaces(config: dict, profile: str) -> None:
    rollout, trainer = (config["services"][n] for n in PAIRS[profile])
    assert rollout["ipc"] == "shareable"
    assert trainer["ipc"] == f"service:{PAIRS[profile][0]}"
    assert trainer["pid"] == f"service:{PAIRS[profile][0]}"
    assert trainer["depends_on"][PAIRS[profile][0]]["condition"] == "service_healthy"


def _gpu_devices(svc: dict[str, Any]) -> list[dict[str, Any]]:
    return ((svc.get("deploy") or {}).get("resources") or {}).get("reservations", {}).get("devices") or []


def test_gpus_reserved_for_the_gpu_pair_only(config: dict, profile: str) -> None:
    for name, svc in config["services"].items():
        devices = _gpu_devices(svc)
        if profile == "gpu" and name in PAIRS["gpu"]:
            # Both containers see every GPU of the host (count -1 = all).
            assert devices == [{"capabilities": ["gpu"], "driver": "nvidia", "count": -1}], name
        else:
            assert devices == [], f"{name} reserves GPUs"


def test_only_router_generate_and_trainer_api_are_published_on_loopback(config: dict, profile: str) -> None:
    published = {
        (name, int(p["target"]), p.get("host_ip"))
        for name, svc in config["services"].items()
        for p in svc.get("ports") or []
    }
    assert published == {("router", 18080, "127.0.0.1"), (PAIRS[profile][1], 18084, "127.0.0.1")}
    for name, svc in config["services"].items():
        for p in svc.get("ports") or []:
            assert int(p["target"]) not in ENGINE_PORTS, f"{name} publishes engine port {p}"
            assert int(p["published"]) not in ENGINE_PORTS, f"{name} publishes engine port {p}"
        assert not svc.get("expose"), f"{name} exposes ports"
        assert svc.get("network_mode") in (None, "bridge"), f"{name} uses network_mode {svc['network_mode']}"


def test_every_service_is_health_checked_and_waits_for_healthy_dependencies(config: dict) -> None:
    for name, svc in config["services"].items():
        assert svc.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        for dep, spec in (svc.get("depends_on") or {}).items():
            assert spec["condition"] == "service_healthy", f"{name} -> {dep}: {spec}"


def test_start_order(config: dict, profile: str) -> None:
    rollout, trainer = PAIRS[profile]
    deps = {name: set(svc.get("depends_on") or {}) for name, svc in config["services"].items()}
    assert deps["router"] == {"redis"}
    assert deps[rollout] == {"redis", "router", "reward"}
    assert deps[trainer] == {"redis", "router", "reward", rollout}


def test_vime_services_get_token_secret_config_and_resolvable_urls(config: dict) -> None:
    names = _names(config)
    for name, svc in config["services"].items():
        if name == "redis":
            continue
        assert [s["source"] for s in svc["secrets"]] == ["vime_api_token"], name
        env = svc["environment"]
        assert "VIME_API_TOKEN" not in env, f"{name} carries the token in plain env"
        mounts = {v["target"]: v for v in svc["volumes"]}
        assert mounts["/etc/vime/run.yaml"]["read_only"] is True
        assert Path(mounts["/etc/vime/run.yaml"]["source"]).is_file(), name
        assert svc["command"][-2:] == ["--config", "/etc/vime/run.yaml"], name
        assert svc["init"] is True
        urls = {k: v for k, v in env.items() if k.startswith("VIME_SERVICES__") and k.endswith("_URL")}
        assert len(urls) == 6, f"{name}: {sorted(urls)}"
        for key, url in urls.items():
            assert urlparse(url).hostname in names, f"{name}: {key}={url} names no service"


def test_engines_bind_to_the_rollout_container_on_the_private_network(config: dict, profile: str) -> None:
    rollout = config["services"][PAIRS[profile][0]]
    env = rollout["environment"]
    assert env["VIME_ENGINE__HOST"] == "rollout"
    assert "rollout" in _names(config)
    if profile == "cpu":
        assert "rollout" in rollout["networks"]["default"]["aliases"]
    # vLLM's dev routes and pickled IPC handles: only acceptable because the ports stay private.
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"


def test_redis_persists_with_aof_on_a_volume(config: dict) -> None:
    redis = config["services"]["redis"]
    cmd = redis["command"]
    assert cmd[cmd.index("--appendonly") + 1] == "yes"
    assert {(v["type"], v["target"]) for v in redis["volumes"]} == {("volume", "/data")}
    assert "redis-data" in config["volumes"]


def test_redis_image_and_router_file_limit_are_pinned_and_overridable(compose_config: ComposeConfig) -> None:
    """A host without a registry builds Redis from Debian packages (cpu.Dockerfile target `redis`), a
    host whose hard open-files limit is below 65536 lowers the router's; the defaults stay."""
    default = compose_config("cpu")["services"]
    assert default["redis"]["image"] == "redis:7.4.2-bookworm"
    assert default["router"]["ulimits"]["nofile"] == 65536
    env = {"VIME_REDIS_IMAGE": "vime-redis:0.1.0", "VIME_ROUTER_NOFILE": "20000"}
    changed = compose_config("cpu", env=env)["services"]
    assert changed["redis"]["image"] == "vime-redis:0.1.0"
    assert changed["router"]["ulimits"]["nofile"] == 20000
    # Any Redis image accepts connections from the other containers (the official image has
    # protected mode off by default; Debian's redis-server does not).
    cmd = default["redis"]["command"]
    assert cmd[cmd.index("--protected-mode") + 1] == "no"


def test_data_volumes_are_named_by_default_and_bind_mounted_when_set(compose_config: ComposeConfig) -> None:
    default = compose_config()["services"]["trainer"]["volumes"]
    assert {v["target"]: v["type"] for v in default if v["target"] != "/etc/vime/run.yaml"} == {
        "/models": "volume",
        "/data": "volume",
        "/checkpoints": "volume",
        "/runs": "volume",
        "/cache": "volume",
    }
    bound = compose_config(env={"VIME_MODELS_DIR": "/srv/models"})["services"]["trainer"]["volumes"]
    models = next(v for v in bound if v["target"] == "/models")
    assert (models["type"], models["source"]) == ("bind", "/srv/models")


def test_the_gpu_pair_shares_one_compile_cache_volume(compose_config: ComposeConfig) -> None:
    for env, want in (({}, ("volume", "cache")), ({"VIME_CACHE_DIR": "/srv/cache"}, ("bind", "/srv/cache"))):
        services = compose_config(env=env)["services"]
        for name in PAIRS["gpu"]:
            cache = [v for v in services[name]["volumes"] if v["target"] == "/cache"]
            assert [(v["type"], v["source"]) for v in cache] == [want], (name, env)


def test_build_targets_exist_in_their_dockerfiles(config: dict) -> None:
    for name, svc in config["services"].items():
        build = svc.get("build")
        if not build:
            continue
        dockerfile = Path(build["context"]) / build["dockerfile"]
        assert dockerfile.is_file(), f"{name}: {dockerfile}"
        if "target" in build:
            stages = {
                line.split()[-1].lower()
                for line in dockerfile.read_text().splitlines()
                if line.upper().startswith("FROM ") and " AS " in line.upper()
            }
            assert build["target"] in stages, f"{name}: target {build['target']} not in {stages}"


def test_compose_config_rejects_an_invalid_file(compose_bin: str, tmp_path: Path) -> None:
    """Negative control: the validator really checks the compose schema."""
    bad = tmp_path / "compose.yaml"
    bad.write_text("services:\n  x:\n    image: busybox:1.36\n    ipc_mode: host\n")
    proc = run_tool([compose_bin, "-f", str(bad), "config", "-q"], check=False)
    assert proc.returncode != 0
    assert "ipc_mode" in proc.stderr
