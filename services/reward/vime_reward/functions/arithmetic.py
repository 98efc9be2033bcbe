"""``arithmetic``: the built-in synthetic task of the CPU demo ("12+34=" → label 46).

The reward is 1.0 when the first integer in the response equals the label, else 0.0. Only the
head of the response is searched, so a runaway generation costs nothing.
"""

from __future__ import annotations

import re
from typing import Any

from vime_reward.functions.base import NoOptions, Outcome

_INTEGER = re.compile(r"-?\d+")
HEAD_CHARS = 256
"""Characters at the start of the response searched for the first integer."""


def first_integer(text: str) -> int | None:
    """The first (optionally negative) integer in the head of ``text``."""
    match = _INTEGER.search(text[:HEAD_CHARS])
    return int(match.group()) if match else None


def label_int(label: Any) -> int | None:
    """The label as an int (an int, an integral float, or a string of digits), else None."""
    if isinstance(label, bool):
        return None
    if isinstance(label, int):
        return label
    if isinstance(label, float) and label.is_integer():
        return int(label)
    if isinstance(label, str) and re.fullmatch(r"\s*-?\d+\s*", label):
        return int(label)
    return None


def score_arithmetic(response: str, label: Any, _: NoOptions) -> Outcome:
    """1.0 when the response's first integer equals the integer label."""
    gold = label_int(label)
    if gold is None:
        raise ValueError(f"arithmetic needs an integer label, got {label!r:.80}")
    pred = first_integer(response)
    return Outcome(1.0 if pred == gold else 0.0, None if pred is None else str(pred))


def check_label(label: Any) -> str | None:
    """Why the label cannot be scored (checked by the service before dispatch), or None."""
    return None if label_int(label) is not None else 'arithmetic needs an integer label (e.g. 46 or "46")'
