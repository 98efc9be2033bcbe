"""The launcher's plan (what `vime up` starts, on which ports, from which config) and the example
configs: the seed scenario's numbers, the CPU default's shape, the default choice per host."""

from __future__ import annotations

import io
import socket
import stat
from pathlib import Path

import pytest
import yaml
from rich.console import Console

from vime import cli
from vime.config import load_config
from vime.launch.defaults import EXAMPLES_DIR, default_config_name
from vime.launch.stack import busy_ports, config_document, latest_config, plan_stack, write_config
from vime.launch.up import print_banner


def _cfg(tmp_path: Path, *extra: str):  # type: ignore[no-untyped-def]
    return load_config(
        overrides=[
            f"output_dir={tmp_path / 'runs'}",
            "rollout_num_gpus=0",
            "rollout_num_engines_cpu=2",
            "actor_num_gpus_per_node=0",
            "tensor_model_parallel_size=1",
            "engine.base_port=30100",
            *extra,
        ]
    )


def test_plan_starts_private_redis_and_services_in_dependency_order(tmp_path: Path) -> None:
    plan = plan_stack(_cfg(tmp_path))
    assert plan.run_id and plan.run_dir == tmp_path / "runs" / plan.run_id
    assert plan.redis_port is not None
    assert plan.cfg.services.redis_url == f"redis://127.0.0.1:{plan.redis_port}/0"
    names = [s.name for s in plan.services]
    assert names == ["router", "reward", "rollout", "trainer"]
    for i, spec in enumerate(plan.services):  # every dependency is listed before its dependant
        assert set(spec.after) <= set(names[:i])
    assert plan.service("rollout").after == ("router", "reward")
    assert plan.service("trainer").after == ("rollout",)
    # Every child reads the one resolved config file.
    for spec in plan.services:
        assert spec.argv[spec.argv.index("--config") + 1] == str(plan.config_path)
    ports = plan.ports()
    assert ports[18083] == "rollout" and ports[30100] == "rollout" and ports[30101] == "rollout"
    assert ports[plan.redis_port] == "redis" and ports[18081] == "router" and ports[18084] == "trainer"


def test_configured_redis_and_external_services_are_not_started(tmp_path: Path) -> None:
    plan = plan_stack(
        _cfg(
            tmp_path,
            "run_id=fixed",
            "services.redis_url=redis://10.0.0.5:6379/0",
            "services.reward_url=http://reward.internal:9000",
        )
    )
    assert plan.run_id == "fixed" and plan.redis_port is None
    reward = plan.service("reward")
    assert reward.external and reward.url == "http://reward.internal:9000"
    assert not plan.service("router").external
    assert "redis" not in plan.ports().values() and "reward" not in plan.ports().values()


def test_written_config_loads_back_to_the_same_config_without_the_token(tmp_path: Path) -> None:
    plan = plan_stack(
        _cfg(tmp_path, "services.api_token=s3cret", "trainer.lr=0.001", "num_steps_per_rollout=2")
    )
    path = write_config(plan)
    text = path.read_text()
    assert "s3cret" not in text
    doc = yaml.safe_load(text)
    assert "dp_size" not in doc and "num_engines" not in doc  # derived values are derived again
    back = load_config(path)
    expected = plan.cfg.model_dump()
    expected["services"]["api_token"] = None
    assert back.model_dump() == expected
    assert back.run_id == plan.run_id and back.services.redis_url == plan.cfg.services.redis_url
    assert config_document(back) == doc


def _banner(plan: object) -> str:
    buf = io.StringIO()
    print_banner(plan, Console(file=buf, width=400))  # type: ignore[arg-type]
    return buf.getvalue()


