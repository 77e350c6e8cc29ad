"""Scratchpad arithmetic (data.arithmetic.scratchpad): every worked response re-checked column by column with
integer arithmetic, splits and determinism as without it, the final-answer reward on correct, wrong and
cut-off responses, SFT on the whole working, the defaults unchanged, config errors, and the lengths of
configs/sparse_rl_scratchpad.yaml.

    .venv/bin/python -m pytest -q tests/unit/test_scratchpad.py
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from megatron_sparse_rl.config.data import ArithmeticConfig, DataConfig, RewardConfig
from megatron_sparse_rl.data import build_task, encode_sft, generate_arithmetic
from megatron_sparse_rl.models import char_tokenizer as char_tok
from megatron_sparse_rl.rewards import extract_answer, make_scorer

ROOT = Path(__file__).resolve().parents[2]
CFG = ArithmeticConfig(ops=("+", "-"), min_digits=1, max_digits=9, train_size=1500, eval_size=300, seed=3,
                       scratchpad=True)
STEP = re.compile(r"(\d)([+-])(\d)\2(\d)=(\d)(\d)")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(char_tok.build_tokenizer(tmp_path_factory.mktemp("tok"))))


def _operands(text: str) -> tuple[int, str, int]:
    a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)=", text).groups()
    return int(a), op, int(b)


def check_working(text: str, solution: str) -> str:
    """Re-derive every column of `solution` for the problem `text` with integer arithmetic; return the answer
    the columns spell (the carry out of the last column leads it, leading zeros dropped)."""
    a, op, b = _operands(text)
    working, final = solution.split(" so ")
    steps = working.split(",")
    assert len(steps) == max(len(str(a)), len(str(b))), solution
    carry, digits = 0, []
    for k, step in enumerate(steps):
        x, sign, y, c, out, z = STEP.fullmatch(step).groups()
        x, y, c, out, z = map(int, (x, y, c, out, z))
        assert sign == op and x == a // 10 ** k % 10 and y == b // 10 ** k % 10 and c == carry, (text, step)
        assert (x + y + c == 10 * out + z) if op == "+" else (x - y - c == z - 10 * out), (text, step)
        digits.append(z)
        carry = out
    spelled = int("".join(map(str, reversed(digits)))) + (carry * 10 ** len(digits) if op == "+" else 0)
    assert op == "+" or carry == 0, (text, solution)  # a >= b: no borrow out of the top column
    assert final == str(spelled), (text, solution)
    return final


def test_every_worked_response_is_right_column_by_column():
    train, held_out = generate_arithmetic(CFG)
    for p in train + held_out:
        a, op, b = _operands(p.text)
        assert check_working(p.text, p.solution) == p.answer == str(a + b if op == "+" else a - b)


def test_hand_worked_examples():
    from megatron_sparse_rl.data.arithmetic import worked_solution

    assert worked_solution(4738, "+", 2895) == "8+5+0=13,3+9+1=13,7+8+1=16,4+2+1=07 so 7633"
    assert worked_solution(1000, "-", 999) == "0-9-0=11,0-9-1=10,0-9-1=10,1-0-1=00 so 1"
    assert worked_solution(5, "+", 0) == "5+0+0=05 so 5"
    assert worked_solution(95, "+", 7) == "5+7+0=12,9+0+1=10 so 102"
    with pytest.raises(ValueError, match="a >= b only"):
        worked_solution(3, "-", 12)


def test_same_problems_as_without_scratchpad_disjoint_and_deterministic():
    train, held_out = generate_arithmetic(CFG)
    plain = generate_arithmetic(dataclasses.replace(CFG, scratchpad=False))
    assert [(p.text, p.answer, p.difficulty) for p in train + held_out] == \
        [(p.text, p.answer, p.difficulty) for p in plain[0] + plain[1]]
    assert all(p.solution == "" for p in plain[0] + plain[1])
    assert generate_arithmetic(CFG) == (train, held_out)
    key = lambda p: (lambda a, op, b: (op, min(a, b), max(a, b)) if op == "+" else (op, a, b))(*_operands(p.text))
    train_keys, eval_keys = {key(p) for p in train}, {key(p) for p in held_out}
    assert len(train_keys) == len(train) and len(eval_keys) == len(held_out) and not train_keys & eval_keys


def test_default_generator_output_is_unchanged():
    """Problems recorded before the scratchpad option existed (seed 0 defaults, and a 3-op seed 3 config)."""
    train, held_out = generate_arithmetic(ArithmeticConfig())
    assert [(p.text, p.answer, p.difficulty) for p in held_out[:3]] == [("75-15=", "60", 2), ("55-48=", "7", 2),
                                                                       ("4+1=", "5", 1)]
    assert [(p.text, p.answer) for p in train[:2]] == [("40+30=", "70"), ("60-44=", "16")]
    train, held_out = generate_arithmetic(ArithmeticConfig(ops=("+", "-", "*"), max_digits=4, seed=3))
    assert [(p.text, p.answer) for p in held_out[:3]] == [("57+2073=", "2130"), ("7*664=", "4648"),
                                                          ("70+7506=", "7576")]
    assert [(p.text, p.answer) for p in train[:2]] == [("7852+447=", "8299"), ("6+2=", "8")]
    assert all(p.solution == "" for p in train + held_out)


# ---- the reward reads the final answer ----------------------------------------------------------------------

RIGHT = "8+5+0=13,3+9+1=13,7+8+1=16,4+2+1=07 so 7633"


@pytest.mark.parametrize("response, marker, expected", [
    (RIGHT + "<eos>", "so", "7633"), (RIGHT + "\n", "so", "7633"), ("1 so 2 so 3", "so", "3"),
    ("so 5\nso 6", "so", "5"), ("8+5+0=13,3+9+1=1", "so", ""), ("", "so", ""), ("so", "so", ""),
    (RIGHT, "", RIGHT),  # no marker: the whole line, as before
])
def test_extract_final_answer(response, marker, expected):
    assert extract_answer(response, marker) == expected


def test_scorer_checks_only_the_final_answer():
    scorer = make_scorer(RewardConfig(), answer_marker="so")
    wrong_steps = RIGHT.replace("7+8+1=16", "7+8+1=99")
    responses = [RIGHT + "<eos>", RIGHT.replace("7633", "7634"), wrong_steps, RIGHT[:30], RIGHT.replace(" so ", " ")]
    assert scorer(responses, ["7633"] * 5) == [1.0, 0.0, 1.0, 0.0, 0.0]
    # without the marker the worked line is the answer text, which never equals the bare answer
    assert make_scorer(RewardConfig())([RIGHT + "<eos>"], ["7633"]) == [0.0]


def test_shaping_sees_the_final_answer_only():
    cfg = RewardConfig(partial_credit=0.5, format_penalty=0.25)
    scorer = make_scorer(cfg, answer_marker="so")
    truncated = "8+5+0=13,3+9+1=13,7+8+1=16,4+2+1=07"  # cut off before "so": empty answer, not digit credit
    got = scorer([RIGHT, RIGHT.replace("7633", "7634"), truncated], ["7633"] * 3)
    assert got == pytest.approx([1.0, 0.5 * 3 / 4, -0.25])
    assert make_scorer(cfg, shaping=False, answer_marker="so")([RIGHT, truncated], ["7633"] * 2) == [1.0, 0.0]


def test_answer_marker_follows_the_data():
    assert DataConfig().answer_marker == ""
    assert DataConfig(arithmetic=CFG).answer_marker == "so"
    assert DataConfig(source="jsonl", path="x.jsonl", arithmetic=CFG).answer_marker == ""


# ---- SFT trains on the working -------------------------------------------------------------------------------

def test_sft_rows_hold_the_whole_working(tok):
    cfg = DataConfig(arithmetic=dataclasses.replace(CFG, train_size=20, eval_size=5))
    task = build_task(cfg, tok)
    example = task.next_sft(1)[0]
    assert example.answer == check_working(example.prompt, example.solution)
    row = encode_sft(tok, example)
    text = f"<bos>{example.prompt}{example.solution}<eos>"
    assert tok.decode(list(row.input_ids), skip_special_tokens=False) == text
    assert row.loss_mask == (0,) * len(example.ids) + (1,) * (len(example.solution) + 1)
    assert task.eval_examples(1)[0].solution  # held-out examples carry it too (unused by the reward)


# ---- config ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(ops=("+", "*")), "data.arithmetic.ops must be within '+', '-' when scratchpad is true (got ('+', '*'))"),
    (dict(ops=("-",), negative_results=True),
     "data.arithmetic.negative_results must be false when scratchpad is true (got True)"),
])
def test_scratchpad_config_errors(kwargs, message):
    with pytest.raises(ValueError) as err:
        ArithmeticConfig(scratchpad=True, **kwargs)
    assert message in str(err.value)


def test_scratchpad_yaml_override_error_names_the_field():
    from megatron_sparse_rl.config import ConfigError, load_config

    with pytest.raises((ConfigError, ValueError), match=r"data.arithmetic.ops must be within '\+', '-'"):
        load_config(ROOT / "configs/sparse_rl_scratchpad.yaml", ['data.arithmetic.ops=["+","*"]'])


def test_scratchpad_config_lengths_fit(tok, monkeypatch):
    """configs/sparse_rl_scratchpad.yaml: prompts fit data.max_prompt_tokens, every worked response (eos included)
    fits sampling.max_tokens and max_model_len, and the KV budget is a quarter to a half of a typical response,
    with the first compaction before a third of it."""
    from megatron_sparse_rl.config import load_config

    monkeypatch.chdir(ROOT)
    run = load_config(ROOT / "configs/sparse_rl_scratchpad.yaml")
    assert run.data.arithmetic.scratchpad and run.data.answer_marker == "so"
    train, held_out = generate_arithmetic(run.data.arithmetic)
    prompts = [len(tok(p.text)["input_ids"]) for p in train + held_out]
    responses = sorted(len(tok(p.solution, add_special_tokens=False)["input_ids"]) + 1 for p in train + held_out)
    assert max(prompts) <= run.data.max_prompt_tokens
    assert 64 <= responses[len(responses) // 2] and responses[-1] <= run.rollout.sampling.max_tokens
    assert max(prompts) + responses[-1] <= run.rollout.max_model_len
    kv, median = run.rollout.kv, responses[len(responses) // 2]
    assert kv.policy != "none" and 0.25 <= kv.budget / median <= 0.5
    first_compaction = kv.budget + kv.interval - min(prompts)  # response tokens before it, at the latest
    assert first_compaction <= median / 3
