"""The CUDA IPC payload, built and decoded on CPU: what each rank exports per bucket, how the ranks'
handles are merged per engine (keyed by GPU UUID), and that vLLM's packed-buffer reading of
``tensor_sizes``/``dtype_names``/``shapes`` gets every tensor back bit for bit.

The handle itself is opaque to everything but the engine's worker; here a stand-in ``reduce``
returns the shared buffer so the test can rebuild tensors the way vLLM's worker does.
"""

from __future__ import annotations

import pytest
import torch
from vime_trainer.weight_sync import ipc_rank
from vime_trainer.weight_sync.ipc_payload import (
    IpcBucket,
    IpcPayloadError,
    RankExport,
    RankGpu,
    build_update_info,
    decode_handles,
    ranks_for_engine,
)
from vime_trainer.weights.buckets import pack_buckets

from vime.wire.rollout import EngineInfo


def _model() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("model.embed_tokens.weight", torch.randn(16, 8, generator=g).to(torch.bfloat16)),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(8, 8, generator=g).to(torch.bfloat16)),
        ("model.layers.0.input_layernorm.weight", torch.randn(8, generator=g).to(torch.bfloat16)),
        ("lm_head.weight", torch.randn(16, 8, generator=g).to(torch.bfloat16)),
    ]


def _fake_reduce(t: torch.Tensor) -> tuple[None, tuple[object, ...]]:
    """Stand-in for reduce_tensor: the 'handle' carries a copy of the shared bytes."""
    return None, ("fake-handle", t.clone())


def _exporter(uuid: str, packed: bool, bucket_bytes: int = 300) -> ipc_rank.IpcExporter:
    return ipc_rank.IpcExporter(pack_buckets(_model(), bucket_bytes), packed, uuid, reduce=_fake_reduce)


def _engine(url: str, gpus: list[int]) -> EngineInfo:
    return EngineInfo(index=0, url=url, backend="vllm", status="ready", registered=True, gpu_ids=gpus)


def _unpack_like_vllm(info: dict, uuid: str) -> dict[str, torch.Tensor]:
    """vLLM's packed consumer: split the buffer by tensor_sizes, view as dtype, reshape."""
    handles = decode_handles(info["ipc_handles_pickled"])
    buffer = handles[uuid][1]
    out, offset = {}, 0
    for name, dtype, shape, size in zip(
        info["names"], info["dtype_names"], info["shapes"], info["tensor_sizes"], strict=True
    ):
        out[name] = buffer[offset : offset + size].view(getattr(torch, dtype)).reshape(shape)
        offset += size
    return out


def test_packed_payload_has_vllms_fields_and_round_trips_every_tensor() -> None:
    exports = [RankExport.from_dict(d) for d in iter(_exporter("GPU-a", packed=True).next, None)]
    assert len(exports) == 3  # 256 + 128 + 16 + 256 bytes in buckets of at most 300
    got: dict[str, torch.Tensor] = {}
    for e in exports:
        info = build_update_info([e])
        assert set(info) == {
            "names",
            "dtype_names",
            "shapes",
            "packed",
            "tensor_sizes",
            "ipc_handles_pickled",
        }
        assert info["packed"] is True and set(info["dtype_names"]) == {"bfloat16"}
        assert sum(info["tensor_sizes"]) == e.nbytes
        got.update(_unpack_like_vllm(info, "GPU-a"))
    want = dict(_model())
    assert list(got) == list(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def test_unpacked_payload_has_one_handle_dict_per_tensor_and_no_sizes() -> None:
    export = RankExport.from_dict(_exporter("GPU-a", packed=False, bucket_bytes=1 << 20).next() or {})
    info = build_update_info([export])
    assert "tensor_sizes" not in info and info["packed"] is False
    handles = decode_handles(info["ipc_handles_pickled"])
    assert isinstance(handles, list) and len(handles) == len(info["names"]) == 4
    assert [list(h) for h in handles] == [["GPU-a"]] * 4
    assert torch.equal(handles[3]["GPU-a"][1], dict(_model())["lm_head.weight"])


def test_handles_of_the_ranks_on_an_engines_gpus_are_merged_by_uuid() -> None:
    ranks = [RankGpu(0, "GPU-a", 0), RankGpu(1, "GPU-b", 1), RankGpu(2, "GPU-c", 2), RankGpu(3, "GPU-d", 3)]
    exports = [RankExport.from_dict(_exporter(r.gpu_uuid, packed=True).next() or {}) for r in ranks]
    bucket = IpcBucket(exports, ranks)
    e0 = decode_handles(bucket.update_info(_engine("http://e0", [0, 1]))["ipc_handles_pickled"])
    e1 = decode_handles(bucket.update_info(_engine("http://e1", [2, 3]))["ipc_handles_pickled"])
    assert set(e0) == {"GPU-a", "GPU-b"} and set(e1) == {"GPU-c", "GPU-d"}
    # An engine whose GPUs cannot be matched gets every rank's handle (its workers pick their own).
    anywhere = decode_handles(bucket.update_info(_engine("http://x", []))["ipc_handles_pickled"])
    assert set(anywhere) == {"GPU-a", "GPU-b", "GPU-c", "GPU-d"}


def test_ranks_for_engine_falls_back_to_all_when_gpu_indices_are_unknown() -> None:
    ranks = [RankGpu(0, "GPU-a", None), RankGpu(1, "GPU-b", None)]
    assert ranks_for_engine(_engine("http://e0", [0]), ranks) == [0, 1]
    ranks = [RankGpu(0, "GPU-a", 4), RankGpu(1, "GPU-b", 5)]
    assert ranks_for_engine(_engine("http://e0", [5]), ranks) == [1]


def test_exports_that_disagree_are_refused() -> None:
    a = RankExport.from_dict(_exporter("GPU-a", packed=True).next() or {})
    exp = _exporter("GPU-b", packed=True)
    exp.next()
    b = RankExport.from_dict(exp.next() or {})  # the second bucket: not a collective step
    with pytest.raises(IpcPayloadError, match="disagree"):
        build_update_info([a, b])
    bad = RankExport(0, ["w"], ["bfloat16"], [[2]], packed=True, handles={}, tensor_sizes=None)
    with pytest.raises(IpcPayloadError, match="tensor size"):
        build_update_info([bad])


def test_the_exporter_keeps_only_the_current_bucket_alive() -> None:
    exp = _exporter("GPU-a", packed=True)
    first = exp.next()
    assert first is not None and len(exp.held) == 1
    held = exp.held[0]
    exp.next()
    assert exp.held[0] is not held  # the previous bucket's buffer is dropped once the next is asked for
    exp.next()
    assert exp.next() is None and exp.held == []
    exp.close()


def test_physical_gpu_from_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert ipc_rank.physical_gpu(1) == 5
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1f2e")
    assert ipc_rank.physical_gpu(0) is None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert ipc_rank.physical_gpu(2) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_ipc_on_a_host_without_gpus_says_to_use_shm() -> None:
    with pytest.raises(RuntimeError, match="weight_transport=shm"):
        ipc_rank.ipc_open(object(), packed=True)
