"""The run configuration: one pydantic model for the whole run.

Top-level fields keep the seed's argument names (``rollout_batch_size``, ``eps_clip``, ...) so a
command line from the seed translates one to one (``--set rollout_batch_size=32``). Deployment
details are grouped in nested sections by the service that uses them (``reward``, ``router``,
``engine``, ``services``, ``data``, ``trainer``; `vime.config_sections`, re-exported here). Every
service loads and checks the whole config, so one file configures the stack and a mistake in any
section stops every service at start. Only what the code implements is offered: GRPO, the policy
loss, no critic (the seed's other estimators and losses are not fields or values here).

Sources, later wins: field defaults < YAML file < environment (``VIME_<FIELD>``, nested with
``__``: ``VIME_REWARD__TIMEOUT_S=5``) < ``--set key=value`` overrides (dotted for nested keys).
The derivations of seed step 1 run after loading, and impossible combinations are refused with a
message that says what to change.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, computed_field, model_validator

from vime.algorithms.schedule import step_multiple
from vime.config_sections import (
    DataConfig,
    EngineConfig,
    ModelConfig,
    RewardConfig,
    RouterConfig,
    Section,
    ServicesConfig,
    TrainerConfig,
)

__all__ = [
    "ConfigError",
    "DataConfig",
    "EngineConfig",
    "ModelConfig",
    "RewardConfig",
    "RouterConfig",
    "RunConfig",
    "Section",
    "ServicesConfig",
    "TrainerConfig",
    "env_overrides",
    "load_config",
    "parse_overrides",
]

ENV_PREFIX = "VIME_"
GREEDY_TEMPERATURE = 1e-5
"""vLLM's ``_SAMPLING_EPS``: a sampling temperature below it means greedy decoding."""


