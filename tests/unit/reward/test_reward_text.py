"""gsm8k, dapo, exact_match, f1 and arithmetic on real examples, right, wrong and malformed."""

from __future__ import annotations

import pytest
from vime_reward.functions.arithmetic import check_label, first_integer, score_arithmetic
from vime_reward.functions.base import NoOptions
from vime_reward.functions.dapo import DapoOptions, normalize_final_answer, score_dapo
from vime_reward.functions.gsm8k import Gsm8kOptions, extract_answer, score_gsm8k
from vime_reward.functions.qa import (
    ExactMatchOptions,
    QaOptions,
    normalize_answer,
    score_exact_match,
    score_f1,
    token_f1,
)

# GSM8K train example 0 (Natalia's clips), as a model would write it and as the dataset's answer.
NATALIA = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


def test_gsm8k_strict() -> None:
    g = Gsm8kOptions()
    assert score_gsm8k(NATALIA, "72", g).reward == 1.0
    assert score_gsm8k(NATALIA, NATALIA, g).reward == 1.0  # the label is the full solution
    assert score_gsm8k(NATALIA.replace("#### 72", "#### 71"), "72", g).reward == 0.0
    out = score_gsm8k("She sold 72 clips.", "72", g)  # no '#### ': strict finds nothing
    assert out.reward == 0.0 and out.pred is None


def test_gsm8k_number_forms() -> None:
    g = Gsm8kOptions()
    assert score_gsm8k("#### 1,000", "1000", g).reward == 1.0
    assert score_gsm8k("#### 72.0", "72", g).reward == 1.0
    assert score_gsm8k("#### -3", "-3", g).reward == 1.0
    assert score_gsm8k("#### 3", "-3", g).reward == 0.0
    assert extract_answer("#### 5 then #### 6") == "6"


def test_gsm8k_flexible_and_format_score() -> None:
    flexible = Gsm8kOptions(method="flexible")
    assert score_gsm8k("She sold 72 clips.", "72", flexible).reward == 1.0
    assert score_gsm8k("She sold 72 clips, then 3.", "72", flexible).reward == 0.0
    scored = Gsm8kOptions(score=2.0, format_score=0.1)
    assert score_gsm8k("#### 72", "72", scored).reward == 2.0
    assert score_gsm8k("#### 70", "72", scored).reward == 0.1
    assert score_gsm8k("no number", "72", scored).reward == 0.0


def test_gsm8k_reads_only_the_tail() -> None:
    text = "#### 72\n" + "filler " * 100
    assert score_gsm8k(text, "72", Gsm8kOptions()).reward == 0.0
    assert score_gsm8k(text, "72", Gsm8kOptions(clip_chars=2000)).reward == 1.0


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("34", "34"),
        ("$x = 34$", "34"),
        ("\\frac12", "\\frac{1}{2}"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("1,000", "1000"),
        ("5 dollars", "5"),
        ("\\text{(B)}", "(B)"),
        ("90^\\circ", "90"),
    ],
)
def test_minerva_normalization(raw: str, normal: str) -> None:
    assert normalize_final_answer(raw) == normal


def test_dapo_plus_one_minus_one() -> None:
    opts = DapoOptions()
    solution = "Let me compute. 12 + 22 = 34.\nAnswer: 34"
    right = score_dapo(solution, "34", opts)
    assert right.reward == 1.0 and right.details["acc"] is True and right.pred == "34"
    assert score_dapo(solution, "35", opts).reward == -1.0
    assert score_dapo("Answer: \\frac12", "\\frac{1}{2}", opts).reward == 1.0
    assert score_dapo("answer: 1,000 dollars", "1000", opts).reward == 1.0
    assert score_dapo("Answer: 3\nActually, Answer: 4", "4", opts).reward == 1.0


def test_dapo_malformed_is_minus_one() -> None:
    opts = DapoOptions()
    for text in ["", "the result is 34", "Answer:", "Answer 34"]:
        out = score_dapo(text, "34", opts)
        assert out.reward == -1.0 and out.details["acc"] is False, text


def test_dapo_strict_box_and_clip() -> None:
    strict = DapoOptions(strict_box_verify=True)
    assert score_dapo("so \\boxed{34}", "34", strict).reward == 1.0
    assert score_dapo("Answer: 34", "34", strict).reward == -1.0
    long = "Answer: 34\n" + "x" * 400
    assert score_dapo(long, "34", DapoOptions()).reward == -1.0  # outside the last 300 characters


def test_exact_match() -> None:
    opts = ExactMatchOptions()
    assert score_exact_match("The Eiffel Tower!", "eiffel tower", opts).reward == 1.0
    assert score_exact_match("Eiffel", "eiffel tower", opts).reward == 0.0
    assert score_exact_match("Paris", ["London", "paris"], opts).reward == 1.0
    raw = ExactMatchOptions(normalize=False)
    assert score_exact_match(" Paris ", "Paris", raw).reward == 1.0
    assert score_exact_match("paris", "Paris", raw).reward == 0.0


def test_exact_match_extraction() -> None:
    tagged = ExactMatchOptions(extract="answer_tag")
    text = "<think>hmm</think><answer>wrong</answer> retry <answer> Denver Broncos </answer>"
    assert score_exact_match(text, "Denver Broncos", tagged).reward == 1.0
    out = score_exact_match("Denver Broncos", "Denver Broncos", tagged)
    assert out.reward == 0.0 and out.pred is None
    boxed = ExactMatchOptions(extract="boxed")
    assert score_exact_match("so \\boxed{Paris}", "paris", boxed).reward == 1.0


def test_f1_squad_examples() -> None:
    # SQuAD dev: "Which NFL team represented the AFC at Super Bowl 50?" gold "Denver Broncos".
    f1, precision, recall = token_f1("the Broncos", "Denver Broncos")
    assert (precision, recall) == (1.0, 0.5)
    assert f1 == pytest.approx(2 / 3)
    assert token_f1("Denver Broncos", "Denver Broncos")[0] == 1.0
    assert token_f1("Carolina Panthers", "Denver Broncos")[0] == 0.0
    assert token_f1("yes", "no")[0] == 0.0
    out = score_f1("the Broncos", ["Denver Broncos", "Broncos"], QaOptions())
    assert out.reward == 1.0 and out.pred == "broncos"
    assert score_f1("", "Denver Broncos", QaOptions()).reward == 0.0


def test_normalize_answer() -> None:
    assert normalize_answer("  The  Quick, brown FOX. ") == "quick brown fox"


@pytest.mark.parametrize(
    ("response", "label", "reward"),
    [
        ("46", 46, 1.0),
        ("46", "46", 1.0),
        (" 46 because 12+34", 46, 1.0),
        ("-5", -5, 1.0),
        ("45", 46, 0.0),
        ("4 6", 46, 0.0),  # the first integer is 4
        ("forty-six", 46, 0.0),
        ("", 46, 0.0),
        ("46.0", 46, 1.0),  # the first integer of "46.0" is 46
    ],
)
def test_arithmetic(response: str, label: object, reward: float) -> None:
    assert score_arithmetic(response, label, NoOptions()).reward == reward


def test_arithmetic_labels() -> None:
    assert first_integer("x" * 300 + "46") is None  # only the head is read
    assert check_label(46) is None and check_label("46") is None and check_label(46.0) is None
    for bad in ["abc", True, None, 4.5, [46]]:
        assert check_label(bad) is not None, bad
    with pytest.raises(ValueError):
        score_arithmetic("46", "abc", NoOptions())
