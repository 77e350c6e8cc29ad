"""Rewards on hand-written cases: exact answer extraction, numeric fallback, math-verify equivalence
(skipped when math-verify is absent), shaping options and the registry.

    .venv/bin/python -m pytest -q tests/unit/test_rewards.py
"""
from __future__ import annotations

import logging

import pytest

from megatron_sparse_rl.config.data import RewardConfig
from megatron_sparse_rl.rewards import exact_answer, extract_answer, make_scorer, numeric_answer, reward_fn, score
from megatron_sparse_rl.rewards import math_equiv


@pytest.mark.parametrize("response, expected", [
    ("19", "19"), ("19<eos>", "19"), (" 19 \nmore text", "19"), ("19<eos>20", "19"), ("", ""),
    ("\n19", ""), ("-7<eos>", "-7"),
])
def test_extract_answer(response, expected):
    assert extract_answer(response) == expected


@pytest.mark.parametrize("response, answer, expected", [
    ("19", "19", 1.0), ("19<eos>", "19", 1.0), ("19\n", " 19 ", 1.0), ("19 ", "19", 1.0),
    ("190", "19", 0.0), ("1 9", "19", 0.0), ("019", "19", 0.0), ("", "19", 0.0), ("20\n19", "19", 0.0),
])
def test_exact_answer(response, answer, expected):
    assert exact_answer(response, answer) == expected


@pytest.mark.parametrize("response, answer, expected", [
    # decimal numerals by value: the zeros that end a fraction do not count
    ("19", "19.0", 1.0), ("19", "19.00", 1.0), ("19.0", "19", 1.0), ("19.50<eos>", "19.5", 1.0), ("-3", "-3.0", 1.0),
    ("0.5", "0.50", 1.0), ("0", "0.0", 1.0), ("19.01", "19.1", 0.0), ("190", "19.0", 0.0), ("1.9", "19", 0.0),
    # not decimal numerals, so text as before: leading zeros, signs, separators, exponents, fractions, a bare point
    ("019", "19.0", 0.0), ("+19", "19", 0.0), ("1,9", "19", 0.0), ("1e1", "10", 0.0), ("1/2", "0.5", 0.0),
    ("19.", "19", 0.0), (".5", "0.5", 0.0), ("-0", "0", 0.0), ("19.0a", "19", 0.0),
])
def test_exact_answer_compares_decimal_numerals_by_value(response, answer, expected):
    assert exact_answer(response, answer) == expected
    assert numeric_answer(response, answer) >= expected  # the math fallback accepts at least as much


def test_arithmetic_scores_are_unchanged():
    """The built-in task's answers are integers without a point: a response scores as under plain text equality
    (the rule before), except that a point and zeros after the right digits now match too."""
    from megatron_sparse_rl.config.data import ArithmeticConfig
    from megatron_sparse_rl.data.arithmetic import generate

    train, held_out = generate(ArithmeticConfig(ops=("+", "-", "*"), max_digits=3, negative_results=True,
                                                train_size=300, eval_size=50))
    for p in train + held_out:
        a = p.answer
        wrong = str(int(a) + 1)
        for response in (a, f"{a}<eos>", f" {a} ", "0" + a, "+" + a, a + "0", a[:-1], wrong, f"{a},0", f"{a}e0",
                         f"{a}.", f"{a}.5", f"{wrong}.0", "", f"{a}\n{wrong}"):
            assert exact_answer(response, a) == (1.0 if extract_answer(response) == a else 0.0), (response, a)
        for response in (f"{a}.0", f"{a}.000<eos>"):
            assert exact_answer(response, a) == 1.0


@pytest.mark.parametrize("response, answer, expected", [
    ("0.50", "1/2", 1.0), ("1,000", "1000", 1.0), ("-3", "-3.0", 1.0), ("19", "20", 0.0), ("abc", "abc", 1.0),
    ("abc", "1", 0.0), ("1/0", "1", 0.0),
])
def test_numeric_fallback(response, answer, expected):
    assert numeric_answer(response, answer) == expected


