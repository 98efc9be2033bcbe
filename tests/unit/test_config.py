"""Run config: the seed's derivations (step 1), refusals with actionable messages, sources."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vime.config import ConfigError, load_config


def test_seed_scenario_derivations() -> None:
    cfg = load_config()
    assert cfg.rollout_batch_size == 32 and cfg.n_samples_per_prompt == 8
    assert cfg.global_batch_size == 32 * 8 // 1 == 256
    assert cfg.eps_clip_high == cfg.eps_clip == 0.2
    assert cfg.over_sampling_batch_size == 32
    assert cfg.num_engines == 8 // 2 == 4
    assert cfg.rollout_concurrency == 512 * 4 == 2048
    assert cfg.dp_size == 8 // 2 == 4
    assert cfg.num_microbatches_per_step == 256 // (8 * 4) == 8
    assert cfg.offload_rollout is True and cfg.offload_train is True


def test_four_steps_per_rollout() -> None:
    cfg = load_config(overrides=["num_steps_per_rollout=4"])
    assert cfg.global_batch_size == 64
    assert cfg.num_microbatches_per_step == 2


def test_a_token_budget_replaces_the_micro_batch_size() -> None:
    cfg = load_config(overrides=["max_tokens_per_gpu=8192", "micro_batch_size=48"])  # 48 × 4 ∤ 256: unused
    assert cfg.max_tokens_per_gpu == 8192 and cfg.num_microbatches_per_step is None


def test_explicit_values_are_kept() -> None:
    cfg = load_config(overrides=["eps_clip_high=0.28", "over_sampling_batch_size=64", "colocate=false"])
    assert cfg.eps_clip_high == 0.28
    assert cfg.over_sampling_batch_size == 64
    assert cfg.offload_rollout is False


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["num_steps_per_rollout=3"], "choose a num_steps_per_rollout that divides 256"),
        (["tensor_model_parallel_size=3"], "does not divide the 8 training ranks"),
        (["rollout_num_gpus_per_engine=3"], "engines need whole GPU sets"),
        (["rollout_max_context_len=1000"], "raise the context or shorten prompts/responses"),
        (["micro_batch_size=48"], "not a multiple of micro_batch_size × DP size"),
        (["rollout_num_gpus=4"], "make them equal or set colocate=false"),
        (["use_critic=false"], "use_critic: Extra inputs are not permitted"),  # not offered
        (["advantage_estimator=gspo"], "advantage_estimator: Input should be 'grpo'"),
        (["loss_type=policy_loss"], "loss_type: Extra inputs are not permitted"),
        (["trainer.backend=megatron"], "trainer.backend: Extra inputs are not permitted"),
        (["rollout_temperature=0"], "rollout_temperature=0.0 is greedy decoding"),
        (["rollout_temperature=0.000001"], "set rollout_temperature > 0 (data.eval_temperature=0"),
        (["bogus_field=1"], "bogus_field: Extra inputs are not permitted"),
        (["rollout_batch_size=0"], "rollout_batch_size"),
        (["router.policy=random"], "router.policy"),
        (["trainer.packed_sequences=true", "trainer.use_sdpa=false"], "packed_sequences needs use_sdpa=true"),
        (["max_tokens_per_gpu=4096", "actor_num_gpus_per_node=6"], "not a multiple of DP size = 3"),
        (["max_tokens_per_gpu=0"], "max_tokens_per_gpu"),
        (["mode=async"], "trainer.gpu_memory_utilization=None must be set and at most 1"),
        (["mode=async", "trainer.gpu_memory_utilization=0.6"], "must be set and at most 1"),
        (["mode=async", "colocate=false", "offload_train=true"], "keeps the engines and the trainer awake"),
        (["mode=fully_async"], "mode: Input should be 'sync' or 'async'"),
        (["mode=async", "max_staleness=0"], "max_staleness"),
    ],
)
def test_impossible_configs_are_refused(overrides: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    assert fragment in str(info.value)


def test_async_mode_keeps_everything_awake_and_splits_shared_gpus() -> None:
    cfg = load_config(overrides=["mode=async", "trainer.gpu_memory_utilization=0.45"])
    assert (cfg.offload_rollout, cfg.offload_train, cfg.max_staleness, cfg.inflight_update) == (
        False,
        False,
        1,
        "keep",
    )
    sync = load_config()
    assert (sync.mode, sync.offload_rollout, sync.offload_train) == ("sync", True, True)  # the seed's


def test_greedy_is_for_evaluation_only() -> None:
    cfg = load_config(overrides=["rollout_temperature=0.7", "data.eval_temperature=0"])
    assert (cfg.rollout_temperature, cfg.data.eval_temperature) == (0.7, 0.0)


def test_sources_precedence(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("rollout_batch_size: 16\nreward:\n  timeout_s: 3\n  rm_type: gsm8k\n")
    env = {"VIME_ROLLOUT_BATCH_SIZE": "8", "VIME_REWARD__TIMEOUT_S": "4", "VIME_UNRELATED": "x"}
    cfg = load_config(path, ["reward.timeout_s=5"], environ=env)
    assert cfg.rollout_batch_size == 8  # env beats YAML
    assert cfg.reward.timeout_s == 5  # CLI beats env
    assert cfg.reward.rm_type == "gsm8k"  # YAML beats default
    assert cfg.global_batch_size == 8 * 8


def test_bad_files_and_overrides(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not key=value"):
        load_config(overrides=["rollout_batch_size"])


def test_cli_config_show_prints_derived_values() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "vime", "config", "show", "--set", "num_steps_per_rollout=4"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    shown = json.loads(out)
    assert shown["global_batch_size"] == 64
    assert shown["rollout_concurrency"] == 2048
    assert shown["num_engines"] == 4
    assert shown["eps_clip_high"] == 0.2


def test_cli_config_show_refuses_with_exit_code_2() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "vime", "config", "show", "--set", "tensor_model_parallel_size=3"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "does not divide" in proc.stderr


def test_auto_transport_is_ipc_and_auto_load_direct_only_for_colocated_one_gpu_engines() -> None:
    cpu = ["rollout_num_gpus=0", "actor_num_gpus_per_node=0", "tensor_model_parallel_size=1"]

    def pick(*o: str) -> tuple[str, str]:
        cfg = load_config(overrides=list(o), environ={})
        return cfg.weight_transport, cfg.engine.weight_load

    assert pick(*cpu) == ("shm", "vllm")
    assert pick("rollout_num_gpus=8", "actor_num_gpus_per_node=8") == (
        "ipc",
        "vllm",
    )  # the seed: TP=2 engines
    one_gpu = ["rollout_num_gpus=8", "actor_num_gpus_per_node=8", "rollout_num_gpus_per_engine=1"]
    assert pick(*one_gpu) == ("ipc", "direct")
    assert pick(*one_gpu, "colocate=false") == ("shm", "vllm")
    assert pick(*one_gpu, "engine.weight_load=vllm") == ("ipc", "vllm")
    assert pick(*cpu, "trainer.weight_transport=ipc") == (
        "ipc",
        "vllm",
    )  # a reference engine: one per TP group
    assert pick(*cpu, "rollout_num_gpus_per_engine=1", "trainer.weight_transport=ipc") == ("ipc", "direct")
    assert pick(*cpu, "engine.weight_load=direct") == ("shm", "direct")
