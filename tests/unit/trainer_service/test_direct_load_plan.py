"""The direct weight load without processes: the layout an engine reports, the trainer's plan and its
refusals, the packing into a staging buffer, the extension's copy into fused parameters, and the
checksum both sides compute. The check is exactness: after a push every fused vLLM-style parameter
equals the concatenation of its HF parts (``qkv_proj`` = q, k, v; ``gate_up_proj`` = gate, up)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vime_rollout.vllm_ext.direct_load import DirectLoadExtension, engine_refusal, hf_parts, model_layout
from vime_trainer.weight_sync.direct_plan import DirectLoadRefused, DirectPlan, group_into_buckets
from vime_trainer.weight_sync.direct_rank import DirectExporter

from vime.models.tiny import build_tiny_qwen3
from vime.wire.direct_load import ALIGN, aligned, checksum, encode_load, encode_open

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


def spec_of(hf: dict[str, torch.Tensor]) -> dict[str, tuple[list[int], str]]:
    return {n: (list(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in hf.items()}


def worker_for(model: torch.nn.Module, **config: object) -> DirectLoadExtension:
    """``DirectLoadExtension`` as an engine mixes it into a worker: ``model_runner``, ``device``, ``vllm_config``."""
    worker = DirectLoadExtension()
    worker.model_runner = SimpleNamespace(get_model=lambda: model)  # type: ignore[attr-defined]
    worker.device = torch.device("cpu")  # type: ignore[attr-defined]
    worker.vllm_config = SimpleNamespace(  # type: ignore[attr-defined]
        model_config=SimpleNamespace(quantization=config.get("quantization")),
        parallel_config=SimpleNamespace(tensor_parallel_size=config.get("tp", 1), pipeline_parallel_size=1),
    )
    return worker


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


def test_a_push_through_staging_buffers_fills_every_fused_parameter_exactly(
    hf_weights: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    model, expected = vllm_like(hf_weights)
    worker = worker_for(model)
    plan = DirectPlan.from_layout(worker.vime_direct_layout()["params"])
    plan.check_export(spec_of(hf_weights))
    slots, size = plan.staging(64 << 10)
    assert slots == 2
    exporter = DirectExporter(plan, size, slots, "shm", share=True, directory=tmp_path)
    worker.vime_direct_open(encode_open("s1", exporter.specs))
    exporter.begin(shuffled_within_layers(hf_weights))
    buckets, slot = 0, 0
    while (packed := exporter.next(slot)) is not None:
        assert all(offset % ALIGN == 0 for _, offset, _ in packed["params"])
        got = worker.vime_direct_load(encode_load("s1", slot, packed["index"], packed["params"]))
        assert got["checksum"] == packed["checksum"] and got["bytes"] == sum(n for *_, n in packed["params"])
        buckets, slot = buckets + 1, 1 - slot
    exporter.close()
    assert buckets > 3 and not list(tmp_path.iterdir())  # the staging files are gone
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], t) for n, t in expected.items())
    with pytest.raises(RuntimeError, match="session 'other' is not open"):
        worker.vime_direct_load(encode_load("other", 0, 0, []))


def test_a_model_is_staged_in_one_buffer_only_when_it_fits_one_bucket(
    hf_weights: dict[str, torch.Tensor],
) -> None:
    """Two buffers otherwise: the trainer packs one while the engines copy out of the other."""
    model, _ = vllm_like(hf_weights)
    plan = DirectPlan.from_layout(worker_for(model).vime_direct_layout()["params"])
    total = sum(aligned(p.nbytes) for p in plan.params.values())
    largest = max(aligned(p.nbytes) for p in plan.params.values())
    assert plan.staging(1 << 30) == (1, total)
    assert plan.staging(total) == (1, total)
    assert plan.staging(total - ALIGN) == (2, total - ALIGN)
    assert plan.staging(ALIGN) == (2, largest)  # never smaller than the largest parameter


def test_a_parameter_reallocated_since_the_open_is_recorded_again(
    hf_weights: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    """A sleep that gives a parameter new storage must not leave the load writing into the old one."""
    model, expected = vllm_like(hf_weights)
    worker = worker_for(model)
    plan = DirectPlan.from_layout(worker.vime_direct_layout()["params"])
    slots, size = plan.staging(1 << 30)
    exporter = DirectExporter(plan, size, slots, "shm", share=True, directory=tmp_path)
    worker.vime_direct_open(encode_open("s", exporter.specs))
    head = dict(model.named_parameters())["lm_head.weight"]
    head.data = torch.zeros_like(head.data)  # new storage, as the reference engine's level-2 wake
    exporter.begin(iter(hf_weights.items()))
    packed = exporter.next(0)
    assert packed is not None and exporter.next(0) is None
    got = worker.vime_direct_load(encode_load("s", 0, 0, packed["params"]))
    exporter.close()
    assert got["rerecorded"] == 1 and got["checksum"] == packed["checksum"]
    assert torch.equal(head, expected["lm_head.weight"])


def test_engines_and_exports_that_cannot_be_loaded_exactly_are_refused(
    hf_weights: dict[str, torch.Tensor],
) -> None:
    model, _ = vllm_like(hf_weights)
    layout = model_layout(model)
    plan = DirectPlan.from_layout(layout)
    spec = spec_of(hf_weights)
    cases = {
        "the trainer exports 1 tensor": {**spec, "model.layers.0.mlp.extra.weight": ([2], "bfloat16")},
        r"needs \['model.layers.1.mlp.up_proj.weight'\]": {
            k: v for k, v in spec.items() if "layers.1.mlp.up_proj" not in k
        },
        r"holds lm_head.weight in bfloat16, the trainer exports \['float32'\]": {
            **spec,
            "lm_head.weight": (spec["lm_head.weight"][0], "float32"),
        },
        r"lm_head.weight has \d+ bytes": {**spec, "lm_head.weight": ([7, 3], "bfloat16")},
    }
    for message, export in cases.items():
        with pytest.raises(DirectLoadRefused, match=message):
            plan.check_export(export)
    layout[0] = {**layout[0], "writable": False, "why": "a QuantizedTensor, not a plain tensor"}
    with pytest.raises(DirectLoadRefused, match="cannot be written in place: a QuantizedTensor"):
        DirectPlan.from_layout(layout)
    assert "quantised (fp8)" in str(engine_refusal(worker_for(model, quantization="fp8")))
    assert "tensor_parallel_size=2" in str(engine_refusal(worker_for(model, tp=2)))
    assert engine_refusal(worker_for(model)) is None
    with pytest.raises(DirectLoadRefused, match="does not fit"):
        list(group_into_buckets(iter(hf_weights.items()), plan, 1024))


def test_the_checksum_sees_any_changed_or_misplaced_bytes() -> None:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(4096, generator=gen).view(torch.uint8)
    b = torch.randn(4096, generator=gen).view(torch.uint8)
    odd = torch.arange(7, dtype=torch.uint8)
    base = checksum([a, b, odd])
    assert base == checksum([a.clone(), b.clone(), odd.clone()])
    flipped = a.clone()
    flipped[1000] ^= 1
    assert checksum([flipped, b, odd]) != base
    assert checksum([b, a, odd]) != base  # parameters swapped
    halves = a.view(2, -1).flip(0).reshape(-1)
    assert checksum([halves, b, odd]) != base  # parts of a parameter in the wrong order
    unaligned = torch.zeros(a.numel() + 1, dtype=torch.uint8)
    unaligned[1:] = a
    assert checksum([unaligned[1:], b, odd]) == base  # alignment does not change the value
