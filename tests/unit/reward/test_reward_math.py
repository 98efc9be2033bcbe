"""math and deepscaler on real answers: boxed extraction, math-verify equivalence, malformed input."""

from __future__ import annotations

import pytest
from vime_reward.functions.base import last_boxed
from vime_reward.functions.math_answers import (
    DeepScalerOptions,
    MathOptions,
    score_deepscaler,
    score_math,
)

OPTS = MathOptions()

# (response, label, expected reward) — responses in the style of MATH / AIME solutions.
RIGHT = [
    ("The probability is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("Simplifying, we get $\\boxed{\\dfrac{3}{4}}$", "\\frac34"),
    ("So $x = \\boxed{0.5}$", "\\frac{1}{2}"),
    ("The side length is $\\boxed{2\\sqrt{2}}$.", "\\sqrt{8}"),
    ("Expanding gives \\boxed{x^2+2x+1}", "(x+1)^2"),
    ("The roots are \\boxed{\\{1,2\\}}", "\\{2,1\\}"),
    ("Thus the answer is \\boxed{(1,2)}.", "(1, 2)"),
    ("There are $\\boxed{204}$ ways.", "204"),
    ("First \\boxed{3}, but on reflection \\boxed{5}", "5"),
    ("\\boxed{10\\%}", "10"),
]
WRONG = [
    ("The probability is $\\boxed{\\frac{1}{3}}$.", "\\frac{1}{2}"),
    ("There are $\\boxed{205}$ ways.", "204"),
    ("\\boxed{3.14}", "\\pi"),
    ("First \\boxed{5}, but on reflection \\boxed{3}", "5"),
    ("\\boxed{x^2+1}", "(x+1)^2"),
]


@pytest.mark.parametrize(("response", "label"), RIGHT)
def test_math_right_answers_score_one(response: str, label: str) -> None:
    out = score_math(response, label, OPTS)
    assert out.reward == 1.0, out
    assert out.pred == last_boxed(response)


@pytest.mark.parametrize(("response", "label"), WRONG)
def test_math_wrong_answers_score_zero(response: str, label: str) -> None:
    assert score_math(response, label, OPTS).reward == 0.0


@pytest.mark.parametrize(
    "response",
    [
        "The answer is 1/2",  # no box at all
        "\\boxed{\\frac{1}{2}",  # truncated: the box never closes
        "\\boxed{}",
        "\\boxed{\\frac{",
        "}}}}\\boxed",
        "",
    ],
)
def test_math_malformed_answers_score_zero_without_raising(response: str) -> None:
    out = score_math(response, "\\frac{1}{2}", OPTS)
    assert out.reward == 0.0


def test_math_without_box_says_why() -> None:
    out = score_math("I think it is 7", "7", OPTS)
    assert out.pred is None and "boxed" in out.details["reason"]


def test_math_label_forms() -> None:
    # A label that is itself boxed, a number, or a list of acceptable answers.
    assert score_math("\\boxed{12}", "\\boxed{12}", OPTS).reward == 1.0
    assert score_math("\\boxed{12}", 12, OPTS).reward == 1.0
    assert score_math("\\boxed{12}", ["11", "12"], OPTS).reward == 1.0
    assert score_math("\\boxed{13}", ["11", "12"], OPTS).reward == 0.0


def test_math_options_change_the_comparison() -> None:
    # 1/3 vs 0.333: equal when rounded to 3 places, not at the default 6.
    assert score_math("\\boxed{0.333}", "\\frac{1}{3}", OPTS).reward == 0.0
    assert score_math("\\boxed{0.333}", "\\frac{1}{3}", MathOptions(float_rounding=3)).reward == 1.0


def test_math_huge_answer_is_cut_in_pred() -> None:
    out = score_math("\\boxed{" + "9" * 5000 + "}", "1", OPTS)
    assert out.reward == 0.0
    assert out.pred is not None and len(out.pred) <= 2001


def test_deepscaler_reads_the_answer_after_think() -> None:
    text = "<think>maybe \\boxed{3}? no.</think> The answer is \\boxed{4}."
    assert score_deepscaler(text, "4", DeepScalerOptions()).reward == 1.0
    assert score_deepscaler(text, "3", DeepScalerOptions()).reward == 0.0


def test_deepscaler_needs_think_unless_told_otherwise() -> None:
    out = score_deepscaler("The answer is \\boxed{4}.", "4", DeepScalerOptions())
    assert out.reward == 0.0 and "think" in out.details["reason"]
    relaxed = DeepScalerOptions(require_think=False)
    assert score_deepscaler("The answer is \\boxed{4}.", "4", relaxed).reward == 1.0
    # A box only inside the reasoning does not count.
    assert score_deepscaler("<think>\\boxed{4}</think> done", "4", DeepScalerOptions()).reward == 0.0


@pytest.mark.parametrize(
    ("text", "content"),
    [
        ("\\boxed{\\frac{a}{b}}", "\\frac{a}{b}"),
        ("x \\boxed{1} y \\boxed{{2}}", "{2}"),
        ("\\fbox{7}", "7"),
        ("so \\boxed 5$ done", "5"),
        ("\\boxed{unclosed", None),
        ("no box", None),
    ],
)
def test_last_boxed(text: str, content: str | None) -> None:
    assert last_boxed(text) == content


def test_last_boxed_on_a_megabyte() -> None:
    text = "x" * 1_000_000 + "\\boxed{42}" + "y" * 1000
    assert last_boxed(text) == "42"
    assert last_boxed("\\boxed{" + "{" * 500_000) is None
