"""The run configs deploy/ mounts load as RunConfig, with the seed's numbers on the GPU host, and
the environment the deployments inject names real config fields and the right addresses.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from deploy_support import ROOT, ComposeConfig

from vime.config import load_config

CONFIG = ROOT / "deploy" / "config"


def test_gpu_config_derives_the_seed_numbers() -> None:
    cfg = load_config(CONFIG / "gpu.yaml", environ={})
    assert cfg.global_batch_size == 256
    assert cfg.num_microbatches_per_step == 8
    assert cfg.num_engines == 4
    assert cfg.rollout_concurrency == 2048  # the seed's semaphore
    assert cfg.colocate and cfg.train_world_size == cfg.rollout_num_gpus == 8
    assert cfg.engine.backend == "vllm"
    assert (cfg.output_dir, cfg.trainer.checkpoint_dir) == ("/runs", "/checkpoints")


def test_cpu_config_runs_without_gpus() -> None:
    cfg = load_config(CONFIG / "cpu.yaml", environ={})
    assert (cfg.rollout_num_gpus, cfg.actor_num_gpus_per_node) == (0, 0)
    assert cfg.engine.backend == "reference"
    assert cfg.num_engines == 2 and cfg.dp_size == 1
    assert cfg.global_batch_size == 32


def test_shared_services_read_the_same_sections_under_both_profiles() -> None:
    """router and reward mount gpu.yaml under either profile; their sections must not differ."""
    gpu = yaml.safe_load((CONFIG / "gpu.yaml").read_text())
    cpu = yaml.safe_load((CONFIG / "cpu.yaml").read_text())
    for section in ("reward", "router", "services"):
        assert gpu.get(section) == cpu.get(section), section


def _compose_env(config: dict, service: str) -> dict[str, str]:
    return {k: str(v) for k, v in config["services"][service]["environment"].items()}


def test_compose_env_resolves_every_service_address(compose_config: ComposeConfig) -> None:
    config = compose_config()
    for service in ("router", "reward", "rollout", "trainer"):
        cfg = load_config(CONFIG / "gpu.yaml", environ=_compose_env(config, service))
        assert cfg.services.host == "0.0.0.0"
        assert cfg.services.url("router") == "http://router:18080"
        assert cfg.services.url("router_control") == "http://router:18081"
        assert cfg.services.url("reward") == "http://reward:18082"
        assert cfg.services.url("rollout") == "http://rollout:18083"
        assert cfg.services.url("trainer") == "http://trainer:18084"
        assert cfg.services.redis_url == "redis://redis:6379/0"
    rollout = load_config(CONFIG / "gpu.yaml", environ=_compose_env(config, "rollout"))
    assert rollout.engine.host == "rollout"


def test_chart_env_names_real_config_fields(default_manifests: list, tmp_path: Path) -> None:
    (cm,) = [m for m in default_manifests if m["kind"] == "ConfigMap"]
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(cm["data"]["run.yaml"])
    pod = next(
        m["spec"]["template"]["spec"]
        for m in default_manifests
        if m["kind"] == "Deployment" and m["metadata"]["name"] == "vime-colocated"
    )
    for container in pod["containers"]:
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        env = {k: v.replace("$(POD_IP)", "10.0.0.7") for k, v in env.items()}
        cfg = load_config(run_yaml, environ=env | {"VIME_API_TOKEN": "t"})
        assert cfg.services.url("rollout") == "http://127.0.0.1:18083"
        assert cfg.services.url("trainer") == "http://vime-trainer:18084"
        assert cfg.services.url("router_control") == "http://vime-router-control:18081"
        assert cfg.services.redis_url == "redis://vime-redis:6379/0"
        if container["name"] == "rollout":
            assert cfg.engine.host == "10.0.0.7"
