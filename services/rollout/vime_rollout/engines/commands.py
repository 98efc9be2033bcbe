"""The command line and environment of each engine (seed step 2, ``_compute_server_args``).

Real vLLM: ``--enable-sleep-mode`` when engines are offloaded during training,
``--max-model-len = rollout_max_context_len``, ``--weight-transfer-config '{"backend":"ipc"}'``
when colocated, the engine's tensor-parallel size and GPU ids, and the dev-mode switches its
control routes need; every engine, vLLM or reference, ``--logprobs-mode processed_logprobs`` and,
with ``engine.weight_load: direct``, ``--worker-extension-cls`` of the direct-load extension.
vLLM runs as ``python3 -m vime_rollout.vllm_ext.serve serve ...`` (vLLM's own CLI with the
compact generate route added) with ``VLLM_USE_FLASHINFER_SAMPLER=0``.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from dataclasses import dataclass, field

from vime.config import RunConfig
from vime.wire.direct_load import EXTENSION
from vime_rollout.engines.spec import EngineSpec

LOGPROBS_MODE = "processed_logprobs"
"""Engines report log-probs of the distribution they sample from (logits / T, then top-k/top-p);
the trainer's are of logits / T (without top-k/top-p, as slime)."""

VLLM_LAUNCHER = "vime_rollout.vllm_ext.serve"
"""vLLM's CLI (``python -m vllm.entrypoints.cli.main``) with vime's compact generate route added."""

VLLM_ENV = {
    "VLLM_SERVER_DEV_MODE": "1",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_NO_USAGE_STATS": "1",
}


@dataclass(frozen=True)
class EngineCommand:
    """argv + extra environment of one engine process."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


def _vllm_version() -> tuple[int, ...] | None:
    try:
        raw = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(p) for p in raw.split(".")[:2] if p.isdigit())


def _serving_args(cfg: RunConfig, spec: EngineSpec, served_name: str) -> list[str]:
    """What every engine (vLLM or reference) is told alike: its model name, address (its gate's
    Unix socket when it has one) and context, to
    report log-probs after temperature (``--logprobs-mode``, in vLLM 0.26's and 0.33's ModelConfig):
    the default ``raw_logprobs`` are of the untempered logits, which the trainer does not use; and
    the direct-load extension when the run loads weights directly."""
    listen = ["--uds", spec.socket] if spec.socket else ["--host", spec.host, "--port", str(spec.port)]
    args = [
        "--served-model-name",
        served_name,
        *listen,
        "--max-model-len",
        str(cfg.rollout_max_context_len),
        "--logprobs-mode",
        LOGPROBS_MODE,
    ]
    if cfg.engine.weight_load == "direct":
        args += ["--worker-extension-cls", EXTENSION]
    return args


def vllm_serve_args(
    cfg: RunConfig, spec: EngineSpec, model_path: str, served_name: str, *, scale_out: bool = False
) -> list[str]:
    """``serve`` arguments for one vLLM engine (without the interpreter part)."""
    args = [
        "serve",
        model_path,
        *_serving_args(cfg, spec, served_name),
        "--tensor-parallel-size",
        str(len(spec.gpu_ids) or cfg.rollout_num_gpus_per_engine),
        "--gpu-memory-utilization",
        str(cfg.engine.gpu_memory_utilization),
        "--seed",
        str(cfg.rollout_seed),
    ]
    if cfg.offload_rollout:
        args.append("--enable-sleep-mode")
    if cfg.colocate:
        args += ["--weight-transfer-config", json.dumps({"backend": "ipc"})]
    if cfg.engine.enforce_eager:
        args.append("--enforce-eager")
    if scale_out:
        args.append("--enable-scale-out")  # vLLM >= 0.33 serves /inference/v1/generate only with it
    return args + list(cfg.engine.extra_args)


def vllm_command(cfg: RunConfig, spec: EngineSpec, model_path: str, served_name: str) -> EngineCommand:
    """A local ``vllm serve`` child on the engine's GPUs."""
    version = _vllm_version()
    scale_out = version is not None and version >= (0, 33)
    argv = [sys.executable, "-m", VLLM_LAUNCHER]
    argv += vllm_serve_args(cfg, spec, model_path, served_name, scale_out=scale_out)
    env = {**VLLM_ENV, "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in spec.gpu_ids)}
    return EngineCommand(argv, env)


def reference_command(cfg: RunConfig, spec: EngineSpec, model_path: str, served_name: str) -> EngineCommand:
    """The CPU reference engine (a stand-in for vLLM with the same routes)."""
    argv = [
        sys.executable,
        "-m",
        "vime_rollout.reference_engine",
        "--model",
        model_path,
        *_serving_args(cfg, spec, served_name),
        "--max-batch",
        str(cfg.engine.reference_max_batch),
        "--kv-cache-memory-bytes",
        str(cfg.engine.reference_kv_cache_bytes),
        "--seed",
        str(cfg.rollout_seed + spec.index),
    ]
    return EngineCommand(argv, {"CUDA_VISIBLE_DEVICES": ""})


def engine_command(cfg: RunConfig, spec: EngineSpec, model_path: str, served_name: str) -> EngineCommand:
    if spec.backend == "vllm":
        return vllm_command(cfg, spec, model_path, served_name)
    if spec.backend == "reference":
        return reference_command(cfg, spec, model_path, served_name)
    raise ValueError(f"engine {spec.index} is external: it has no command")
