"""``gsm8k``: the number after ``#### `` (strict) or the last number (flexible) equals the label.

Only the tail of the response is searched (``clip_chars``) so a long response costs nothing. The
label may be the bare number or GSM8K's full solution text ending in ``#### 72``. Numbers compare
as decimals, so ``72``, ``72.0`` and ``72.`` are the same answer; ``1,000`` and ``$1000`` too.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from vime_reward.functions.base import Outcome, label_list

_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_ANY_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")


class Gsm8kOptions(BaseModel):
    """How the answer is found and what it scores."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["strict", "flexible"] = "strict"
    """strict: the number after '#### '; flexible: the last number anywhere in the tail."""
    score: float = 1.0
    """Reward of a correct answer."""
    format_score: float = 0.0
    """Reward of a well-formed but wrong answer."""
    clip_chars: int = Field(300, ge=1, le=100_000)
    """Only this many characters at the end of the response are searched."""


def extract_answer(text: str, method: Literal["strict", "flexible"] = "strict") -> str | None:
    """The answer string of a GSM8K-style response, commas and dollar signs removed."""
    if method == "strict":
        found = _STRICT.findall(text)
    else:
        found = [x for x in _ANY_NUMBER.findall(text) if x.strip(".,")]
    if not found:
        return None
    return found[-1].replace(",", "").replace("$", "")


def _canonical(answer: str) -> Decimal | str:
    """A decimal when the answer is a number (compared exactly, no rounding), else the text."""
    text = answer.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        number = Decimal(text)
    except InvalidOperation:
        return text
    return number if number.is_finite() else text


def _gold(label: str) -> str:
    if "####" in label:
        return extract_answer(label, "strict") or label.split("####")[-1]
    return label


def score_gsm8k(response: str, label: Any, opts: Gsm8kOptions) -> Outcome:
    """``score`` for the right number, ``format_score`` for a wrong one, 0.0 when none is found."""
    pred = extract_answer(response[-opts.clip_chars :], opts.method)
    if pred is None:
        return Outcome(0.0, None, {"reason": "no answer found"})
    correct = any(_canonical(pred) == _canonical(_gold(g)) for g in label_list(label))
    return Outcome(opts.score if correct else opts.format_score, pred, {"acc": correct})