class RunConfig(Section):
    """Everything one run needs. Field names follow the seed's argument names."""

    run_id: str | None = None
    """Run identifier (runs/<run_id>/, the Redis stream of batches); None: see effective_run_id."""
    output_dir: str = "runs"
    """Where run records (metrics.jsonl, report.png) go."""

    # --- rollout (seed steps 14-32) -------------------------------------------------------
    rollout_batch_size: int = Field(32, ge=1)
    """Prompts per rollout."""
    n_samples_per_prompt: int = Field(8, ge=1)
    """Samples (the GRPO group) per prompt."""
    over_sampling_batch_size: int | None = Field(None, ge=1)
    """Prompts fetched per re-sampling round when a filter drops groups; defaults to rollout_batch_size."""
    rollout_max_prompt_len: int = Field(512, ge=1)
    """Longer prompts are dropped when the dataset is built."""
    rollout_max_response_len: int = Field(1024, ge=1)
    """Largest number of response tokens per sample (max_new_tokens)."""
    rollout_max_context_len: int = Field(4096, ge=2)
    """Engine context length (vLLM max_model_len)."""
    rollout_temperature: float = Field(1.0, ge=0)
    """Sampling temperature of training rollouts (> 0); the trainer's log-probs are of logits / it."""
    rollout_top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling."""
    rollout_top_k: int = Field(-1, ge=-1)
    """Top-k sampling; -1 disables (and is sent, as in seed step 19); 0 is not sent."""
    rollout_stop: list[str] = Field(default_factory=list)
    """Stop strings (omitted from the request when empty)."""
    rollout_stop_token_ids: list[int] = Field(default_factory=list)
    """Stop token ids (omitted from the request when empty)."""
    rollout_skip_special_tokens: bool = False
    """Skip special tokens when decoding response text."""
    rollout_seed: int = 42
    """Seed for data shuffling and sampling."""
    rollout_num_gpus: int = Field(8, ge=0)
    """GPUs used by inference engines (0 on CPU hosts: one reference engine per rollout_num_gpus_per_engine)."""
    rollout_num_gpus_per_engine: int = Field(2, ge=1)
    """GPUs per engine (its tensor-parallel size)."""
    rollout_num_engines_cpu: int = Field(2, ge=1)
    """Engines started on a host without GPUs (reference engines)."""
    vllm_server_concurrency: int = Field(512, ge=1)
    """In-flight requests per engine; the rollout semaphore is this × engines (seed step 18)."""
    dynamic_sampling_filter_path: str | None = None
    """Import path of a group filter (e.g. vime_rollout.filters:check_reward_nonzero_std)."""
    partial_rollout: bool = False
    """Return aborted samples to the data source and continue them next rollout."""
    score_centering_top_k: int | None = Field(None, ge=0)
    """Request top-(k+1) log-probs for score centering; None requests 1 (seed step 19)."""
    rollout_logprobs_fraction: float = Field(0.0, ge=0, le=1)
    """Fraction of groups that request rollout log-probs purely to monitor train/inference mismatch."""

    # --- training (seed steps 37-42) -------------------------------------------------------
    num_rollout: int = Field(100, ge=1)
    """Rollouts (= outer steps) in the run."""
    start_rollout_id: int | None = Field(None, ge=0)
    """First rollout id; None resumes from the newest checkpoint (or 0)."""
    num_steps_per_rollout: int | None = Field(1, ge=1)
    """Optimizer steps per rollout; derives global_batch_size (seed step 1)."""
    global_batch_size: int | None = Field(None, ge=1)
    """Samples per optimizer step; derived from num_steps_per_rollout when that is set."""
    micro_batch_size: int = Field(8, ge=1)
    """Samples per micro-batch on each DP rank (unused when max_tokens_per_gpu is set)."""
    max_tokens_per_gpu: int | None = Field(None, ge=1)
    """Cut each DP rank's share of a step into micro-batches by this many tokens (prompt + response,
    a longer sample alone) instead of micro_batch_size samples; every rank runs the same count."""
    advantage_estimator: Literal["grpo"] = "grpo"
    """Advantage estimator: GRPO's group-normalised rewards (seed step 30), the only one implemented."""
    grpo_std_normalization: bool = True
    """Divide group-centred rewards by the group's unbiased std (+1e-6) (seed step 30)."""
    kl_coef: float = Field(0.0, ge=0)
    """KL penalty coefficient against the reference model (0 = no reference model)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus coefficient."""
    eps_clip: float = Field(0.2, gt=0)
    """PPO clip range below 1."""
    eps_clip_high: float | None = Field(None, gt=0)
    """PPO clip range above 1; defaults to eps_clip (seed step 1)."""
    eps_clip_c: float | None = Field(None, gt=1)
    """Dual-clip constant (> 1) for negative advantages; None disables."""
    use_rollout_logprobs: bool = False
    """Use the engine's log-probs as old log-probs instead of recomputing them."""
    get_mismatch_metrics: bool = False
    """Compute train/inference log-prob mismatch metrics (needs rollout log-probs)."""
    use_tis: bool = False
    """Truncated importance sampling: each token's policy-gradient loss is weighted by
    min(exp(train_logprob − rollout_logprob), tis_clip), a constant of the loss, where
    train_logprob is the trainer's log-prob before the update and rollout_logprob the engine's
    (then requested for every sample). Corrects the train/inference mismatch and, in the async
    mode, the staleness of a batch. Off by default, as in slime (--use-tis off, --tis-clip 2.0),
    verl (algorithm.rollout_correction.rollout_is null, threshold 2.0) and AReaL
    (use_decoupled_loss off)."""
    tis_clip: float = Field(2.0, gt=0)
    """The truncation of the TIS weight (slime's and verl's default, 2.0)."""
    use_mis: bool = False
    """Masked importance sampling: the policy-gradient loss of tokens (``mis_level: token``) or of
    whole samples (``sample``) whose ratio exp(train_logprob − rollout_logprob) leaves
    [mis_low, mis_high] is dropped (weight 0); with use_tis the others keep their TIS weight.
    Off by default, as in slime (its MIS is an example, not a flag) and verl (rollout_rs null);
    prime-rl masks by default, but by the probability difference and the advantage's sign, not
    by a ratio band."""
    mis_level: Literal["token", "sample"] = "token"
    """token: each token outside the band is dropped; sample: every token of a sample whose
    geometric-mean ratio exp(mean of its log-ratios) leaves the band (verl's 'geometric' rejection,
    which it runs with a band as narrow as [0.999, 1.001])."""
    mis_low: float = Field(0.5, gt=0)
    """Lower end of the MIS band (slime's MIS example and verl: 1 / 2.0)."""
    mis_high: float = Field(2.0, gt=0)
    """Upper end of the MIS band (slime's MIS example and verl: 2.0)."""
    tensor_model_parallel_size: int = Field(2, ge=1)
    """Megatron tensor parallel size."""
    pipeline_model_parallel_size: int = Field(1, ge=1)
    """Megatron pipeline parallel size."""
    actor_num_nodes: int = Field(1, ge=1)
    """Training nodes."""
    actor_num_gpus_per_node: int = Field(8, ge=0)
    """Training GPUs per node (0 on CPU: actor_num_cpu_ranks ranks over gloo)."""
    actor_num_cpu_ranks: int = Field(1, ge=1)
    """Training ranks on a host without GPUs."""

    # --- the loop: synchronous (the seed's) or fully async ----------------------------------
    mode: Literal["sync", "async"] = "sync"
    """sync: the seed's step, generate → train → push one after the other (colocated, engines and
    trainer sleep in turn). async: the rollout manager generates rollout after rollout into Redis
    while the trainer trains on the newest batch at most ``max_staleness`` weight versions old, and
    each push reaches the engines in flight; nothing sleeps (on shared GPUs the engines and the
    trainer split the memory: engine.gpu_memory_utilization, trainer.gpu_memory_utilization). The
    rollout manager reads it at start; a run may not ask for the other mode."""
    max_staleness: int = Field(1, ge=1)
    """async: a batch is trained only if the trainer's weight version minus the oldest version any
    of its tokens was sampled with is at most this; older ones are dropped (acked, counted, never
    trained). The rollout manager starts a rollout only while fewer than this many batches wait."""
    inflight_update: Literal["keep", "abort"] = "keep"
    """async: what a push does to the requests in flight: ``keep`` pauses them in place (they go on
    with the new weights, their tokens then carry two versions; TIS corrects for it), ``abort``
    stops them, and each continues from its partial output after the push."""

    # --- memory and weight sync (seed steps 33-36, 43-54) ----------------------------------
    colocate: bool = True
    """Trainer and engines share the same GPUs (sync: time-shared through sleep/wake)."""
    offload_rollout: bool | None = None
    """Engines sleep while training; defaults to colocate in the sync mode (never in async)."""
    offload_train: bool | None = None
    """The trainer's parameters, fp32 masters and optimizer state wait in host memory while the
    engines run; defaults to colocate in the sync mode (never in async). False in the synchronous
    colocated step: they stay on the GPU (only gradients, parameters rebuilt from their masters and
    cached blocks are freed), so sleep and wake-up copy nothing; refused at the first sleep when
    that state does not fit beside ``engine.gpu_memory_utilization``."""
    flush_cache_interval: int = Field(1, ge=1)
    """Abort in-flight requests and flush the prefix cache every N weight versions (seed steps 8, 45)."""

    # --- run bookkeeping -------------------------------------------------------------------
    save_interval: int | None = Field(None, ge=1)
    """Checkpoint every N rollouts (None: only at the end and on stop); their files are written in
    the background during the next rollout and completed before the next step trains."""
    eval_interval: int | None = Field(None, ge=1)
    """Evaluate every N rollouts (None: never)."""
    log_tensorboard: bool = False
    """Also write TensorBoard scalars."""
    log_wandb: bool = False
    """Also log to Weights & Biases (needs wandb and an API key)."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Prompt datasets."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """Reward service."""
    router: RouterConfig = Field(default_factory=RouterConfig)
    """Router service."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    """Inference engines."""
    services: ServicesConfig = Field(default_factory=ServicesConfig)
    """Where the services listen and how they authenticate."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """Trainer backend."""

    # --- seed step 1: derivations ----------------------------------------------------------
    @model_validator(mode="after")
    def _derive_and_check(self) -> RunConfig:
        # validate_assignment would re-enter this validator on every assignment below.
        set_ = object.__setattr__
        if self.eps_clip_high is None:
            set_(self, "eps_clip_high", self.eps_clip)
        if self.over_sampling_batch_size is None:
            set_(self, "over_sampling_batch_size", self.rollout_batch_size)
        if self.offload_rollout is None:
            set_(self, "offload_rollout", self.colocate and self.mode == "sync")
        if self.offload_train is None:
            set_(self, "offload_train", self.colocate and self.mode == "sync")
        if self.engine.weight_load == "auto":
            one_gpu_engines = self.rollout_num_gpus_per_engine == 1
            set_(
                self.engine,
                "weight_load",
                "direct" if self.weight_transport == "ipc" and one_gpu_engines else "vllm",
            )
        samples = self.rollout_batch_size * self.n_samples_per_prompt
        if self.num_steps_per_rollout is not None:
            if samples % self.num_steps_per_rollout:
                raise ValueError(
                    f"rollout_batch_size × n_samples_per_prompt = {samples} samples do not split into "
                    f"num_steps_per_rollout={self.num_steps_per_rollout} equal steps: choose a "
                    f"num_steps_per_rollout that divides {samples}"
                )
            set_(self, "global_batch_size", samples // self.num_steps_per_rollout)
        elif self.global_batch_size is None:
            raise ValueError("set num_steps_per_rollout or global_batch_size")
        if (
            (self.get_mismatch_metrics or self.use_tis or self.use_mis)
            and not self.use_rollout_logprobs
            and self.rollout_logprobs_fraction == 0
        ):
            # Mismatch metrics and TIS/MIS need rollout log-probs: ask for them on every sample.
            set_(self, "rollout_logprobs_fraction", 1.0)
        problems = list(self._problems())
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _problems(self) -> Iterable[str]:
        """Impossible combinations, each with what to change."""
        gbs = self.global_batch_size or 0
        samples = self.rollout_batch_size * self.n_samples_per_prompt
        if samples % gbs:
            yield (
                f"global_batch_size={gbs} does not divide the {samples} samples of a rollout "
                f"(rollout_batch_size × n_samples_per_prompt): pick a divisor of {samples}"
            )
        multiple, what = step_multiple(self.micro_batch_size, self.dp_size, self.max_tokens_per_gpu)
        if gbs % multiple:
            yield (
                f"global_batch_size={gbs} is not a multiple of {what}: change micro_batch_size, "
                f"the parallel sizes, or the batch"
            )
        if self.train_world_size % (self.tensor_model_parallel_size * self.pipeline_model_parallel_size):
            yield (
                f"tensor_model_parallel_size × pipeline_model_parallel_size = "
                f"{self.tensor_model_parallel_size * self.pipeline_model_parallel_size} does not divide the "
                f"{self.train_world_size} training ranks: choose parallel sizes that divide it"
            )
        if self.rollout_num_gpus % self.rollout_num_gpus_per_engine:
            yield (
                f"rollout_num_gpus={self.rollout_num_gpus} is not a multiple of "
                f"rollout_num_gpus_per_engine={self.rollout_num_gpus_per_engine}: engines need whole GPU sets"
            )
        if self.rollout_num_gpus and self.rollout_num_gpus < self.rollout_num_gpus_per_engine:
            yield (
                f"rollout_num_gpus={self.rollout_num_gpus} is less than one engine's "
                f"{self.rollout_num_gpus_per_engine} GPUs"
            )
        need = self.rollout_max_prompt_len + self.rollout_max_response_len
        if self.rollout_max_context_len < need:
            yield (
                f"rollout_max_context_len={self.rollout_max_context_len} is shorter than "
                f"rollout_max_prompt_len + rollout_max_response_len = {need}: raise the context or "
                f"shorten prompts/responses"
            )
        if self.colocate and self.actor_num_gpus_per_node and self.rollout_num_gpus != self.train_world_size:
            yield (
                f"colocate shares the GPUs, but rollout_num_gpus={self.rollout_num_gpus} differs from "
                f"the trainer's {self.train_world_size} GPUs: make them equal or set colocate=false"
            )
        yield from self._async_problems()
        if (self.use_tis or self.use_mis) and self.use_rollout_logprobs:
            yield (
                "use_tis/use_mis weight by exp(train_logprob − rollout_logprob), but use_rollout_logprobs "
                "makes the rollout log-probs the old policy (the ratio is then 1): unset one of them"
            )
        if not self.mis_low < 1.0 < self.mis_high:
            yield (
                f"the MIS band [mis_low, mis_high] = [{self.mis_low}, {self.mis_high}] must contain 1 "
                "(a ratio of 1 is an on-policy token): set mis_low < 1 < mis_high"
            )
        if self.rollout_temperature < GREEDY_TEMPERATURE:
            yield (
                f"rollout_temperature={self.rollout_temperature} is greedy decoding: every sample of a "
                "GRPO group would be the same response (all advantages 0) and the trainer's log-probs "
                "of logits / temperature are undefined; set rollout_temperature > 0 "
                "(data.eval_temperature=0 is how to evaluate greedily)"
            )

    def _async_problems(self) -> Iterable[str]:
        if self.mode != "async":
            return
        if self.offload_rollout or self.offload_train:
            yield (
                "mode=async keeps the engines and the trainer awake: set offload_rollout=false and "
                "offload_train=false (or leave them unset)"
            )
        if self.colocate and self.actor_num_gpus_per_node:
            engine, trainer = self.engine.gpu_memory_utilization, self.trainer.gpu_memory_utilization
            if trainer is None or engine + trainer > 1.0:
                yield (
                    f"mode=async on shared GPUs splits their memory: engine.gpu_memory_utilization={engine} "
                    f"+ trainer.gpu_memory_utilization={trainer} must be set and at most 1"
                )

    @property
    def weight_transport(self) -> Literal["ipc", "shm"]:
        """``trainer.weight_transport`` with ``auto`` resolved: ``ipc`` when colocated on GPUs."""
        chosen = self.trainer.weight_transport
        if chosen != "auto":
            return chosen
        return "ipc" if self.colocate and self.actor_num_gpus_per_node > 0 else "shm"

    # --- derived values, shown by `vime config show` ----------------------------------------
    @computed_field  # type: ignore[prop-decorator]
    @property
    def train_world_size(self) -> int:
        """Training ranks: GPUs × nodes on GPU hosts, actor_num_cpu_ranks on CPU hosts."""
        gpus = self.actor_num_gpus_per_node * self.actor_num_nodes
        return gpus if gpus else self.actor_num_cpu_ranks

    @computed_field  # type: ignore[prop-decorator]
    @property
    def dp_size(self) -> int:
        """Data-parallel size = training ranks // (TP × PP)."""
        return max(
            1, self.train_world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)
        )

    @computed_field  # type: ignore[prop-decorator]
    @property
    def num_engines(self) -> int:
        """Inference engines = rollout_num_gpus // rollout_num_gpus_per_engine (CPU: rollout_num_engines_cpu)."""
        if self.rollout_num_gpus == 0:
            return self.rollout_num_engines_cpu
        return self.rollout_num_gpus // self.rollout_num_gpus_per_engine

    @computed_field  # type: ignore[prop-decorator]
    @property
    def rollout_concurrency(self) -> int:
        """vllm_server_concurrency × num_engines: the seed's rollout semaphore (step 18). The
        rollout manager sizes its semaphore by the engines it actually has (external ones included)."""
        return self.vllm_server_concurrency * self.num_engines

    @computed_field  # type: ignore[prop-decorator]
    @property
    def samples_per_rollout(self) -> int:
        """rollout_batch_size × n_samples_per_prompt."""
        return self.rollout_batch_size * self.n_samples_per_prompt

    @computed_field  # type: ignore[prop-decorator]
    @property
    def num_microbatches_per_step(self) -> int | None:
        """Micro-batches per DP rank per optimizer step = global_batch_size // (micro_batch_size × DP);
        None with max_tokens_per_gpu (then each step's count follows its tokens)."""
        if self.max_tokens_per_gpu:
            return None
        return (self.global_batch_size or 0) // (self.micro_batch_size * self.dp_size)

    def effective_run_id(self, default: str = "default") -> str:
        """The run id a service works under: ``run_id``, else ``$VIME_RUN_ID``, else ``default``.

        One rule for every service (the rollout manager names its Redis stream with it, the
        trainer its records and checkpoints), so an id given once, in the config or the
        environment, reaches all of them; only the fallback differs by service.
        """
        return self.run_id or os.environ.get("VIME_RUN_ID") or default

    def to_json(self) -> str:
        """The resolved config, derived values included, as indented JSON."""
        return json.dumps(self.model_dump(mode="json"), indent=2)