def test_a_stack_with_no_token_gets_one_generated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 17: no stack comes up open. The token is new per stack, reaches the children (the plan's
    config, which the supervisor exports as VIME_API_TOKEN), is printed once and kept 0600 beside the
    resolved config, never in it; `vime status` / `vime rollout` find it there."""
    monkeypatch.delenv("VIME_API_TOKEN", raising=False)
    plan = plan_stack(_cfg(tmp_path, "run_id=one"))
    token = plan.cfg.services.token()
    assert plan.token_generated and token is not None and len(token) >= 32
    assert plan_stack(_cfg(tmp_path, "run_id=two")).cfg.services.token() != token
    config_path = write_config(plan)
    token_file = plan.run_dir / "api_token"
    assert token_file.read_text().strip() == token
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert token not in config_path.read_text()
    assert _banner(plan).count(token) == 1
    assert cli._client_config(config_path, None).services.token() == token
    assert (
        cli._client_config(None, [f"output_dir={tmp_path / 'runs'}"]).services.token() == token
    )  # runs/latest
    monkeypatch.setenv("VIME_API_TOKEN", "mine")  # a token given to the client wins over the file
    assert cli._client_config(config_path, None).services.token() == "mine"


def test_a_configured_token_or_insecure_generates_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VIME_API_TOKEN", raising=False)
    given = plan_stack(_cfg(tmp_path, "run_id=given", "services.api_token=s3cret"))
    assert not given.token_generated and given.cfg.services.token() == "s3cret"
    write_config(given)
    assert not (given.run_dir / "api_token").exists() and "s3cret" not in _banner(given)
    monkeypatch.setenv("VIME_API_TOKEN", "from-env")
    assert plan_stack(_cfg(tmp_path, "run_id=env")).cfg.services.token() == "from-env"
    monkeypatch.delenv("VIME_API_TOKEN")
    open_plan = plan_stack(cli._launch_config(EXAMPLES_DIR / "cpu.yaml", [f"output_dir={tmp_path}"], True))
    assert open_plan.cfg.services.insecure and open_plan.cfg.services.token() is None
    assert not open_plan.token_generated and "insecure" in _banner(open_plan)
    write_config(open_plan)
    assert not (open_plan.run_dir / "api_token").exists()
    assert load_config(open_plan.config_path).services.insecure  # the children serve open, as asked


def test_latest_points_at_the_newest_stack(tmp_path: Path) -> None:
    first = plan_stack(_cfg(tmp_path, "run_id=one"))
    second = plan_stack(_cfg(tmp_path, "run_id=two"))
    assert latest_config(tmp_path / "runs") is None
    write_config(first)
    assert latest_config(tmp_path / "runs") == tmp_path / "runs" / "latest" / "config.yaml"
    assert load_config(latest_config(tmp_path / "runs")).run_id == "one"
    write_config(second)
    assert load_config(latest_config(tmp_path / "runs")).run_id == "two"


def test_busy_ports_names_the_owner() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        plan = plan_stack(load_config(overrides=[f"services.reward_port={port}"]))
        assert f"port {port} (reward) is already in use" in busy_ports(plan)
    assert not any(str(port) in c for c in busy_ports(plan))


@pytest.mark.parametrize(
    ("gpus", "vllm", "name"),
    [(0, False, "cpu.yaml"), (0, True, "cpu.yaml"), (8, False, "cpu.yaml"), (1, True, "gpu-1.yaml"),
     (8, True, "gpu-1.yaml")],
)  # fmt: skip
def test_default_config_per_host(gpus: int, vllm: bool, name: str) -> None:
    assert default_config_name(gpus, vllm) == name
    assert (EXAMPLES_DIR / name).is_file()


def test_seed_example_has_the_seed_numbers() -> None:
    cfg = load_config(EXAMPLES_DIR / "seed-8gpu.yaml")
    assert (cfg.rollout_batch_size, cfg.n_samples_per_prompt, cfg.global_batch_size) == (32, 8, 256)
    assert (cfg.tensor_model_parallel_size, cfg.dp_size, cfg.train_world_size) == (2, 4, 8)
    assert (cfg.num_engines, cfg.rollout_num_gpus_per_engine) == (4, 2)
    assert cfg.rollout_concurrency == 2048 and cfg.num_microbatches_per_step == 8
    assert (cfg.rollout_max_prompt_len, cfg.rollout_max_response_len, cfg.rollout_max_context_len) == (
        512,
        1024,
        4096,
    )
    assert cfg.colocate and cfg.offload_rollout and cfg.eps_clip_high == 0.2


def test_gpu_default_is_the_cpu_run_colocated_on_one_gpu() -> None:
    one = load_config(EXAMPLES_DIR / "gpu-1.yaml")
    assert one.rollout_num_gpus == one.train_world_size == 1 and one.num_engines == 1 and one.colocate
    assert one.offload_rollout and one.engine.backend == "vllm" and one.model.hf_checkpoint is None
    cpu = load_config(EXAMPLES_DIR / "cpu.yaml")
    same = (
        "rollout_batch_size",
        "n_samples_per_prompt",
        "global_batch_size",
        "num_rollout",
        "rollout_temperature",
    )
    assert [getattr(one, k) for k in same] == [getattr(cpu, k) for k in same]
    assert one.trainer.lr == cpu.trainer.lr and one.trainer.sft_warmup_steps == cpu.trainer.sft_warmup_steps


def test_cpu_default_needs_no_gpu_and_learns_the_synthetic_task() -> None:
    cfg = load_config(EXAMPLES_DIR / "cpu.yaml")
    assert cfg.rollout_num_gpus == 0 and cfg.actor_num_gpus_per_node == 0
    assert cfg.engine.backend == "reference" and cfg.model.hf_checkpoint is None
    assert cfg.data.prompt_data is None and cfg.reward.rm_type == "arithmetic"
    assert cfg.trainer.sft_warmup_steps > 0
    # No fixed run id: every `vime train` gets its own run directory.
    assert cfg.run_id is None and cfg.services.redis_url is None


def test_the_resume_hint_names_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    from vime.launch.train import resume_hint

    plan = plan_stack(_cfg(tmp_path, "run_id=r1", f"trainer.checkpoint_dir={tmp_path / 'ckpt'}"))
    assert resume_hint(plan, "vime train --resume r1") is None  # no run began: nothing to say
    plan.run_dir.mkdir(parents=True)
    (plan.run_dir / "events.jsonl").write_text("")
    assert "left no checkpoint to resume from" in (resume_hint(plan, "vime train --resume r1") or "")
    for k, complete in ((4, True), (9, True), (14, False)):  # rollout 14's save was cut short
        d = tmp_path / "ckpt" / "r1" / f"rollout_{k:07d}"
        d.mkdir(parents=True)
        if complete:
            (d / "vime_state.json").write_text("{}")
    hint = resume_hint(plan, "vime train --resume r1")
    assert hint == "resume from the checkpoint of rollout 9:  vime train --resume r1"
