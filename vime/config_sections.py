"""The run configuration's sections: one per service or concern (``model``, ``data``, ``reward``,
``router``, ``engine``, ``services``, ``trainer``), each read only by the part that needs it.
`vime.config.RunConfig` nests them and re-exports them; a docstring under every field is its help.
"""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    """Base for every config section: unknown keys are errors, docstrings are the help."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class ModelConfig(Section):
    hf_checkpoint: str | None = None
    """Hugging Face checkpoint directory (safetensors). None builds the tiny local model kit."""
    served_model_name: str | None = None
    """Name the engines serve the model under (vLLM's --served-model-name); defaults to the path."""
    tiny_model_size: Literal["nano", "micro", "small"] = "micro"
    """Size of the locally built tiny Qwen3 when hf_checkpoint is None."""


class DataConfig(Section):
    prompt_data: str | None = None
    """Training prompts: a .jsonl or .parquet file. None uses the built-in synthetic arithmetic task."""
    input_key: str = "prompt"
    """Record field holding the prompt (a string, or a list of chat messages)."""
    label_key: str = "label"
    """Record field holding the label the reward function checks against."""
    metadata_key: str | None = "metadata"
    """Record field copied into Sample.metadata (e.g. a per-sample rm_type)."""
    apply_chat_template: bool = False
    """Render prompts with the tokenizer's chat template before tokenising."""
    rollout_shuffle: bool = True
    """Shuffle prompts each epoch (seeded by rollout_seed)."""
    eval_prompt_data: dict[str, str] = Field(default_factory=dict)
    """Evaluation datasets, name -> path; evaluated every eval_interval rollouts."""
    n_samples_per_eval_prompt: int = Field(1, ge=1)
    """Samples per eval prompt (pass@k uses k <= this)."""
    eval_temperature: float = Field(0.0, ge=0.0)
    """Sampling temperature for eval rollouts (0 = greedy)."""
    synthetic_num_prompts: int = Field(4096, ge=1)
    """Size of the built-in synthetic task when prompt_data is None."""


class RewardConfig(Section):
    rm_type: str = "math"
    """Default reward function (math, gsm8k, dapo, deepscaler, exact_match, f1, arithmetic, remote, or module:function)."""
    custom_rm_path: str | None = None
    """Import path of a user reward function (package.module:function); overrides rm_type."""
    allowed_functions: list[str] = Field(default_factory=list)
    """Other user reward functions (package.module:function) a request's ``fn`` or a sample's
    ``metadata.rm_type`` may name. custom_rm_path and an import-path rm_type are allowed without
    being listed; any other import path is refused (403) and never imported."""
    group_rm: bool = False
    """Score a whole group in one batched call instead of one call per sample (seed step 26)."""
    timeout_s: float = Field(10.0, gt=0)
    """Per-sample verification timeout inside the reward service."""
    timeout_reward: float = 0.0
    """Reward given to a sample whose verification timed out."""
    error_reward: float = 0.0
    """Reward given to a sample whose reward function failed (raised, crashed its worker, remote unreachable)."""
    num_workers: int = Field(2, ge=1)
    """Processes in the reward service's verification pool."""
    worker_memory_mb: int | None = Field(4096, ge=256)
    """Address-space limit of each pool worker (a crafted answer gets MemoryError, not the OOM killer); None = no limit."""
    request_timeout_s: float = Field(300.0, gt=0)
    """How long the rollout manager waits for the reward service to answer one scoring call (it may
    be stopped, overloaded or restarting: a refused connection is tried again within the same
    time) before the rollout fails."""
    stall_warning_s: float = Field(10.0, gt=0)
    """A scoring call unanswered this long is logged as a warning naming the stall, again each
    time as long again, and once more when the answer comes."""
    remote_url: str | None = None
    """URL of another reward server, for rm_type=remote."""
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    """Largest request body the reward service accepts (413 above)."""


class RouterConfig(Section):
    policy: Literal["round_robin", "power_of_two", "consistent_hash"] = "round_robin"
    """Routing policy of the data plane (seed step 21); consistent_hash keys on X-Session-ID."""
    request_timeout_s: float = Field(1800.0, gt=0)
    """Data-plane request timeout; long enough for a 1024-token generation under load."""
    retry_window_s: float = Field(300.0, ge=0)
    """How long the rollout manager keeps sending a generate again that no engine answered (its
    engine died; the router has no engine, or is restarting): connection failures, 502/503/504 and
    vllm-router's transport 500s are retried with backoff for this long, then the rollout fails.
    Long enough for an engine restart (CPU reference engine ~10 s, vLLM a minute or more)."""
    max_body_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    """Largest generate request body the data plane accepts (413 above)."""
    startup_timeout_s: float = Field(60.0, gt=0)
    """How long the data-plane processes (vllm-router, the route filter) may take to get ready."""


class EngineConfig(Section):
    backend: Literal["auto", "vllm", "reference"] = "auto"
    """auto picks real vLLM when a GPU and vllm are present, else the CPU reference engine."""
    launcher: Literal["local", "docker", "external"] = "local"
    """local child processes, sibling containers (Docker SDK), or engines already running."""
    urls: list[str] = Field(default_factory=list)
    """Engine base URLs for launcher=external (one per engine). Start them with
    ``--logprobs-mode processed_logprobs`` (and VLLM_SERVER_DEV_MODE=1): an engine that says
    another mode is refused."""
    host: str = "127.0.0.1"
    """Interface of the engines' ports. With launcher=local or docker each port is a gate that opens
    control routes only to the stack's token (the engine itself is on a private Unix socket; docker:
    gate and engine inside the engine's container); external engines answer control routes to
    anyone who reaches them: keep those private."""
    base_port: int = Field(18100, ge=1024, le=65000)
    """First engine port; engine k listens on base_port + k."""
    gpu_memory_utilization: float = Field(0.5, gt=0, le=1)
    """vLLM --gpu-memory-utilization (colocated: leave room for the trainer)."""
    enforce_eager: bool = False
    """vLLM --enforce-eager (faster start, slower decode)."""
    extra_args: list[str] = Field(default_factory=list)
    """Extra command-line arguments passed to every vllm serve."""
    weight_load: Literal["auto", "vllm", "direct"] = "auto"
    """How pushed weights enter the engines. ``auto`` (resolved when the config loads): ``direct``
    when the weights travel by CUDA IPC (colocated on GPUs) to engines of one GPU each — there it
    pushed the 0.6B shape in 0.055 s against 0.16–0.20 s with ``vllm`` on an H100, pause to
    resume (docs/benchmarks.md, 12-07) — else
    ``vllm``. ``vllm``: vLLM's own ``/update_weights`` (its weight loaders; any model). ``direct``: a
    worker extension (``--worker-extension-cls``, vLLM's and the
    reference engine's) copies each bucket from the trainer's staging buffer straight into the
    parameters, laid out once per engine start, and both sides checksum every bucket. Refused at
    the first push — then ``vllm`` for the run, with a warning — for engines it cannot load exactly
    (quantised, split over several GPUs, parameters that are not plain tensors of the trainer's
    dtype and size). For each push the trainer allocates, per GPU, one staging buffer the model's
    size when it fits ``trainer.packed_buffer_size_bytes``, else two of that size to alternate,
    and frees them after it: a sleeping trainer holds none through the rollout."""
    startup_timeout_s: float = Field(600.0, gt=0)
    """How long an engine may take to answer /health after launch."""
    health_check_interval_s: float = Field(2.0, gt=0)
    """How often the rollout manager (the one judge of engine health) checks each engine: a process
    that exited is taken out of the router at the next check."""
    health_failure_threshold: int = Field(2, ge=1)
    """Consecutive failed /health probes that make an engine dead (taken out, restarted if ours)."""
    health_check_timeout_s: float = Field(5.0, gt=0)
    """How long one /health probe may take before it counts as a failure."""
    reference_max_batch: int = Field(256, ge=1)
    """Reference engine: most sequences decoded together in one forward pass."""
    reference_kv_cache_bytes: int = Field(4 << 30, ge=1 << 20)
    """Reference engine: most memory its KV cache may take (--kv-cache-memory-bytes, default 4 GiB)."""
    image: str = "vime-gpu:0.1.0"
    """Container image of the engines for launcher=docker (the compose file's GPU image)."""


class ServicesConfig(Section):
    host: str = "127.0.0.1"
    """Interface the vime services bind to."""
    router_port: int = 18080
    """Router data plane (vllm-router) port."""
    router_control_port: int = 18081
    """Router control plane (FastAPI) port."""
    reward_port: int = 18082
    """Reward service port."""
    rollout_port: int = 18083
    """Rollout manager port."""
    trainer_port: int = 18084
    """Trainer service port."""
    router_url: str | None = None
    """Router data-plane URL when it runs elsewhere (compose, k8s); derived from host/port if None."""
    router_control_url: str | None = None
    """Router control-plane URL when it runs elsewhere."""
    reward_url: str | None = None
    """Reward service URL when it runs elsewhere."""
    rollout_url: str | None = None
    """Rollout manager URL when it runs elsewhere."""
    trainer_url: str | None = None
    """Trainer service URL when it runs elsewhere."""
    api_token: str | None = None
    """Bearer token required on state-changing routes (env VIME_API_TOKEN also works). A service
    refuses to start without one unless ``insecure``; `vime up` / `vime train` generate one."""
    insecure: bool = False
    """Serve with no token, every route open (the services' ``--insecure``): a service without a
    token refuses to start unless this says so."""
    redis_url: str | None = None
    """Redis URL; None lets the launcher start a private redis-server."""

    def url(self, name: Literal["router", "router_control", "reward", "rollout", "trainer"]) -> str:
        """The base URL of a service: the explicit one if set, else http://host:port."""
        explicit = getattr(self, f"{name}_url")
        if explicit:
            return str(explicit).rstrip("/")
        return f"http://{self.host}:{getattr(self, f'{name}_port')}"

    def token(self) -> str | None:
        """The shared bearer token: config first, then VIME_API_TOKEN."""
        return self.api_token or os.environ.get("VIME_API_TOKEN") or None


class TrainerConfig(Section):
    """The Megatron trainer's settings."""

    lr: float = Field(1e-6, gt=0)
    """Adam learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """Adam weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.98
    """Adam beta2."""
    clip_grad: float = Field(1.0, ge=0)
    """Gradient-norm clipping (0 disables)."""
    bf16: bool = True
    """Train in bf16 on GPU (CPU always trains in fp32)."""
    use_sdpa: bool = True
    """Swap Megatron's unfused local attention for torch SDPA (no TransformerEngine needed)."""
    logprob_chunk_size: int = Field(1024, ge=1)
    """Tokens per chunk when computing response log-probs without full-vocab fp32 logits."""
    packed_sequences: bool = False
    """Pack each micro-batch's samples into one sequence (no padding; attention stays within each
    sample) instead of right-padding them to [samples, longest sample]. Needs use_sdpa."""
    packed_attention: Literal["auto", "varlen", "flex", "segments"] = "auto"
    """Attention kernel for packed samples: varlen (FlashAttention) or flex (FlexAttention), GPU
    only, or segments (one SDPA call per sample); auto is varlen on GPU, segments on CPU."""
    fused_norm: bool = True
    """On the GPU, every layer's RMSNorm as one compiled kernel forward and one backward (torch's
    own kernels when false; the CPU always uses them)."""
    recompute_activations: bool = False
    """Recompute each layer's forward during backward (Megatron's full recompute) instead of keeping
    its activations: less memory, about a third more compute."""
    grad_reduce_in_fp32: bool = True
    """Accumulate and all-reduce gradients in fp32; False keeps them in the parameter dtype (bf16)."""
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    """Most of each GPU a training rank may allocate (torch's per-process memory fraction); None:
    no cap. The async mode on shared GPUs needs it, with engine.gpu_memory_utilization, at most 1."""
    packed_buffer_size_bytes: int = Field(1 << 30, ge=1 << 12)
    """Weight-push bucket size (a tensor larger than this travels alone in its own bucket). With
    ``engine.weight_load: direct`` each push stages two buffers of this size per GPU (one, the
    model's size, when the model fits one), freed after the push: larger buckets mean fewer load
    calls for that much more GPU memory during the push. The Qwen3-4B shape (8.8 GB) went from the
    sleeping trainer in 0.079 s pause to resume with 4.5 GiB buckets against 0.102 s with 1 GiB on
    an H100 (docs/benchmarks.md, 12-08), when each load waited for the one before to come back
    (~5 ms of round trip a bucket; now the next is sent meanwhile); the 0.6B shape was slower in
    one bucket than in two."""
    weight_transport: Literal["auto", "ipc", "shm"] = "auto"
    """ipc (CUDA IPC, colocated GPUs), shm (safetensors in /dev/shm or shared dir); auto picks."""
    weight_dir: str | None = None
    """Where shm weight buckets are written (None: /dev/shm, else the temp dir); a shared filesystem when engines run on other hosts."""
    ipc_packed: bool = True
    """IPC push: one CUDA IPC handle per packed bucket (bounded memory) instead of one per tensor."""
    checkpoint_dir: str = "checkpoints"
    """Where distributed checkpoints are written; resume reads the newest one."""
    sft_warmup_steps: int = Field(0, ge=0)
    """Supervised warm-up steps on the labels before RL (the CPU demo uses a few)."""
    sft_lr: float | None = Field(None, gt=0)
    """Learning rate of the supervised warm-up (None: lr). A warm-up needs a much larger step than
    RL: the CPU default warms up at 1e-3 and runs GRPO at 1e-4 (GRPO at 1e-3 collapses its reward)."""
    kl_loss_type: Literal["k1", "low_var_kl"] = "low_var_kl"
    """KL estimator of the loss term against the reference model (used when kl_coef > 0)."""
    seed: int = 1234
    """Trainer RNG seed."""

    @model_validator(mode="after")
    def _packed_needs_sdpa(self) -> TrainerConfig:
        if self.packed_sequences and not self.use_sdpa:
            raise ValueError(
                "packed_sequences needs use_sdpa=true: Megatron's local attention takes padded batches only"
            )
        return self
