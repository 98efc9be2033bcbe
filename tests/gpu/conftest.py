"""Fixtures of the GPU tests: every test here is marked ``gpu`` and skipped without CUDA, unless
``VIME_GPU_DRY_RUN=1`` asks for the CPU dry run (see `gpu_support`).

- ``gpu``: True on the GPU, False in the dry run;
- ``small_model``: a random Qwen3 of the kit's ``small`` shape (``micro`` in the dry run) with a
  filled tokenizer and a peaked output layer (bf16 on the GPU, fp32 on CPU), built here —
  nothing downloaded;
- ``contract_engine``: one engine started with the rollout manager's own command builder (seed
  step 2: ``vllm serve ... --enable-sleep-mode --weight-transfer-config '{"backend":"ipc"}'`` on
  the GPU, the reference engine in the dry run), torn down after the module that uses it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from gpu_support import StartedEngine, build_model, dry_run, engine_port, on_gpu, start_engine

from vime.config import RunConfig, load_config

SMALL_SHAPE = "small"
"""On the GPU: head_dim 64 (FlashAttention-3 sizes), ~25M parameters. The dry run uses ``micro``."""
CONTRACT_CONTEXT = 4608
"""The contract's longest request is 4000 tokens after a short prompt."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    runnable = on_gpu() or dry_run()
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (or VIME_GPU_DRY_RUN=1 for the CPU dry run)")
    for item in items:
        module = getattr(item, "module", None)
        if here in Path(str(item.fspath)).parents and not getattr(module, "RUNS_WITHOUT_GPU", False):
            item.add_marker(pytest.mark.gpu)
            if not runnable:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu() -> bool:
    return on_gpu()


def engine_config(gpu: bool, *, base_port: int, context: int, **engine: object) -> RunConfig:
    """A one-engine run config: vLLM on GPU 0 (colocated, sleep mode, IPC) or one reference engine."""
    layout = (
        {"rollout_num_gpus": 1, "actor_num_gpus_per_node": 1}
        if gpu
        else {"rollout_num_gpus": 0, "rollout_num_engines_cpu": 1, "actor_num_gpus_per_node": 0}
    )
    base = {
        **layout,
        "rollout_num_gpus_per_engine": 1,
        "tensor_model_parallel_size": 1,
        "colocate": True,
        "rollout_max_prompt_len": 512,
        "rollout_max_response_len": context - 512,
        "rollout_max_context_len": context,
        "rollout_seed": 0,
        "engine": {"backend": "vllm" if gpu else "reference", "base_port": base_port, **engine},
    }
    return load_config(base=base, environ={})


@pytest.fixture(scope="session")
def small_model(gpu: bool, tmp_path_factory: pytest.TempPathFactory) -> Path:
    shape = SMALL_SHAPE if gpu else "micro"
    return build_model(tmp_path_factory.mktemp("models") / shape, shape, gpu=gpu)


@pytest.fixture(scope="module")
def contract_engine(
    gpu: bool, small_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StartedEngine]:
    cfg = engine_config(
        gpu,
        base_port=engine_port(),
        context=CONTRACT_CONTEXT,
        gpu_memory_utilization=0.3,
        enforce_eager=True,  # the contract is about behaviour; CUDA graphs cost 30 s of start-up
    )
    engine = start_engine(cfg, small_model, "contract-model", tmp_path_factory.mktemp("engine-logs"))
    try:
        yield engine
    finally:
        engine.stop()
