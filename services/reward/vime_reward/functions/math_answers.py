r"""``math`` and ``deepscaler``: the last ``\boxed{}`` answer, checked for equivalence by math-verify.

math-verify is called with its own signal-based timeouts off: the worker pool enforces the
per-task timeout from outside (a soft alarm in the worker, a kill from the service), which also
catches the hangs inside C code that a signal cannot interrupt (``9^{9^{9^{9}}}``).
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from vime_reward.functions.base import Outcome, clip, label_list, last_boxed

logging.getLogger("math_verify").setLevel(logging.ERROR)


class MathOptions(BaseModel):
    """math-verify's comparison settings."""

    model_config = ConfigDict(extra="forbid")

    float_rounding: int = Field(6, ge=0, le=20)
    """Decimal places floats are rounded to before comparing."""
    numeric_precision: int = Field(15, ge=1, le=100)
    """Significant digits of numeric evaluation."""
    strict: bool = True
    """Variables must match by name and sets do not equal tuples (math-verify's strict mode)."""


class DeepScalerOptions(MathOptions):
    """math's settings, plus where the answer must be."""

    require_think: bool = True
    """Score 0 unless the response closes its reasoning with </think>; the answer is read after it."""


def _parse_gold(label: str) -> list[Any]:
    from math_verify import parse

    text = label.strip()
    if "\\boxed" in text or "$" in text:
        return list(parse(text, parsing_timeout=None))
    return list(parse(f"${text}$", parsing_timeout=None))


def equivalent(answer: str, label: Any, opts: MathOptions) -> bool:
    """Whether ``answer`` (a boxed answer's content) equals any of the label's answers."""
    from math_verify import parse, verify

    pred = parse(f"$\\boxed{{{answer}}}$", parsing_timeout=None)
    if not pred:
        return False
    for gold_text in label_list(label):
        gold = _parse_gold(gold_text)
        if gold and verify(
            gold,
            pred,
            float_rounding=opts.float_rounding,
            numeric_precision=opts.numeric_precision,
            strict=opts.strict,
            timeout_seconds=None,
        ):
            return True
    return False


def score_math(response: str, label: Any, opts: MathOptions) -> Outcome:
    r"""1.0 when the last ``\boxed{}`` of the response is equivalent to the label, else 0.0."""
    answer = last_boxed(response)
    if answer is None:
        return Outcome(0.0, None, {"reason": "no \\boxed{} answer"})
    return Outcome(1.0 if equivalent(answer, label, opts) else 0.0, clip(answer))


def score_deepscaler(response: str, label: Any, opts: DeepScalerOptions) -> Outcome:
    r"""DeepScaleR: the boxed answer after ``</think>`` must match (1/0); no ``</think>`` scores 0."""
    _, sep, tail = response.rpartition("</think>")  # without "</think>", tail is the whole response
    if not sep and opts.require_think:
        return Outcome(0.0, None, {"reason": "no </think> in the response"})
    return score_math(tail, label, opts)
