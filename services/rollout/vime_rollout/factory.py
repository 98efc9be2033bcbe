"""Building a rollout manager from the run config: model, datasets, engines, clients, batch sink.

Engines start before the REST app serves its first request (seed step 2); with
``offload_rollout`` they are put to sleep right away, as the seed's engines sleep while Megatron
initialises — the trainer wakes their weights, pushes, then wakes the KV cache (steps 4–13).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from vime.clients.reward import RewardClient
from vime.config import RunConfig
from vime.models import policy_model_path
from vime.wire.rollout import OFFLOAD_LEVEL
from vime_rollout.batch_builder import BatchSink
from vime_rollout.data import DataSource, PromptDataset, build_dataset, read_records
from vime_rollout.data.dataset import Tokenizer
from vime_rollout.data.synthetic import arithmetic_records
from vime_rollout.engines.commands import engine_command
from vime_rollout.engines.control import engine_control
from vime_rollout.engines.gate import CONTAINER_DIR, behind_gates
from vime_rollout.engines.group import EngineGroup
from vime_rollout.engines.health import HealthMonitor
from vime_rollout.engines.launchers import DockerLauncher, ExternalLauncher, Launcher, LocalLauncher
from vime_rollout.engines.router_registry import router_registry
from vime_rollout.engines.spec import plan_engines
from vime_rollout.manager import RolloutManager
from vime_rollout.model import load_tokenizer, served_model_name
from vime_rollout.rollout.transport import RouterGenerator
from vime_rollout.scorer import RewardScorer
from vime_rollout.sft import sft_stream_run_id

log = logging.getLogger("vime.rollout")

SYNTHETIC_EVAL_PROMPTS = 64


def build_datasets(cfg: RunConfig, tokenizer: Tokenizer) -> tuple[PromptDataset, dict[str, PromptDataset]]:
    """The training dataset and the eval datasets (a held-out synthetic set for the synthetic task)."""
    d = cfg.data

    def build(name: str, records: Iterable[dict[str, Any]]) -> PromptDataset:
        return build_dataset(
            name,
            records,
            tokenizer,
            input_key=d.input_key,
            label_key=d.label_key,
            metadata_key=d.metadata_key,
            apply_chat_template=d.apply_chat_template,
            max_prompt_len=cfg.rollout_max_prompt_len,
        )

    if d.prompt_data:
        train = build(Path(d.prompt_data).name, read_records(d.prompt_data))
    else:
        train = build("arithmetic", arithmetic_records(d.synthetic_num_prompts, cfg.rollout_seed))
    evals = {name: build(name, read_records(path)) for name, path in d.eval_prompt_data.items()}
    if not evals and not d.prompt_data:
        held_out = arithmetic_records(SYNTHETIC_EVAL_PROMPTS, cfg.rollout_seed + 1_000_003)
        evals["arithmetic"] = build("arithmetic", held_out)
    if train.num_dropped_too_long:
        log.warning(
            "%s: %d prompts longer than %d tokens dropped",
            train.name,
            train.num_dropped_too_long,
            cfg.rollout_max_prompt_len,
        )
    return train, evals


def make_launcher(cfg: RunConfig, run_id: str, model_path: Path, log_dir: Path) -> Launcher:
    if cfg.engine.launcher == "external":
        return ExternalLauncher()
    if cfg.engine.launcher == "docker":
        return DockerLauncher(run_id, str(model_path), log_dir, cfg.engine.image, cfg.services.token())
    return LocalLauncher(log_dir, cfg.services.token())


async def build_manager(cfg: RunConfig, *, log_dir: Path | None = None) -> RolloutManager:
    """Everything the rollout manager needs, engines started (and asleep when offloaded)."""
    run_id = cfg.effective_run_id()  # names the Redis stream; every job reply carries it
    specs = plan_engines(cfg)  # a config that cannot place its engines fails before anything is built
    if cfg.engine.launcher != "external":  # each local or container engine behind its gate
        specs = behind_gates(specs, CONTAINER_DIR if cfg.engine.launcher == "docker" else None)
    token = cfg.services.token()  # opens the engines' gates
    model_path = await asyncio.to_thread(policy_model_path, cfg)
    model_name = served_model_name(cfg, model_path)
    tokenizer = await asyncio.to_thread(load_tokenizer, model_path)
    train, evals = await asyncio.to_thread(build_datasets, cfg, tokenizer)
    log_dir = log_dir or Path(cfg.output_dir) / run_id / "logs"
    group = EngineGroup(
        specs,
        make_launcher(cfg, run_id, model_path, log_dir),
        lambda spec: engine_command(cfg, spec, str(model_path), model_name),
        lambda url: engine_control(url, token),
        router_registry(cfg),
        startup_timeout_s=cfg.engine.startup_timeout_s,
    )
    log.info("starting %d %s engine(s)", len(specs), specs[0].backend if specs else "-")
    try:
        await group.start()
    except BaseException:
        await group.stop()
        raise
    monitor = HealthMonitor(
        group,
        interval_s=cfg.engine.health_check_interval_s,
        failure_threshold=cfg.engine.health_failure_threshold,
        timeout_s=cfg.engine.health_check_timeout_s,
    )
    if cfg.offload_rollout:
        monitor.pause("offload")
        await group.offload(OFFLOAD_LEVEL)
    monitor.start()
    log.info("generate requests go to %s on every engine", group.generate_path)
    services = cfg.services
    waited = cfg.reward.request_timeout_s
    reward = RewardClient(
        services.url("reward"), token=services.token(), timeout=waited, retry_budget_s=waited
    )
    redis_url = services.redis_url
    return RolloutManager(
        cfg,
        run_id=run_id,
        tokenizer=tokenizer,
        model_name=model_name,
        engines=group,
        monitor=monitor,
        generator=RouterGenerator(
            services.url("router"),
            path=group.generate_path,
            timeout_s=cfg.router.request_timeout_s,
            retry_window_s=cfg.router.retry_window_s,
        ),
        scorer=RewardScorer(
            reward,
            fn=cfg.reward.custom_rm_path,
            group_rm=cfg.reward.group_rm,
            stall_warning_s=cfg.reward.stall_warning_s,
            timeout_s=waited,
        ),
        train_data=DataSource(
            train, cfg.n_samples_per_prompt, shuffle=cfg.data.rollout_shuffle, seed=cfg.rollout_seed
        ),
        eval_data=evals,
        sink=BatchSink(redis_url, run_id) if redis_url else None,
        sft_sink=BatchSink(redis_url, sft_stream_run_id(run_id)) if redis_url else None,
    )
