"""The direct weight load across two processes, as trainer and engine run it, without vLLM.

The trainer side (`direct_rank.DirectExporter`) allocates its staging buffers for one push and
packs a Qwen3 shape's HF tensors bucket by bucket into them; an engine-side process opens the
buffers — CUDA IPC handles on the GPU, shared-memory files in the dry run — and the worker extension
(`DirectLoadExtension`, mixed into a stand-in worker whose model has vLLM's fused parameter names)
copies every bucket into its parameters. Checked: each bucket's checksum computed by the engine
over its parameters equals the trainer's over what it packed (the same integer arithmetic on the
GPU as on the CPU), every fused parameter equals its HF parts back to back, both buffers are used
in turn, and a second push through newly allocated buffers (the first closed and freed on both
sides) loads as well, into the parameter views the engine recorded at its first open.
"""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from gpu_support import on_gpu, record

from vime.models.tiny import build_tiny_qwen3
from vime.wire.direct_load import encode_load, encode_open

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def fused(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a vLLM Qwen3 holds: q/k/v and gate/up concatenated under the fused names."""
    from vime_rollout.vllm_ext.direct_load import hf_parts

    out: dict[str, torch.Tensor] = {}
    for name in hf:
        if any(p in name for p in ("k_proj", "v_proj", "up_proj")) and "gate_up" not in name:
            continue
        f = name.replace("q_proj", "qkv_proj").replace("gate_proj", "gate_up_proj")
        out[f] = torch.cat([hf[p] for p in hf_parts(f, PACKED)])
    return out


def engine_side(device: str, shapes: dict[str, tuple[list[int], str]], requests: Any, answers: Any) -> None:
    """The engine process: a zeroed model with vLLM's names, the extension, and whatever the trainer asks."""
    from vime_rollout.vllm_ext.direct_load import DirectLoadExtension

    root = torch.nn.Module()
    root.packed_modules_mapping = PACKED  # type: ignore[assignment]
    for name, (shape, dtype) in shapes.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        param = torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
        mod.register_parameter(leaf, torch.nn.Parameter(param, requires_grad=False))
    worker = DirectLoadExtension()
    worker.model_runner = SimpleNamespace(get_model=lambda: root)  # type: ignore[attr-defined]
    worker.device = torch.device(device)  # type: ignore[attr-defined]
    while (req := requests.get()) is not None:
        method, arg = req
        if method == "state":
            answers.put({n: p.cpu() for n, p in root.named_parameters()})
        else:
            answers.put(getattr(worker, method)(*([arg] if arg is not None else [])))


def test_two_pushes_each_through_its_own_buffers(tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from vime_trainer.weight_sync.direct_plan import DirectPlan
    from vime_trainer.weight_sync.direct_rank import DirectExporter

    gpu = on_gpu()
    device = "cuda:0" if gpu else "cpu"
    model = build_tiny_qwen3(tmp_path / "m", "small" if gpu else "micro", dtype="bfloat16")
    hf = {n: t.to(device) for n, t in load_file(str(model / "model.safetensors")).items()}
    want = fused(hf)
    shapes = {n: (list(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in want.items()}
    ctx = mp.get_context("spawn")
    requests, answers = ctx.Queue(), ctx.Queue()
    engine = ctx.Process(target=engine_side, args=(device, shapes, requests, answers), daemon=True)
    engine.start()

    def call(method: str, arg: Any = None) -> Any:
        requests.put((method, arg))
        return answers.get(timeout=120)

    try:
        layout = call("vime_direct_layout")
        assert layout["refusal"] is None
        plan = DirectPlan.from_layout(layout["params"])
        plan.check_export({n: (list(t.shape), "bfloat16") for n, t in hf.items()})
        slots, size = plan.staging(256 << 10)
        assert slots == 2  # more than two buckets: both buffers in turn
        slots_used: set[int] = set()
        for push in range(2):
            kind = "ipc" if gpu else "shm"
            before = torch.cuda.memory_allocated() if gpu else 0
            exporter = DirectExporter(plan, size, slots, kind, share=True, directory=tmp_path)
            assert call("vime_direct_open", encode_open("s", exporter.specs))["buffers"] == 2
            source = {n: (-t if push and "lm_head" in n else t) for n, t in hf.items()}
            exporter.begin(iter(source.items()))
            slot = 0
            while (packed := exporter.next(slot)) is not None:
                got = call("vime_direct_load", encode_load("s", slot, packed["index"], packed["params"]))
                assert got["checksum"] == packed["checksum"], f"push {push} bucket {packed['index']}"
                assert got["rerecorded"] == 0  # the views recorded at the first open still hold
                slots_used.add(slot)
                slot = 1 - slot
            exporter.end()
            held = call("state")
            expect = fused(source)
            assert all(torch.equal(held[n], t.cpu()) for n, t in expect.items()), f"push {push}"
            del source, expect  # the fused expectations live on the GPU too
            call("vime_direct_close")
            exporter.close()
            assert not list(tmp_path.glob("vime-direct-*"))  # shm: the files are gone after the push
            if gpu:  # the engine let go first, so nothing waits in the IPC limbo
                torch.cuda.ipc_collect()
                assert torch.cuda.memory_allocated() == before, f"push {push}: staging not freed"
        assert slots_used == {0, 1}
        record("direct_load_two_processes", device=device, buffer_bytes=size, params=len(want))
    finally:
        requests.put(None)
        engine.join(timeout=60)
        if engine.is_alive():
            engine.kill()
