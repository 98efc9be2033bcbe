"""Weight buckets, their safetensors files, and writing HF checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vime_trainer.weights.bucket_files import read_bucket, update_info, write_bucket
from vime_trainer.weights.buckets import pack_buckets, unflatten
from vime_trainer.weights.hf_checkpoint import INDEX, SINGLE, HFReader, save_hf_checkpoint


def _tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a", torch.randn(100, generator=g)),  # 400 B
        ("b", torch.randn(50, generator=g).to(torch.bfloat16)),  # 100 B
        ("c", torch.randn(300, generator=g)),  # 1200 B: larger than the bucket
        ("d", torch.randint(0, 9, (10, 3), generator=g)),  # 240 B
        ("e", torch.randn(2, 2, generator=g)),  # 16 B
    ]


def test_buckets_respect_the_size_and_keep_the_order() -> None:
    buckets = list(pack_buckets(_tensors(), 600))
    assert [b.names for b in buckets] == [["a", "b"], ["c"], ["d", "e"]]
    assert [b.index for b in buckets] == [0, 1, 2]
    assert [b.nbytes for b in buckets] == [500, 1200, 256]
    assert all(b.nbytes <= 600 or len(b) == 1 for b in buckets)


def test_buckets_reassemble_to_the_input() -> None:
    merged = {n: t for b in pack_buckets(_tensors(), 600) for n, t in b.state_dict().items()}
    assert merged.keys() == dict(_tensors()).keys()
    assert all(torch.equal(merged[n], t) for n, t in _tensors())


def test_flattened_bucket_round_trips() -> None:
    (bucket,) = pack_buckets(_tensors(), 1 << 20)
    buffer, specs = bucket.flatten()
    assert buffer.dtype == torch.uint8 and buffer.numel() >= bucket.nbytes
    assert all(s.offset % 256 == 0 for s in specs)
    back = unflatten(buffer, specs)
    for name, t in _tensors():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


def test_bad_bucket_size_is_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        list(pack_buckets(_tensors(), 0))


def test_bucket_file_holds_exactly_the_bucket(tmp_path: Path) -> None:
    fused = torch.arange(12.0).reshape(6, 2)
    gate, up = fused.chunk(2)  # views sharing one storage, as a fc1 split produces
    pairs = [("gate", gate), ("up", up), *_tensors()[:2]]
    (bucket,) = pack_buckets(pairs, 1 << 20)
    path = write_bucket(bucket, tmp_path)
    assert path.parent == tmp_path and path.suffix == ".safetensors"
    assert not list(tmp_path.glob("*.tmp"))
    loaded = read_bucket(path)
    assert sorted(loaded) == sorted(bucket.names)
    assert all(torch.equal(loaded[n], t) for n, t in pairs)
    assert update_info(path) == {"backend": "shm", "path": str(path)}


def test_hf_checkpoint_written_in_shards_reads_back(tmp_path: Path) -> None:
    out = save_hf_checkpoint(_tensors(), tmp_path / "sharded", shard_bytes=600)
    assert (out / INDEX).is_file() and len(list(out.glob("model-*-of-00003.safetensors"))) == 3
    reader = HFReader(out)
    assert sorted(reader.names()) == sorted(n for n, _ in _tensors())
    assert all(torch.equal(reader.get(n), t) for n, t in _tensors())
    single = save_hf_checkpoint(_tensors(), tmp_path / "single", shard_bytes=1 << 20, dtype=torch.float32)
    assert (single / SINGLE).is_file() and not (single / INDEX).exists()
    assert HFReader(single).get("b").dtype == torch.float32


def test_hf_checkpoint_copies_config_and_tokenizer(hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    base = hf_checkpoints["qwen3"]
    reader = HFReader(base)
    out = save_hf_checkpoint(((n, reader.get(n)) for n in reader.names()), tmp_path / "copy", base_dir=base)
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (out / name).read_bytes() == (base / name).read_bytes()
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(str(base))
    b = AutoModelForCausalLM.from_pretrained(str(out))
    ids = torch.tensor([[5, 6, 7, 8]])
    assert torch.equal(a(ids).logits, b(ids).logits)


def test_missing_tensor_and_missing_checkpoint_are_clear(
    hf_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    with pytest.raises(KeyError, match="not in the checkpoint"):
        HFReader(hf_checkpoints["qwen3"]).get("model.layers.99.mlp.up_proj.weight")
    with pytest.raises(FileNotFoundError, match="neither"):
        HFReader(tmp_path)
