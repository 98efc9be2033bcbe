"""``dapo``: the DAPO math reward: the last ``Answer: ...`` line, Minerva-normalised, scores +1 / −1.

Only the tail of the response is read (``clip_chars``, 300 by default: the longest MATH-500 answer
is 159 characters), so a huge response costs nothing. The normalisation is the one published with
Minerva (Lewkowycz et al., 2022, appendix D): keep what follows the last ``=``, drop units and
spacing, unwrap ``\\text{}``/``\\boxed{}``/``$…$``, expand ``\\frac12`` shorthand, drop thousands
separators.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from vime_reward.functions.base import Outcome, label_list, last_boxed

_ANSWER_LINE = re.compile(r"(?i)answer\s*:\s*([^\n]+)")

_REPLACE = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_UNITS_AND_NOISE = (
    *[
        "square",
        "ways",
        "integers",
        "dollars",
        "mph",
        "inches",
        "ft",
        "hours",
        "km",
        "units",
        "sue",
        "points",
        "feet",
        "minutes",
    ],
    *[
        "digits",
        "cents",
        "degrees",
        "cm",
        "gm",
        "pounds",
        "meters",
        "meals",
        "edges",
        "students",
        "childrentickets",
        "multiples",
    ],
    "\\ldots",
    "\\dots",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
)
_UNWRAP = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), r"$\3$"),
    (re.compile(r"(\\text\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), r"\2"),
    (re.compile(r"(frac)([^{])(.)"), r"frac{\2}{\3}"),
    (re.compile(r"(sqrt)([^{])"), r"sqrt{\2}"),
)


def normalize_final_answer(answer: str) -> str:
    """Minerva's answer normalisation (see the module docstring)."""
    out = answer.split("=")[-1]
    for before, after in _REPLACE:
        out = out.replace(before, after)
    for noise in _UNITS_AND_NOISE:
        out = out.replace(noise, "")
    for pattern, repl in _UNWRAP:
        out = pattern.sub(repl, out)
    out = out.replace("$", "").strip()
    if out.replace(",", "").isdigit():
        out = out.replace(",", "")
    return out


class DapoOptions(BaseModel):
    """Where the answer is read from."""

    model_config = ConfigDict(extra="forbid")

    strict_box_verify: bool = False
    r"""Read the answer from the last \boxed{} instead of the last "Answer:" line."""
    clip_chars: int = Field(300, ge=1, le=100_000)
    """Only this many characters at the end of the response are read."""


def _gold(label: str) -> str:
    boxed = last_boxed(label) if "\\boxed" in label else None
    return normalize_final_answer(boxed if boxed is not None else label)


def score_dapo(response: str, label: Any, opts: DapoOptions) -> Outcome:
    """+1.0 when the extracted, normalised answer equals the normalised label, else −1.0."""
    tail = response[-opts.clip_chars :]
    if opts.strict_box_verify:
        raw = last_boxed(tail)
    else:
        found = _ANSWER_LINE.findall(tail)
        raw = found[-1] if found else None
    if raw is None:
        return Outcome(-1.0, None, {"acc": False, "reason": "no answer found"})
    pred = normalize_final_answer(raw)
    correct = any(pred == _gold(g) for g in label_list(label))
    return Outcome(1.0 if correct else -1.0, pred, {"acc": correct})