# --- loading ------------------------------------------------------------------------------------


class ConfigError(ValueError):
    """A config that cannot be loaded; the message says what to change."""


def _deep_merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _set_path(target: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = target
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"cannot set {dotted!r}: {part!r} is not a section")
    node[parts[-1]] = value


def parse_overrides(pairs: Iterable[str]) -> dict[str, Any]:
    """``["a=1", "reward.timeout_s=5"]`` -> nested dict; values are parsed as YAML scalars."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {pair!r} is not key=value")
        _set_path(out, key.strip().replace("-", "_"), yaml.safe_load(raw) if raw.strip() else None)
    return out


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``VIME_ROLLOUT_BATCH_SIZE=32`` / ``VIME_REWARD__TIMEOUT_S=5`` -> nested dict of known fields."""
    environ = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    sections = {name for name, f in RunConfig.model_fields.items() if isinstance(f.default_factory, type)}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX) or key == "VIME_API_TOKEN":
            continue
        path = key[len(ENV_PREFIX) :].lower().split("__")
        if path[0] not in RunConfig.model_fields or (len(path) > 1 and path[0] not in sections):
            continue
        _set_path(out, ".".join(path), yaml.safe_load(raw) if raw.strip() else None)
    return out


def _format_validation_error(err: ValidationError) -> str:
    lines = []
    for item in err.errors():
        where = ".".join(str(p) for p in item["loc"]) or "config"
        msg = item["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {msg}" if item["loc"] else msg)
    return "invalid config:\n  " + "\n  ".join(lines)


def load_config(
    path: str | Path | None = None,
    overrides: Iterable[str] = (),
    environ: Mapping[str, str] | None = None,
    base: Mapping[str, Any] | None = None,
) -> RunConfig:
    """Load a RunConfig from YAML + environment + ``key=value`` overrides, then derive and check it."""
    data: dict[str, Any] = dict(base or {})
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {p} is not valid YAML: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
        data = _deep_merge(data, loaded)
    data = _deep_merge(data, env_overrides(environ))
    data = _deep_merge(data, parse_overrides(overrides))
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc)) from None
