"""Megatron ranks on CPU: resume equals an uninterrupted run, sleep/wake changes nothing, weights export
(buckets and the HF export command) bit for bit, and Qwen2 / Llama checkpoints load exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from vime_trainer.megatron.actor_group import ActorGroup, TrainerError
from vime_trainer.megatron.checkpoint import STATE_FILE, latest_checkpoint
from vime_trainer.weights.bucket_files import read_bucket
from vime_trainer.weights.hf_checkpoint import HFReader

from tests.support.hf_models import build_hf
from tests.support.megatron import Publisher, hf_logits, one, rollout_batch, run_config, split

TOKENS = np.random.default_rng(3).integers(0, 128, size=(2, 17))


def _started(cfg, checkpoint: Path) -> ActorGroup:  # type: ignore[no-untyped-def]
    group = ActorGroup(cfg, str(checkpoint))
    group.start()
    return group


def _train(group: ActorGroup, publish: Publisher, rollout_id: int) -> dict[str, float]:
    cfg = group.config
    (step,) = group.train(publish(split(cfg, rollout_batch(cfg, rollout_id, seed=100 + rollout_id)))).steps
    return step


@pytest.mark.slow
def test_resumed_run_and_sleep_wake_match_an_uninterrupted_run(
    ray_cluster: None, qwen3: Path, publish: Publisher, tmp_path: Path
) -> None:
    cfg = run_config(tmp_path, trainer={"lr": 1e-2})
    straight = _started(cfg, qwen3)
    try:
        assert straight.load() is None  # nothing to resume from yet
        expected = [_train(straight, publish, r) for r in range(3)]
        expected_logits = one(straight.call("logits", TOKENS))
    finally:
        straight.shutdown()

    first = _started(cfg, qwen3)
    try:
        got = [_train(first, publish, 0)]
        before = one(first.call("logits", TOKENS))
        freed = first.call("sleep")
        assert freed[0]["freed_gib"] > 0
        assert first.sleep() == {"freed_gib": 0.0}  # sleeping twice is harmless
        first.wake_up()
        assert np.array_equal(one(first.call("logits", TOKENS)), before)
        first.sleep()
        with pytest.raises(TrainerError, match="asleep"):  # only the driver loop wakes the ranks
            first.save(0, {})
        first.wake_up()  # seed step 37
        got.append(_train(first, publish, 1))
        # In the background: the files are written while the ranks train on, and hold rollout 1's state.
        path = first.save(1, {"data_position": 16, "weight_version": 3}, wait=False)
        _train(first, publish, 2)
        assert not (Path(path) / STATE_FILE).exists()  # incomplete until every rank has written
        assert first.saved() == path and first.saved() is None
    finally:
        first.shutdown()
    state = json.loads((Path(path) / STATE_FILE).read_text())
    assert (state["rollout_id"], state["next_rollout_id"]) == (1, 2)
    assert state["run_state"] == {"data_position": 16, "weight_version": 3}
    assert state["layout"] == {"tp": 1, "pp": 1, "dp": 1}

    resumed = _started(cfg, qwen3)
    try:
        loaded = resumed.load()
        assert (
            loaded is not None
            and loaded["next_rollout_id"] == 2
            and loaded["run_state"]["data_position"] == 16
        )
        got.append(_train(resumed, publish, 2))
        assert np.array_equal(one(resumed.call("logits", TOKENS)), expected_logits)
    finally:
        resumed.shutdown()
    for a, b in zip(got, expected, strict=True):
        learned = [{k: v for k, v in m.items() if not k.startswith("t_")} for m in (a, b)]  # not the timings
        assert (
            learned[0] == learned[1] and "loss" in learned[0]
        )  # bit-identical: loss, grad norm, entropy, ...


def test_incomplete_checkpoint_is_skipped(tmp_path: Path) -> None:
    done, broken = tmp_path / "rollout_0000003", tmp_path / "rollout_0000007"
    done.mkdir()
    (done / STATE_FILE).write_text(json.dumps({"rollout_id": 3}))
    broken.mkdir()  # a save that died before rank 0 marked it complete
    found = latest_checkpoint(tmp_path)
    assert found is not None and found[0] == done
    assert latest_checkpoint(tmp_path / "missing") is None


@pytest.mark.slow
def test_weight_export_at_tp2_is_bit_exact(
    ray_cluster: None, qwen3: Path, publish: Publisher, tmp_path: Path
) -> None:
    cfg = run_config(tmp_path, tp=2, ranks=2, trainer={"lr": 1e-2, "packed_buffer_size_bytes": 16384})
    original = HFReader(qwen3).state_dict()
    group = _started(cfg, qwen3)
    try:
        files = list(group.export_weight_buckets(str(tmp_path / "shm")))
        assert len(files) > 3 and all(f["nbytes"] <= 16384 or len(f["names"]) == 1 for f in files)
        merged: dict[str, torch.Tensor] = {}
        for f in files:
            merged.update(read_bucket(f["path"]))
            os.unlink(f["path"])
        assert merged.keys() == original.keys()
        assert all(torch.equal(merged[k], v) for k, v in original.items())

        _train(group, publish, 0)
        trained = one(group.call("hf_state_dict"))
        logits = one(group.call("logits", TOKENS))
        path = group.save(0, {})
        group.sleep()  # the push reads the step-41 backup while the model sleeps
        asleep = {
            k: v
            for f in group.export_weight_buckets(str(tmp_path / "shm2"))
            for k, v in read_bucket(f["path"]).items()
        }
    finally:
        group.shutdown()
    assert asleep.keys() == trained.keys() and all(
        np.array_equal(asleep[k].numpy(), v) for k, v in trained.items()
    )
    assert any(not np.array_equal(trained[k], original[k].numpy()) for k in trained)  # training changed them

    out = tmp_path / "hf"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vime_trainer.export",
            "--checkpoint",
            str(Path(path).parent),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    exported = HFReader(out).state_dict()
    assert exported.keys() == trained.keys()
    assert all(np.array_equal(exported[k].numpy(), v) for k, v in trained.items())
    assert (out / "tokenizer.json").is_file()
    assert np.abs(hf_logits(out, TOKENS) - logits).max() < 1e-5


def test_export_command_reports_a_missing_checkpoint(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vime_trainer.export",
            "--checkpoint",
            str(tmp_path),
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "neither a complete checkpoint" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(("family", "tie", "tp"), [("qwen2", True, 2), ("llama", False, 1)])
def test_qwen2_and_llama_load_exactly(
    ray_cluster: None, publish: Publisher, tmp_path: Path, family: str, tie: bool, tp: int
) -> None:
    checkpoint = build_hf(tmp_path / family, family, tie, seed=1)
    cfg = run_config(tmp_path, tp=tp, ranks=tp)
    group = _started(cfg, checkpoint)
    try:
        logits = one(group.call("logits", TOKENS))
        exported = one(group.call("hf_state_dict"))
        step = _train(group, publish, 0)
    finally:
        group.shutdown()
    diff = np.abs(logits - hf_logits(checkpoint, TOKENS)).max()
    assert diff == 0.0 if tp == 1 else diff < 1e-5
    original = HFReader(checkpoint).state_dict()
    assert exported.keys() == original.keys()  # tied: no lm_head, as HF stores it
    assert all(np.array_equal(exported[k], v.numpy()) for k, v in original.items())
    assert np.isfinite(step["loss"]) and step["grad_norm"] > 0
