"""A reward with spread for random-weight models (the GPU loop's reward function, by import path).

A random model never answers a task, so a task reward would be 0 for every sample: zero
advantages, zero gradients, weights that never change. This one scores the fraction of the
response's characters with an even code point — a number in [0, 1] that differs between the
samples of a group, so GRPO's advantages and gradients are non-zero and the policy moves.
"""

from __future__ import annotations

from typing import Any


def even_characters(req: Any) -> float:
    text = req.response or ""
    return sum(1 for c in text if ord(c) % 2 == 0) / len(text) if text else 0.0
