"""Where one training step's time goes: torch.profiler over the step, time by category, as a table and JSON.

GPU: every CUDA kernel's time is attributed to one category through the CPU op that launched it
(and that op's ancestors); "idle" is the step's wall time during which no kernel ran (the GPU
waiting on the host: Python, launches, micro-batch building, syncs). CPU (the sanity run): the
same categories over the ops' own CPU time. Rules, first match wins:

- optimizer: launched inside the trainer's ``vime/optimizer`` range (grad norm, clip, Adam, copies);
- output layer + log-probs/entropy: inside ``vime/logprobs`` (forward and checkpoint recompute),
  or the backward of an op that ran there (matched by autograd sequence number);
- attention: the op or an ancestor is attention (SDPA, flash, varlen, flex);
- communication: NCCL kernels, c10d ops;
- GEMM (linear layers): matrix multiplies (QKV/out projections, MLP);
- memcpy/memset; everything else is norms, activations, RoPE and elementwise work.

Kernel time overlapping other kernels (several streams) is counted in each category, so on GPU
"unattributed kernels" is the busy time left over once the categories are subtracted (zero or
more): kernels no recorded op launched.

Host side: the ``vime/micro_batches`` range (building the micro-batch tensors) and the time the
host spent blocked in synchronising calls. On GPU one more step runs under torch's sync debug mode
(``torch.cuda.set_sync_debug_mode("warn")``, outside the profiled step): each call that made the
host wait for the GPU, counted by the nearest frame of this repo or Megatron (``sync_sites``).
The chrome trace is written only when asked (it is large: tens of MB for a 4B step).
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
import time
import traceback
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

OPTIMIZER = "vime/optimizer"
LOGPROBS = "vime/logprobs"
MICRO_BATCHES = "vime/micro_batches"
CATEGORIES = [
    "GEMM (linear layers)",
    "attention",
    "output layer + log-probs/entropy",
    "norms, activations, RoPE, elementwise",
    "optimizer",
    "communication",
    "memcpy/memset",
    "unattributed kernels",
]
_ATTENTION = re.compile(r"flash|fmha|attention|attn|sdpa|flex|varlen", re.I)
_GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear"}
_GEMM_KERNEL = re.compile(r"gemm|cutlass|xmma|cublas|sm\d+_", re.I)
_SYNCS = re.compile(r"^cuda(Stream|Device|Event)Synchronize$|^cudaMemcpy$")
"""CUDA runtime calls in which the host waits for the device (``.item()``, D2H copies, syncs)."""


def _ancestors(evt: Any) -> list[Any]:
    out, e = [], evt
    while e is not None:
        out.append(e)
        e = e.cpu_parent
    return out


def logprob_nodes(events: list[Any]) -> set[int]:
    """Autograd sequence numbers of the ops run inside ``vime/logprobs`` (their backward nodes carry them)."""
    return {
        e.sequence_nr
        for e in events
        if e.device_type == DeviceType.CPU
        and e.sequence_nr >= 0
        and LOGPROBS in (a.name for a in _ancestors(e))
    }


def categorize(evt: Any, kernel_name: str, logprob_seq: set[int]) -> str:
    """The category of a kernel (or CPU op) launched by ``evt``; ``logprob_seq`` from `logprob_nodes`."""
    chain = _ancestors(evt)
    names = [e.name for e in chain]
    if OPTIMIZER in names:
        return "optimizer"
    if LOGPROBS in names or any("Backward" in e.name and e.sequence_nr in logprob_seq for e in chain):
        return "output layer + log-probs/entropy"
    if _ATTENTION.search(kernel_name) or any(_ATTENTION.search(n) for n in names):
        return "attention"
    if "nccl" in kernel_name.lower() or any(n.startswith(("c10d::", "nccl:")) for n in names):
        return "communication"
    if evt.name in _GEMM_OPS or _GEMM_KERNEL.search(kernel_name):
        return "GEMM (linear layers)"
    if "memcpy" in kernel_name.lower() or "memset" in kernel_name.lower():
        return "memcpy/memset"
    return "norms, activations, RoPE, elementwise"


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1000.0


def breakdown(prof: Any, wall_ms: float) -> dict[str, Any]:
    """Category times (ms), idle, host-side times and the top kernels of a profiled step."""
    events = prof.events()
    logprob_seq = logprob_nodes(events)
    cats: dict[str, float] = defaultdict(float)
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    on_gpu = any(e.device_type == DeviceType.CUDA for e in events)
    host: dict[str, float] = {"micro_batch_build_ms": 0.0, "blocked_in_syncs_ms": 0.0, "syncs": 0.0}
    for e in events:
        if e.device_type != DeviceType.CPU:
            continue
        if e.name == MICRO_BATCHES:
            host["micro_batch_build_ms"] += e.cpu_time_total / 1000.0
        if _SYNCS.search(e.name):
            host["blocked_in_syncs_ms"] += e.cpu_time_total / 1000.0
            host["syncs"] += 1
        if on_gpu:
            for k in e.kernels:
                cats[categorize(e, k.name, logprob_seq)] += k.duration / 1000.0
                kernels[k.name][0] += k.duration / 1000.0
                kernels[k.name][1] += 1
        elif e.name.startswith("aten::") and e.self_cpu_time_total > 0:
            cats[categorize(e, e.name, logprob_seq)] += e.self_cpu_time_total / 1000.0
            kernels[e.name][0] += e.self_cpu_time_total / 1000.0
            kernels[e.name][1] += 1
    busy = _union_ms(
        [
            (e.time_range.start, e.time_range.end)
            for e in events
            if e.device_type == DeviceType.CUDA and not e.is_user_annotation
        ]
    )
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:20]
    if on_gpu:  # kernels whose launch no recorded op encloses
        cats["unattributed kernels"] = max(0.0, busy - sum(cats.values()))
    return {
        "device": "gpu" if on_gpu else "cpu",
        "step_wall_ms": round(wall_ms, 2),
        "busy_ms": round(busy if on_gpu else sum(cats.values()), 2),
        "idle_ms": round(max(0.0, wall_ms - busy), 2) if on_gpu else None,
        "categories_ms": {c: round(cats.get(c, 0.0), 2) for c in CATEGORIES},
        "host": {k: round(v, 2) for k, v in host.items()},
        "top": [{"name": n[:120], "ms": round(ms, 2), "calls": int(c)} for n, (ms, c) in top],
    }


def print_breakdown(console: Console, title: str, b: dict[str, Any]) -> None:
    table = Table(title=title)
    for col in ("category", "ms", "% of step"):
        table.add_column(col, justify="right" if col != "category" else "left")
    wall = b["step_wall_ms"] or 1.0
    rows = list(b["categories_ms"].items())
    if b["idle_ms"] is not None:
        rows.append(("idle (GPU waits on the host)", b["idle_ms"]))
    for name, ms in rows:
        table.add_row(name, f"{ms:.1f}", f"{ms / wall:.1%}")
    table.add_row("step (wall, profiled)", f"{wall:.1f}", "100%")
    console.print(table)
    console.print(f"host: { {k: v for k, v in b['host'].items() if k != 'sync_sites'} }")
    for site in b["host"].get("sync_sites", []):
        console.print(f"  sync ×{site['calls']}: {site['site']}")
    console.print(
        "top: " + "; ".join(f"{t['name'][:60]} {t['ms']:.1f} ms ×{t['calls']}" for t in b["top"][:8])
    )


def profile_step(
    step: Callable[[], None], out_dir: Path, name: str, *, trace: bool = False
) -> dict[str, Any]:
    """Run ``step`` once under torch.profiler; write ``profile_<name>.json`` (+ a gzipped trace)."""
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    with profile(activities=activities, record_shapes=True) as prof:
        t0 = time.perf_counter()
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1000.0
    result = {"variant": name, **breakdown(prof, wall_ms)}
    if torch.cuda.is_available():
        result["host"]["sync_sites"] = sync_sites(step)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"profile_{name}.json").write_text(json.dumps(result, indent=1))
    if trace:
        raw = out_dir / f"trace_{name}.json"
        prof.export_chrome_trace(str(raw))
        with raw.open("rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
    return result


_OWN_FRAMES = re.compile(r"/(vime|vime_trainer|megatron)/")


def sync_sites(step: Callable[[], None], top: int = 15) -> list[dict[str, Any]]:
    """Run ``step`` once with torch's sync debug mode; the calls that synchronised, by call site."""
    sites: Counter[str] = Counter()

    def record(message: Any, *args: Any, **kwargs: Any) -> None:
        frames = [f for f in traceback.extract_stack()[:-1] if _OWN_FRAMES.search(f.filename)]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-2:][::-1])
        sites[f"{str(message).split(chr(10))[0][:60]} @ {where or '?'}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
            torch.cuda.synchronize()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [{"site": k, "calls": n} for k, n in sites.most_common(top)]
