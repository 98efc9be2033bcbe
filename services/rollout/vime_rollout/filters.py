"""Dynamic sampling filters (seed step 27): decide per finished group whether it enters the batch.

A filter is any callable ``(config, group) -> bool | FilterOutput`` named by import path in
``dynamic_sampling_filter_path`` (``package.module:function`` or ``package.module.function``).
A dropped group makes the rollout loop fetch more prompts (``over_sampling_batch_size`` at a
time) until the batch is full.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vime.types import Sample


@dataclass(frozen=True)
class FilterOutput:
    """A filter's verdict; ``reason`` is counted in the rollout metrics when a group is dropped."""

    keep: bool
    reason: str | None = None


GroupFilter = Callable[[Any, list[Sample]], "bool | FilterOutput"]


def check_reward_nonzero_std(config: Any, group: list[Sample], **_: Any) -> FilterOutput:
    """Keep a group only if its rewards differ: an all-equal group normalises to zero advantage."""
    rewards = [float(s.reward if s.reward is not None else 0.0) for s in group]
    mean = sum(rewards) / len(rewards)
    var = sum((r - mean) ** 2 for r in rewards) / len(rewards)
    keep = math.sqrt(var) > 0.0
    return FilterOutput(keep, None if keep else f"zero_std_{mean:g}")


def load_function(path: str) -> Callable[..., Any]:
    """``pkg.mod:func`` or ``pkg.mod.func`` → the function; ValueError with the path if it fails."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{path!r} is not an import path (package.module:function)")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import {path!r}: {exc}") from None
    if not callable(fn):
        raise ValueError(f"{path!r} is not callable")
    return fn


def apply_filter(fn: Callable[..., Any] | None, config: Any, group: list[Sample]) -> FilterOutput:
    """Run ``fn`` on a group; no filter keeps everything; a bare bool is accepted too."""
    if fn is None:
        return FilterOutput(True)
    out = fn(config, group)
    if isinstance(out, FilterOutput):
        return out
    if isinstance(out, bool):
        return FilterOutput(out, None if out else "filtered")
    keep = getattr(out, "keep", None)
    if isinstance(keep, bool):
        return FilterOutput(keep, getattr(out, "reason", None))
    raise TypeError(f"dynamic filter returned {type(out).__name__}, expected bool or FilterOutput")
