"""The built-in reward functions, by name (user functions are named by import path instead)."""

from __future__ import annotations

from vime_reward.functions import arithmetic, dapo, gsm8k, math_answers, qa
from vime_reward.functions.base import NoOptions, Outcome, RewardFunction, as_outcome
from vime_reward.functions.remote import RemoteOptions

_MATH_LABEL = "the answer in LaTeX or plain text ('\\frac{1}{2}', '0.5', '\\boxed{2}'), or a list of them"

BUILTINS: dict[str, RewardFunction] = {
    f.name: f
    for f in (
        RewardFunction(
            "math",
            math_answers.score_math,
            "1/0: the last \\boxed{} answer is mathematically equivalent to the label (math-verify)",
            _MATH_LABEL,
            math_answers.MathOptions,
        ),
        RewardFunction(
            "deepscaler",
            math_answers.score_deepscaler,
            "1/0: DeepScaleR: the \\boxed{} answer after </think> is equivalent to the label (math-verify)",
            _MATH_LABEL,
            math_answers.DeepScalerOptions,
        ),
        RewardFunction(
            "dapo",
            dapo.score_dapo,
            "+1/−1: DAPO: the last 'Answer: …' line equals the label after Minerva normalisation",
            "the final answer as text ('34', '\\frac{1}{2}'), or a list of them",
            dapo.DapoOptions,
        ),
        RewardFunction(
            "gsm8k",
            gsm8k.score_gsm8k,
            "score/format_score/0: the number after '#### ' (or the last number) equals the label",
            "the number ('72'), GSM8K's full solution ending in '#### 72', or a list of them",
            gsm8k.Gsm8kOptions,
        ),
        RewardFunction(
            "exact_match",
            qa.score_exact_match,
            "1/0: the answer equals one of the labels after SQuAD normalisation",
            "the answer string, or a list of acceptable answers",
            qa.ExactMatchOptions,
        ),
        RewardFunction(
            "f1",
            qa.score_f1,
            "0..1: the best SQuAD token F1 between the answer and the labels",
            "the answer string, or a list of acceptable answers",
            qa.QaOptions,
        ),
        RewardFunction(
            "arithmetic",
            arithmetic.score_arithmetic,
            "1/0: the first integer of the response equals the label (the built-in synthetic task)",
            "the integer answer (46 or '46')",
            NoOptions,
            check_label=arithmetic.check_label,
        ),
        RewardFunction(
            "remote",
            None,
            "whatever another reward server answers for the sample (a reward model served elsewhere)",
            "anything the remote server understands (may be null)",
            RemoteOptions,
            needs_label=False,
            needs_text=False,
        ),
    )
}

__all__ = ["BUILTINS", "NoOptions", "Outcome", "RewardFunction", "as_outcome"]
