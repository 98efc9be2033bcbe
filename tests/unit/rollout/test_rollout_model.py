"""`vime.models.policy_model_path`: the one rule by which the rollout manager, the trainer and the
CLI find the policy checkpoint (so engines and trainer ranks start from the same weights)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vime.config import RunConfig, load_config
from vime.models import policy_model_path


def _cfg(tmp_path: Path, *extra: str) -> RunConfig:
    return load_config(
        overrides=["model.tiny_model_size=nano", f"output_dir={tmp_path / 'runs'}", *extra], environ={}
    )


def test_the_kit_model_is_built_once_under_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VIME_MODEL_CACHE", str(tmp_path / "cache"))
    first = policy_model_path(_cfg(tmp_path))
    assert first.is_absolute() and first.parent == (tmp_path / "cache").resolve()
    assert (first / "config.json").is_file() and (first / "vime_kit.json").is_file()
    built_at = (first / "vime_kit.json").stat().st_mtime_ns
    assert policy_model_path(_cfg(tmp_path)) == first
    assert (first / "vime_kit.json").stat().st_mtime_ns == built_at  # not rebuilt


def test_without_a_cache_the_kit_goes_under_the_output_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VIME_MODEL_CACHE", raising=False)
    path = policy_model_path(_cfg(tmp_path))
    assert path.parent == (tmp_path / "runs" / "models").resolve()


def test_an_hf_checkpoint_is_used_as_given_and_a_missing_one_named(tmp_path: Path) -> None:
    ckpt = tmp_path / "Qwen3-0.6B"
    ckpt.mkdir()
    assert policy_model_path(_cfg(tmp_path, f"model.hf_checkpoint={ckpt}")) == ckpt
    with pytest.raises(FileNotFoundError, match="nowhere"):
        policy_model_path(_cfg(tmp_path, f"model.hf_checkpoint={tmp_path / 'nowhere'}"))
    assert not (tmp_path / "runs").exists()  # nothing was built
