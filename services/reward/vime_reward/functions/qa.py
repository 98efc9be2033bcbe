"""``exact_match`` and ``f1``: short-answer QA rewards with SQuAD's answer normalisation.

Normalisation lowercases, drops punctuation and the articles a/an/the, and collapses whitespace.
The label may be one answer or a list of acceptable answers (the best match counts). The answer
is the whole response, the last ``\\boxed{}``, or the last ``<answer>…</answer>`` (Search-R1).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from vime_reward.functions.base import Outcome, clip, label_list, last_boxed

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, no punctuation, no articles, single spaces."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCT)).split())


class QaOptions(BaseModel):
    """Where the answer is in the response."""

    model_config = ConfigDict(extra="forbid")

    extract: Literal["none", "boxed", "answer_tag"] = "none"
    r"""none: the whole response; boxed: the last \boxed{}; answer_tag: the last <answer>…</answer>."""


class ExactMatchOptions(QaOptions):
    """Where the answer is, and whether to normalise."""

    normalize: bool = True
    """Compare SQuAD-normalised strings (else stripped strings)."""


def extract(response: str, how: str) -> str | None:
    """The answer part of the response (None when the asked-for wrapper is missing)."""
    if how == "boxed":
        return last_boxed(response)
    if how == "answer_tag":
        # Search the tail from the last opening tag: the last tag wins and no regex scans 1 MB.
        start = response.rfind("<answer>")
        found = _ANSWER_TAG.findall(response[start:]) if start >= 0 else []
        return found[-1] if found else None
    return response


def score_exact_match(response: str, label: Any, opts: ExactMatchOptions) -> Outcome:
    """1.0 when the answer equals one of the labels, else 0.0."""
    answer = extract(response, opts.extract)
    if answer is None:
        return Outcome(0.0, None, {"reason": f"no {opts.extract} answer"})
    norm = normalize_answer if opts.normalize else str.strip
    pred = norm(answer)
    return Outcome(1.0 if any(pred == norm(g) for g in label_list(label)) else 0.0, clip(pred))


def token_f1(prediction: str, gold: str) -> tuple[float, float, float]:
    """(f1, precision, recall) of the normalised tokens; a yes/no/noanswer mismatch scores 0."""
    pred, ref = normalize_answer(prediction), normalize_answer(gold)
    if pred != ref and ({pred, ref} & {"yes", "no", "noanswer"}):
        return 0.0, 0.0, 0.0
    pred_tokens, ref_tokens = pred.split(), ref.split()
    common = sum((Counter(pred_tokens) & Counter(ref_tokens)).values())
    if common == 0:
        return 0.0, 0.0, 0.0
    precision, recall = common / len(pred_tokens), common / len(ref_tokens)
    return 2 * precision * recall / (precision + recall), precision, recall


def score_f1(response: str, label: Any, opts: QaOptions) -> Outcome:
    """The best token F1 between the answer and the labels."""
    answer = extract(response, opts.extract)
    if answer is None:
        return Outcome(0.0, None, {"reason": f"no {opts.extract} answer"})
    f1, precision, recall = max((token_f1(answer, g) for g in label_list(label)), default=(0.0, 0.0, 0.0))
    return Outcome(f1, clip(normalize_answer(answer)), {"precision": precision, "recall": recall})