def test_score_is_vectorised_and_checks_lengths():
    assert score("exact", ["19<eos>", "20", "", "7\n"], ["19", "19", "0", "7"]) == [1.0, 0.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        score("exact", ["1", "2"], ["1"])
    with pytest.raises(ValueError, match="reward.kind: 'fuzzy' is not allowed; choose one of 'exact', 'math'"):
        reward_fn("fuzzy")


def test_math_with_math_verify():
    pytest.importorskip("math_verify")
    cases = [("0.5", "1/2", 1.0), ("\\frac{1}{2}", "0.5", 1.0), ("The answer is $\\boxed{19}$", "19", 1.0),
             ("19<eos>", "19", 1.0), ("20", "19", 0.0), ("no number here", "19", 0.0)]
    responses, answers, expected = zip(*cases)
    assert score("math", list(responses), list(answers)) == list(expected)


def test_math_fallback_without_math_verify_warns_and_compares_numbers(monkeypatch, caplog):
    monkeypatch.setattr(math_equiv, "has_math_verify", lambda: False)
    with caplog.at_level(logging.WARNING):
        fn = reward_fn("math")
    assert "math-verify is not installed" in caplog.text
    assert [fn(r, a) for r, a in [("0.50", "1/2"), ("19", "19"), ("\\frac{1}{2}", "0.5")]] == [1.0, 1.0, 0.0]


def test_shaping_partial_credit_and_format_penalty():
    cfg = RewardConfig(kind="exact", partial_credit=0.5, format_penalty=0.25)
    scorer = make_scorer(cfg)
    # "129" vs "139": units and hundreds match (2 of 3) -> 0.5 * 2/3; "" -> 0 - 0.25; exact -> 1.0
    assert scorer(["129", "", "139", "39"], ["139", "139", "139", "139"]) == pytest.approx([1 / 3, -0.25, 1.0, 1 / 3])
    assert make_scorer(cfg, shaping=False)(["129", "", "139"], ["139", "139", "139"]) == [0.0, 0.0, 1.0]
    assert make_scorer(RewardConfig())(["129", ""], ["139", "139"]) == [0.0, 0.0]  # shaping off by default


def test_a_pickled_scorer_scores_as_its_settings_say():
    """A disaggregated run's rollout ranks get the trainer's scorer pickled (episodes' rewards run there)."""
    import pickle

    cfg = RewardConfig(kind="exact", partial_credit=0.5, format_penalty=0.25)
    shaped = pickle.loads(pickle.dumps(make_scorer(cfg, answer_marker="so")))
    # "so 129" vs "139": 0.5 * 2/3; no marker -> empty answer -> 0 - 0.25; "so 139" -> 1.0
    assert shaped(["so 129", "139", "so 139"], ["139"] * 3) == pytest.approx([1 / 3, -0.25, 1.0])
    plain = pickle.loads(pickle.dumps(make_scorer(cfg, shaping=False)))
    assert plain(["129", "139"], ["139", "139"]) == [0.0, 1.0]


def test_partial_credit_reads_a_numeric_reference_without_its_ending_zeros():
    scorer = make_scorer(RewardConfig(partial_credit=0.5))
    # "18" vs "19.0" -> "18" vs "19": the tens digit matches, 1 of 2 -> 0.5 * 1/2; "19" is right -> 1.0
    assert scorer(["18", "19", "29.00"], ["19.0", "19.0", "19"]) == pytest.approx([0.25, 1.0, 0.25])


@pytest.mark.parametrize("kwargs, message", [
    (dict(partial_credit=1.0), "reward.partial_credit must be in [0, 1) (got 1.0)"),
    (dict(format_penalty=-0.1), "reward.format_penalty must be >= 0 (got -0.1)"),
])
def test_reward_config_errors(kwargs, message):
    with pytest.raises(ValueError) as err:
        RewardConfig(**kwargs)
    assert message in str(err.value)
