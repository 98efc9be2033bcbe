"""The Megatron backend on GPU (skipped without CUDA): bf16 training, sleep frees memory, export, resume.

Run on the lent H200 (see docs/gpu.md for the bundle):
    bash scripts/gpu/device.sh run python3 -m pytest -x -q -m gpu tests/gpu/test_megatron_gpu.py
With two GPUs (kind nvidia-h200-x2) the TP=2 test runs as well.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from vime_trainer.megatron.actor_group import ActorGroup
from vime_trainer.weights.hf_checkpoint import HFReader

from tests.support.megatron import SEED_ADVANTAGE, Publisher, local_ray, one, rollout_batch, run_config, split
from vime.config import RunConfig
from vime.models.tiny import build_tiny_qwen3

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]
TOKENS = np.random.default_rng(5).integers(0, 128, size=(2, 33))


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    with local_ray():
        yield


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen3(tmp_path_factory.mktemp("models") / "small-bf16", "small", dtype="bfloat16")


def _gpu_config(tmp: Path, gpus: int, tp: int) -> RunConfig:
    trainer = {"lr": 1e-5, "clip_grad": 1.0, "bf16": True}
    return run_config(tmp, tp=tp, actor_num_gpus_per_node=gpus, trainer=trainer)


def test_bf16_training_sleep_export_and_resume(
    ray_cluster: None, bf16_model: Path, redis_url: str, tmp_path: Path
) -> None:
    cfg = _gpu_config(tmp_path, gpus=1, tp=1)
    publish = Publisher(redis_url)
    group = ActorGroup(cfg, str(bf16_model))
    group.start()
    try:
        exported = one(group.call("hf_state_dict"))
        original = HFReader(bf16_model).state_dict()
        assert all(np.array_equal(exported[k], v.float().numpy()) for k, v in original.items())

        (step,) = group.train(publish(split(cfg, rollout_batch(cfg, 0, [SEED_ADVANTAGE] * 8)))).steps
        assert step["loss"] == pytest.approx(-SEED_ADVANTAGE, abs=1e-6)  # ratio exactly 1, fp32 log-probs
        assert np.isfinite(step["grad_norm"]) and step["grad_norm"] > 0

        before = one(group.call("logits", TOKENS))
        awake = group.call("memory_stats")[0]
        group.sleep()
        asleep = group.call("memory_stats")[0]
        assert asleep["allocated_gib"] < 0.2 * awake["allocated_gib"], (awake, asleep)
        buckets = list(group.export_weight_buckets(str(tmp_path / "shm")))  # from the CPU backup
        assert buckets
        group.wake_up()
        assert np.array_equal(one(group.call("logits", TOKENS)), before)

        path = group.save(0, {"weight_version": 2})
        group.train(publish(split(cfg, rollout_batch(cfg, 1))))
        assert group.load(path) is not None
        assert np.array_equal(one(group.call("logits", TOKENS)), before)
    finally:
        group.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tp2_on_two_gpus_matches_tp1(
    ray_cluster: None, bf16_model: Path, redis_url: str, tmp_path: Path
) -> None:
    logits, losses = [], []
    publish = Publisher(redis_url)
    for tp in (1, 2):
        cfg = _gpu_config(tmp_path / f"tp{tp}", gpus=tp, tp=tp)
        group = ActorGroup(cfg, str(bf16_model))
        group.start()
        try:
            logits.append(one(group.call("logits", TOKENS)))
            losses.append(group.train(publish(split(cfg, rollout_batch(cfg, 0)))).steps[0])
        finally:
            group.shutdown()
    assert np.abs(logits[0] - logits[1]).max() < 0.1  # bf16 matmuls split differently
    assert losses[0]["pg_loss"] == pytest.approx(losses[1]["pg_loss"], abs=1e-6)
    assert losses[0]["grad_norm"] == pytest.approx(losses[1]["grad_norm"], rel=0.05)


@pytest.mark.parametrize(("offload", "keep_weights"), [(True, False), (False, False), (True, True)])
def test_offloader_cycle_with_megatrons_mixed_precision_optimizer(offload: bool, keep_weights: bool) -> None:
    """Megatron's bf16 optimizer (fp32 masters, fused AdamW): a sleep frees the parameters, masters and
    Adam state (without offload: the parameters only; the rest stays, nothing is copied; keeping
    the weights: the parameters stay until `drop_weights`, as the loop's push reads them), the
    wake-up rebuilds the parameters from the masters, and training goes on bit for bit as on a twin
    that never slept. The wake-up returns before Adam's state is back (side stream): the step waits
    for it through `state_ready`, as `Passes.step` does, and so does a sleep right after a wake-up;
    the state is large enough (140 MB) that a step not waiting would read it half copied.
    (tests/unit/trainer/test_offloader.py: the same on CPU with a stand-in.)"""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
    from vime_trainer.megatron.memory import Offloader, check_room_for_engines

    def build() -> tuple[torch.nn.Module, Float16OptimizerWithFloat16Params]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(2048, 8192), torch.nn.Tanh(), torch.nn.Linear(8192, 64))
        model = model.to("cuda", torch.bfloat16)
        config = OptimizerConfig(optimizer="adam", lr=1e-2, bf16=True, params_dtype=torch.bfloat16)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        return model, Float16OptimizerWithFloat16Params(inner, config, None, lambda *_: None)

    def step(
        model: torch.nn.Module,
        opt: Float16OptimizerWithFloat16Params,
        seed: int,
        state_ready: Callable[[], None] = lambda: None,
    ) -> None:
        x = torch.randn(64, 2048, generator=torch.Generator().manual_seed(seed)).to("cuda", torch.bfloat16)
        model(x).float().square().mean().backward()
        opt._copy_model_grads_to_main_grads()
        state_ready()
        opt.optimizer.step()
        opt._copy_main_params_to_model_params()

    model, opt = build()
    twin, twin_opt = build()
    for seed in (1, 2):
        step(model, opt, seed)
        step(twin, twin_opt, seed)
    offloader = Offloader(model, opt, "cuda")
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()  # the sleep frees them too (they come back with a GEMM)
    base = torch.cuda.memory_allocated()
    state = sum(t.nbytes for s in opt.optimizer.state.values() for t in s.values())
    params = sum(p.nbytes for p in model.parameters())
    offloader.sleep(offload, keep_weights)
    if keep_weights:
        assert offloader.weights_resident
        assert torch.cuda.memory_allocated() <= base - state - params * 2  # masters and state went
        assert torch.cuda.memory_allocated() >= params  # the bf16 parameters did not
        offloader.drop_weights()
    assert not offloader.weights_resident
    if offload:
        assert torch.cuda.memory_allocated() <= base - state - params - params * 2  # masters are fp32
        assert all(h.is_pinned() for h in offloader._host)
        assert offloader.host_bytes == state + 2 * params  # masters and state; parameters rebuilt
    else:
        assert base - torch.cuda.memory_allocated() >= params and offloader.host_bytes == 0
        assert torch.cuda.memory_reserved() >= state + 2 * params  # the state stays on the GPU
        check_room_for_engines("cuda:0", 0.5)
        with pytest.raises(MemoryError, match="offload_train=false keeps"):
            check_room_for_engines("cuda:0", 1.0)  # engines asking for the whole GPU leave no room
    offloader.wake_up()
    assert torch.cuda.memory_allocated() == base
    if offload:
        assert offloader._state_copied is not None  # Adam's state still on its way in
        offloader.sleep()  # reads the state out only once it is back
        offloader.wake_up()
    for seed in (3, 4):
        step(model, opt, seed, offloader.state_ready)
        step(twin, twin_opt, seed)
    for a, b in zip(
        [*model.parameters(), *opt.fp32_from_float16_groups[0]],
        [*twin.parameters(), *twin_opt.fp32_from_float16_groups[0]],
        strict=True,
    ):
        assert torch.equal(a, b)
    if keep_weights:  # after a wake-up: the masters' and the state's segment goes back whole
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved()
        offloader.sleep(keep_weights=True)
        assert reserved - torch.cuda.memory_reserved() >= state + params * 2
        offloader.drop_weights()
