"""The fast weight load without CUDA: the layout an engine reports, the trainer's plan and packing,
the byte copy into fused parameters, and the driver's protocol against a fake engine over HTTP.

Only the CUDA IPC hand-over itself (``open_ipc_buffer``, ``fast_rank``) needs the GPU; here the
packed buffer travels as bytes inside the payload, and the fake engine copies it with the real
``copy_into``. The check is exactness: after a push, every fused vLLM-style parameter equals the
concatenation of its HF parts (``qkv_proj`` = q, k, v; ``gate_up_proj`` = gate, up).
"""

from __future__ import annotations

import asyncio
import base64
import pickle
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi import FastAPI, Request
from vime_rollout.vllm_ext.fast_loader import copy_into, hf_parts, model_layout
from vime_trainer.weight_sync import fast_sync
from vime_trainer.weight_sync.fast_plan import FastPlan, FastPlanError, group_into_params
from vime_trainer.weight_sync.ipc_payload import RankGpu

from vime import procs
from vime.models.tiny import build_tiny_qwen3
from vime.wire.rollout import EngineInfo

RUNS_WITHOUT_GPU = True
"""Read by this folder's conftest: these tests need no GPU and no dry run."""

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


@pytest.fixture(scope="module")
def hf_weights(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    model = build_tiny_qwen3(tmp_path_factory.mktemp("m") / "micro", "micro", dtype="bfloat16")
    return load_file(str(model / "model.safetensors"))


def vllm_like(hf: dict[str, torch.Tensor]) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A module with vLLM's parameter names (fused q/k/v and gate/up), zeroed; and what it should hold."""
    expected: dict[str, torch.Tensor] = {}
    for name, t in hf.items():
        fused = name.replace("q_proj", "qkv_proj").replace("gate_proj", "gate_up_proj")
        if any(p in name for p in ("k_proj", "v_proj", "up_proj")) and "gate_up" not in name:
            continue
        parts = hf_parts(fused, PACKED)
        expected[fused] = torch.cat([hf[p] for p in parts]) if len(parts) > 1 else t
    root = torch.nn.Module()
    root.packed_modules_mapping = PACKED  # type: ignore[assignment]
    for name, t in expected.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(torch.zeros_like(t), requires_grad=False))
    return root, expected


def shuffled_within_layers(hf: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's stream: Megatron's order, not vLLM's (parts of a layer in any order)."""
    items = list(hf.items())
    random.Random(3).shuffle(items)
    return iter(sorted(items, key=lambda kv: kv[0].split(".")[2] if ".layers." in kv[0] else ""))


def test_hf_parts_expand_fused_names_in_storage_order() -> None:
    assert hf_parts("model.layers.3.self_attn.qkv_proj.weight", PACKED) == [
        "model.layers.3.self_attn.q_proj.weight",
        "model.layers.3.self_attn.k_proj.weight",
        "model.layers.3.self_attn.v_proj.weight",
    ]
    assert (
        hf_parts("model.layers.0.mlp.gate_up_proj.weight", PACKED)[1] == "model.layers.0.mlp.up_proj.weight"
    )
    assert hf_parts("lm_head.weight", PACKED) == ["lm_head.weight"]


def test_a_push_in_buckets_fills_every_fused_parameter_exactly(hf_weights: dict[str, torch.Tensor]) -> None:
    model, expected = vllm_like(hf_weights)
    plan = FastPlan.from_layout(model_layout(model))
    buckets = list(group_into_params(shuffled_within_layers(hf_weights), plan, bucket_bytes=64 << 10))
    assert len(buckets) > 3
    written = 0
    for bucket in buckets:
        buffer, entries = bucket.pack()
        assert [e[1] for e in entries] == sorted(e[1] for e in entries)  # back to back
        written += copy_into(model, buffer, entries)
    params = dict(model.named_parameters())
    assert written == sum(t.numel() * t.element_size() for t in expected.values())
    for name, want in expected.items():
        assert torch.equal(params[name], want), name


def test_plans_that_cannot_be_written_are_refused(hf_weights: dict[str, torch.Tensor]) -> None:
    model, _ = vllm_like(hf_weights)
    layout = model_layout(model)
    plan = FastPlan.from_layout(layout)
    missing = {k: v for k, v in hf_weights.items() if "layers.1.mlp.up_proj" not in k}
    with pytest.raises(FastPlanError, match="no weights pushed"):
        list(group_into_params(iter(missing.items()), plan, 1 << 30))
    extra = {**hf_weights, "model.layers.0.mlp.extra.weight": torch.zeros(2)}
    with pytest.raises(FastPlanError, match="has no parameter for"):
        list(group_into_params(iter(extra.items()), plan, 1 << 30))
    wider = {k: v.float() if k == "lm_head.weight" else v for k, v in hf_weights.items()}
    with pytest.raises(FastPlanError, match=r"lm_head\.weight: the trainer has \d+ bytes"):
        list(group_into_params(iter(wider.items()), plan, 1 << 30))
    same_size = {k: v.half() if k == "lm_head.weight" else v for k, v in hf_weights.items()}
    with pytest.raises(FastPlanError, match=r"trainer dtype \['float16'\] but the engine holds bfloat16"):
        list(group_into_params(iter(same_size.items()), plan, 1 << 30))
    layout[0]["writable"] = False
    with pytest.raises(FastPlanError, match="cannot be written in place"):
        FastPlan.from_layout(layout)
    buffer = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="8 bytes pushed"):
        copy_into(model, buffer, [["lm_head.weight", 0, 8]])
    with pytest.raises(KeyError):
        copy_into(model, buffer, [["no.such.weight", 0, 8]])


