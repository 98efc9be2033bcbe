"""Helpers of the GPU tests (no tests here): the mode, test models, engines, memory probes, figures.

The GPU tests run on the lent H200 (real vLLM, Megatron on CUDA, CUDA IPC). With
``VIME_GPU_DRY_RUN=1`` the same tests run on a CPU host with the CPU stand-ins — the reference
engine instead of vLLM, gloo ranks, the shm weight transport, a tiny model — so that everything
but the CUDA-specific lines is exercised before device time is spent. Without either they skip.

Figures a test wants in the GPU suite's ``results.json`` go through `record`: one JSON line on
stdout (``VIME_RESULT {...}``) and, when the suite driver set ``VIME_SUITE_FIGURES``, appended to
that file (pytest captures stdout; the file survives).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from vime import procs
from vime.models.tiny import build_tiny_qwen3

DRY_RUN_ENV = "VIME_GPU_DRY_RUN"
FIGURES_ENV = "VIME_SUITE_FIGURES"
LOGIT_SCALE = 5.0
"""Output layer × 5: peaked next-token distributions (no bf16 near-ties, meaningful log-probs)."""
GIB = float(1 << 30)


def dry_run() -> bool:
    return os.environ.get(DRY_RUN_ENV, "").lower() in ("1", "true", "yes")


def cuda_gpus() -> int:
    """CUDA devices this process sees (0 without torch's CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def on_gpu() -> bool:
    """Real GPU mode: CUDA is there and no dry run was asked for."""
    return cuda_gpus() > 0 and not dry_run()


def record(name: str, **figures: Any) -> None:
    """Report figures to the suite (stdout line + ``$VIME_SUITE_FIGURES``)."""
    line = json.dumps({"name": name, **figures}, default=str)
    print(f"VIME_RESULT {line}", flush=True)
    path = os.environ.get(FIGURES_ENV)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def build_model(out: Path, shape: str, *, gpu: bool) -> Path:
    """A random Qwen3 checkpoint for a test: bf16 with every id decodable on GPU, fp32 on CPU."""
    return build_tiny_qwen3(
        out,
        shape,
        dtype="bfloat16" if gpu else "float32",
        fill_vocab=True,
        logit_scale=LOGIT_SCALE,
    )


def engine_port() -> int:
    """A free port below the ephemeral range (where another child's random port cannot land)."""
    return procs.free_port_run()


@dataclass
class StartedEngine:
    child: procs.Child
    url: str
    model: Path
    served_name: str
    backend: str
    start_s: float

    def stop(self) -> None:
        self.child.stop(grace_s=30.0)


def start_engine(
    cfg: Any, model: Path, served_name: str, log_dir: Path, *, timeout_s: float = 420.0
) -> StartedEngine:
    """One engine started exactly as the rollout manager starts it (its command builder, seed step 2)."""
    from vime_rollout.engines.commands import engine_command
    from vime_rollout.engines.spec import plan_engines

    spec = plan_engines(cfg, gpus=list(range(max(cfg.rollout_num_gpus, 0))))[0]
    command = engine_command(cfg, spec, str(model), served_name)
    t0 = time.monotonic()
    child = procs.start(spec.name, command.argv, log_path=log_dir / f"{spec.name}.log", env=command.env)
    try:
        procs.wait_healthy(spec.url, child, timeout_s=timeout_s, interval_s=0.5)
    except BaseException:
        child.stop(grace_s=10.0)
        raise
    return StartedEngine(child, spec.url, model, served_name, spec.backend, time.monotonic() - t0)


# --- memory ----------------------------------------------------------------------------------


class GpuMemory:
    """Used bytes of the GPUs, all processes (NVML, else nvidia-smi): what colocation shares."""

    def __init__(self, indices: list[int]) -> None:
        self.indices = indices
        self._nvml: Any = None
        with contextlib.suppress(Exception):
            import pynvml

            pynvml.nvmlInit()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
            self._nvml = pynvml

    def used(self) -> int:
        if self._nvml is not None:
            return sum(int(self._nvml.nvmlDeviceGetMemoryInfo(h).used) for h in self._handles)
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        rows = [line.split(",") for line in out.strip().splitlines()]
        return sum(int(used) << 20 for idx, used in rows if int(idx) in self.indices)

    def by_process(self) -> dict[str, int]:
        """MiB per process on these GPUs (``"pid command"``), to tell the trainer's share from the
        engines'; empty where NVML cannot see the processes (another PID namespace)."""
        out: dict[str, int] = {}
        if self._nvml is None:
            return out
        with contextlib.suppress(Exception):
            for h in self._handles:
                for p in self._nvml.nvmlDeviceGetComputeRunningProcesses(h):
                    name = f"{p.pid} {_command(p.pid)}"
                    out[name] = out.get(name, 0) + (int(p.usedGpuMemory or 0) >> 20)
        return out


def _command(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:80]
    return "?"


class EngineMemory:
    """The CPU stand-in's account: weights + KV cache bytes from each reference engine's /debug/memory."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.client = httpx.Client(timeout=10)

    def used(self) -> int:
        total = 0
        for url in self.urls:
            m = self.client.get(url + "/debug/memory").json()
            total += int(m["weights_bytes"]) + int(m["kv_cache_bytes"])
        return total


def gpu_memory_available() -> bool:
    return shutil.which("nvidia-smi") is not None or _has_nvml()


def _has_nvml() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return False
    return True


@dataclass
class MemorySampler:
    """Samples ``probe()`` every ``interval_s`` in a thread: (monotonic time, bytes)."""

    probe: Callable[[], int]
    interval_s: float = 0.02
    samples: list[tuple[float, int]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> MemorySampler:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                self.samples.append((time.monotonic(), self.probe()))
            self._stop.wait(self.interval_s)

    def peak(self, t0: float, t1: float) -> int | None:
        inside = [b for t, b in self.samples if t0 <= t <= t1]
        return max(inside) if inside else None


@contextlib.contextmanager
def env_path(var: str, *paths: Path) -> Iterator[None]:
    """Prepend ``paths`` to a path-list environment variable for the duration (children inherit it)."""
    old = os.environ.get(var)
    os.environ[var] = os.pathsep.join([*map(str, paths), *([old] if old else [])])
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = old
