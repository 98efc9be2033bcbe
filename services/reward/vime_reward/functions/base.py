"""What every reward function shares: its outcome, its description, and answer-extraction helpers."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

PRED_MAX_CHARS = 2000
"""Extracted answers are cut to this length in replies (a 1 MB answer stays in the worker)."""


class NoOptions(BaseModel):
    """A function without options: any option given is an error."""

    model_config = ConfigDict(extra="forbid")


@dataclass
class Outcome:
    """A function's verdict: the reward, the answer it extracted, and extras."""

    reward: float
    pred: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


ScoreFn = Callable[[str, Any, Any], Outcome]
"""A built-in function: ``score(response_text, label, options_model) -> Outcome``."""


@dataclass(frozen=True)
class RewardFunction:
    """A built-in reward function and what it expects."""

    name: str
    score: ScoreFn | None
    """The scoring code; None for functions the service runs itself (remote)."""
    description: str
    label: str
    options: type[BaseModel] = NoOptions
    needs_label: bool = True
    needs_text: bool = True
    check_label: Callable[[Any], str | None] | None = None
    """Says why a label cannot be scored (a 422 before any work), or None when it can."""


def as_outcome(value: Any) -> Outcome:
    """A user function's return value as an `Outcome`: a number, a bool, a dict or an Outcome."""
    if isinstance(value, Outcome):
        return value
    if isinstance(value, dict):
        key = "reward" if "reward" in value else "score" if "score" in value else None
        if key is None:
            raise TypeError(f"returned a dict without 'reward' or 'score' (keys: {sorted(value)[:10]})")
        pred = value.get("pred")
        details = {k: v for k, v in value.items() if k not in (key, "pred")}
        return Outcome(_number(value[key]), None if pred is None else str(pred), details)
    return Outcome(_number(value))


def _number(value: Any) -> float:
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if not isinstance(value, int | float):
        raise TypeError(f"returned {type(value).__name__}, expected a number, a bool or a dict")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"returned a non-finite reward ({out})")
    return out


_BOXED = re.compile(r"\\(?:boxed|fbox)")


def last_boxed(text: str) -> str | None:
    r"""The content of the last ``\boxed{...}`` (or ``\fbox{...}``, ``\boxed x``) in ``text``, or None.

    One backwards search and one forward brace scan: linear in the text, so a 1 MB response costs
    milliseconds, not a regex blow-up.
    """
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    match = _BOXED.match(text, start)
    if match is None:
        return None
    i = match.end()
    if text.startswith(" ", i):
        # "\boxed 5": the answer runs to the next "$" or whitespace.
        rest = text[i + 1 :]
        end = re.search(r"[\s$]", rest)
        return rest[: end.start()] if end else rest
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, len(text)):
        ch = text[j]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def clip(text: str | None) -> str | None:
    """``text`` cut to `PRED_MAX_CHARS` for replies."""
    if text is None or len(text) <= PRED_MAX_CHARS:
        return text
    return text[:PRED_MAX_CHARS] + "…"


def utf8_safe(value: Any) -> Any:
    """``value`` with lone surrogates (valid in a JSON string, not in UTF-8) replaced, so replies encode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value.encode("utf-8", "replace").decode("utf-8")
        return value
    if isinstance(value, dict):
        return {utf8_safe(k): utf8_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [utf8_safe(v) for v in value]
    return value


def label_list(label: Any) -> list[str]:
    """A label (a string, a number, or a list of acceptable answers) as a list of strings."""
    items = label if isinstance(label, list | tuple) else [label]
    return [str(x) for x in items if x is not None]
