"""What a run request (``POST /v1/runs``) may change: only what the trainer applies to its run.

The rollout manager, reward service, router and engines read their config once, at start; a run
request that changed one of their fields (``n_samples_per_prompt``, ``rollout_batch_size``,
``micro_batch_size``, ``data``, ``reward``, ...) would leave the trainer's config describing
batches it never gets, so such a field is refused with a 422 naming it. Output paths stay under
the service's own (``output_dir``, ``trainer.checkpoint_dir``), and every number is bounded.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from vime.config import RunConfig, TrainerConfig
from vime.service import ServiceError
from vime.wire.bounds import MAX_ID
from vime.wire.trainer import RUN_ID_PATTERN

RUN_FIELDS = frozenset(
    {
        "run_id",
        "output_dir",
        "num_rollout",
        "start_rollout_id",
        "save_interval",
        "eval_interval",
        "log_tensorboard",
        "log_wandb",
        "advantage_estimator",
        "kl_coef",
        "entropy_coef",
        "eps_clip",
        "eps_clip_high",
        "eps_clip_c",
        "flush_cache_interval",
        "offload_train",
        "mode",
        "max_staleness",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "actor_num_nodes",
        "actor_num_gpus_per_node",
        "actor_num_cpu_ranks",
    }
)
"""Top-level fields only the trainer reads (``offload_train``: whether its sleep copies its state
to the host or leaves it on the GPU; the DP size they give reaches the rollout manager with
each request, which refuses one that does not split its batches; ``max_staleness`` reaches its async
producer when the run starts it), and ``mode``, which the rollout manager reads at its start: a run
may name it only as that (409 otherwise, `runs.check_mode`)."""
SECTION_FIELDS: dict[str, frozenset[str]] = {
    "trainer": frozenset(TrainerConfig.model_fields) - {"weight_dir"},
    "services": frozenset({"rollout_url"}),
    "engine": frozenset({"weight_load"}),
}
"""Section fields the run applies: the trainer's (not ``weight_dir``, which the engines read too),
where its rollout client goes, and how its pushes load weights (``direct`` needs the engines'
extension, which the rollout manager loads at start; engines without it are refused and get
vLLM's loader)."""
CONFINED_PATHS = ("output_dir", "trainer.checkpoint_dir")


def _leaves(config: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, dotted + ".")
        else:
            yield dotted, value


def _applied(dotted: str) -> bool:
    section, _, field = dotted.partition(".")
    if not field:
        return section in RUN_FIELDS or section in SECTION_FIELDS
    return field in SECTION_FIELDS.get(section, frozenset())


def _inside(path: str, root: str) -> bool:
    return Path(path).resolve().is_relative_to(Path(root).resolve())


def check_overrides(config: Mapping[str, Any], base: RunConfig) -> None:
    """422 naming every field of ``config`` the run would not apply, an output path outside the
    service's configured root, or a number beyond `MAX_ID`."""
    leaves = dict(_leaves(config))
    refused = sorted(k for k in leaves if not _applied(k))
    if refused:
        raise ServiceError(
            422,
            f"config: {', '.join(refused)} cannot change per run: the rollout manager, reward service "
            "and router apply their config at start (set it there); a run may change the trainer's "
            f"fields ({', '.join(sorted(RUN_FIELDS))}, trainer.*, services.rollout_url)",
            fields=refused,
        )
    run_id = leaves.get("run_id")
    if run_id is not None and not (isinstance(run_id, str) and re.fullmatch(RUN_ID_PATTERN, run_id)):
        raise ServiceError(
            422, f"config.run_id: {run_id!r} is not a run id ({RUN_ID_PATTERN})", field="run_id"
        )
    roots = {"output_dir": base.output_dir, "trainer.checkpoint_dir": base.trainer.checkpoint_dir}
    for name in CONFINED_PATHS:
        value = leaves.get(name)
        if isinstance(value, str) and not _inside(value, roots[name]):
            raise ServiceError(
                422, f"config.{name}: {value!r} is outside the service's {name} {roots[name]!r}", field=name
            )
    for name, value in leaves.items():
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_ID:
            raise ServiceError(422, f"config.{name}: {value} is out of range (|n| <= {MAX_ID})", field=name)