def test_the_worker_extension_reports_its_layout_and_loads_a_payload(
    hf_weights: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``FastWeightLoader`` as vLLM mixes it into a worker: ``self.model_runner.get_model()``, ``self.device``."""
    from types import SimpleNamespace

    from vime_rollout.vllm_ext import fast_loader

    model, expected = vllm_like(hf_weights)
    worker = fast_loader.FastWeightLoader()
    worker.model_runner = SimpleNamespace(get_model=lambda: model)  # type: ignore[attr-defined]
    worker.device = torch.device("cpu")  # type: ignore[attr-defined]
    plan = FastPlan.from_layout(worker.vime_fast_layout())
    (bucket,) = group_into_params(iter(hf_weights.items()), plan, 1 << 30)
    buffer, entries = bucket.pack()
    monkeypatch.setattr(fast_loader, "open_ipc_buffer", lambda handles, device: handles["cpu-uuid"])
    payload = base64.b64encode(pickle.dumps({"handles": {"cpu-uuid": buffer}, "params": entries})).decode()
    assert worker.vime_fast_load(payload) == {"params": len(expected), "bytes": buffer.numel()}
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], t) for n, t in expected.items())


# --- the driver against a fake engine over HTTP ----------------------------------------------


def fake_engine(model: torch.nn.Module, calls: list[str]) -> FastAPI:
    """vLLM's routes the fast push uses; ``vime_fast_load`` takes the buffer as bytes in the payload."""
    app = FastAPI()

    @app.post("/pause")
    async def pause(request: Request) -> dict[str, str]:
        calls.append(f"pause:{request.query_params['mode']}")
        return {"status": "paused"}

    @app.post("/reset_prefix_cache")
    async def reset() -> dict[str, bool]:
        calls.append("flush")
        return {"success": True}

    @app.post("/resume")
    async def resume() -> dict[str, str]:
        calls.append("resume")
        return {"status": "resumed"}

    @app.post("/collective_rpc")
    async def rpc(request: Request) -> dict[str, Any]:
        body = await request.json()
        calls.append(body["method"])
        if body["method"] == "vime_fast_layout":
            return {"results": [model_layout(model)]}
        data = pickle.loads(base64.b64decode(body["args"][0]))
        buffer = torch.frombuffer(bytearray(data["handles"]["cpu"]), dtype=torch.uint8)
        return {
            "results": [{"params": len(data["params"]), "bytes": copy_into(model, buffer, data["params"])}]
        }

    return app


def serve(app: FastAPI) -> tuple[str, Any]:
    import uvicorn

    port = procs.free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 20
    while not procs.port_open("127.0.0.1", port):
        assert time.monotonic() < deadline, "fake engine did not start"
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server


def test_fast_push_pauses_flushes_loads_every_byte_and_resumes(
    hf_weights: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    model, expected = vllm_like(hf_weights)
    calls: list[str] = []
    url, server = serve(fake_engine(model, calls))

    def cpu_buckets(group: Any, plan: FastPlan, bucket_bytes: int) -> Iterator[fast_sync.FastBucket]:
        for b in group_into_params(shuffled_within_layers(hf_weights), plan, bucket_bytes):
            buffer, entries = b.pack()
            export = {
                "index": b.index,
                "handles": {"cpu": buffer.numpy().tobytes()},
                "params": entries,
                "nbytes": buffer.numel(),
            }
            yield fast_sync.FastBucket([export], [RankGpu(0, "cpu")])

    monkeypatch.setattr(fast_sync, "fast_buckets", cpu_buckets)
    try:
        sync = fast_sync.FastIpcSync(group=None, bucket_bytes=128 << 10)  # type: ignore[arg-type]
        info = EngineInfo(index=0, url=url, backend="vllm", status="ready", registered=True)
        report = asyncio.run(sync.push([info], version=2, flush=True))
    finally:
        server.should_exit = True
    loads = calls.count("vime_fast_load")
    assert calls == ["vime_fast_layout", "pause:abort", "flush", *["vime_fast_load"] * loads, "resume"]
    assert loads == report.buckets > 1
    assert report.nbytes == sum(t.numel() * t.element_size() for t in expected.values())
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], t) for n, t in expected.items())
