"""HF checkpoints shared by the trainer's unit tests (built once per session, nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.hf_models import build_hf


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> HF checkpoint dir: qwen3 (kit nano), qwen2 tied with biases, llama untied and tied."""
    from vime.models.tiny import build_tiny_qwen3

    root = tmp_path_factory.mktemp("hf")
    return {
        "qwen3": build_tiny_qwen3(root / "qwen3", "nano"),
        "qwen2_tied": build_hf(root / "qwen2", "qwen2", tie=True),
        "llama": build_hf(root / "llama", "llama", tie=False),
        "llama_tied": build_hf(root / "llama_tied", "llama", tie=True),
    }
