"""A fresh process's view of the GPU and host: GEMM TFLOP/s, copy GB/s, kernel launch cost.

`step_gpu.py` runs it before its first run and after each run, so that a run slower than the
one before it can be told apart: the GPU itself slower for any new process (clock, memory state,
another process on it), the host busy (launch cost, load), or neither (something in the run).

    python bench/gpu_probe.py        # one JSON line
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

import torch


def _timed(fn: Callable[[], object], iters: int) -> float:
    """Seconds per call of ``fn`` on the current stream, after two warm-up calls."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def probe(n: int = 8192, copy_gib: float = 1.0) -> dict[str, float]:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    gemm_s = _timed(lambda: a @ b, 50)
    src = torch.empty(int(copy_gib * (1 << 30)), device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_s = _timed(lambda: dst.copy_(src), 20)
    small = torch.zeros(16, device="cuda")
    launch_s = _timed(lambda: small.add_(1.0), 2000)
    free, total = torch.cuda.mem_get_info()
    return {
        "gemm_tflops": round(2 * n**3 / gemm_s / 1e12, 1),
        "copy_gbps": round(2 * src.numel() / copy_s / 1e9, 1),  # read + write
        "launch_us": round(launch_s * 1e6, 2),
        "gpu_free_gib": round(free / (1 << 30), 2),
        "gpu_total_gib": round(total / (1 << 30), 2),
        "loadavg_1m": float(open("/proc/loadavg").read().split()[0]),
        "cpus": float(len(os.sched_getaffinity(0))),
    }


if __name__ == "__main__":
    print(json.dumps(probe()))
