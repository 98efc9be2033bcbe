"""Which config a command uses when none is given: the embedded default for this host.

No GPU (or no vLLM): ``examples/cpu.yaml`` — the tiny model on the synthetic arithmetic task,
CPU reference engines and CPU Megatron, a run of a few minutes that visibly learns. With vLLM
and a GPU: ``examples/gpu-1.yaml`` — the same run with vLLM and Megatron colocated on one GPU.
Both need nothing downloaded; the seed scenario (``examples/seed-8gpu.yaml``) needs a model and
a dataset, so it is only run when asked for.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
"""The repository's examples/ (vime is installed editable from the checkout)."""


def visible_gpu_count() -> int:
    """GPUs this process may use: CUDA_VISIBLE_DEVICES when set, else what ``nvidia-smi -L`` lists."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return len([x for x in env.split(",") if x.strip() and x.strip() != "-1"])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines())


def default_config_name(gpus: int, has_vllm: bool) -> str:
    """The example file for a host with ``gpus`` GPUs (vLLM installed or not)."""
    return "gpu-1.yaml" if gpus and has_vllm else "cpu.yaml"


def default_config_path() -> Path:
    """The embedded default of this host; raises FileNotFoundError outside a checkout."""
    name = default_config_name(visible_gpu_count(), importlib.util.find_spec("vllm") is not None)
    path = EXAMPLES_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"default config {path} not found: pass --config FILE")
    return path
