"""Fixtures of the rollout manager's unit tests: the kit's character tokenizer (built, not downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny-model kit's character-level tokenizer (one token per character)."""
    from vime.models.tiny import build_tokenizer

    out: Path = tmp_path_factory.mktemp("tok")
    return build_tokenizer(out)
