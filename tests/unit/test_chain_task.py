"""The digit-chain task (data.source: chain): every worked response re-derived with numpy (the whole working as
a window over one lagged-Fibonacci digit sequence, independent of the generator's state-by-state loop), splits disjoint and deterministic, the
final-answer reward, SFT on the whole working, config errors, and the lengths of configs/sparse_rl_chain.yaml.

    .venv/bin/python -m pytest -q tests/unit/test_chain_task.py
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from megatron_sparse_rl.config.data import ChainConfig, DataConfig, RewardConfig
from megatron_sparse_rl.data import build_task, check_data, encode_sft
from megatron_sparse_rl.models import char_tokenizer as char_tok
from megatron_sparse_rl.data.chain import generate, worked_chain
from megatron_sparse_rl.rewards import make_scorer

ROOT = Path(__file__).resolve().parents[2]
CFG = ChainConfig(width=4, steps=7, train_size=1500, eval_size=300, seed=3)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(char_tok.build_tokenizer(tmp_path_factory.mktemp("tok"))))


def reference_chain(start: str, steps: int) -> list[str]:
    """The states after 1..steps steps: windows of `width` digits sliding one digit a step over the lagged-Fibonacci
    sequence d[t] = (d[t-1] + d[t-width]) mod 10 seeded with the start digits."""
    width = len(start)
    d = np.zeros(width + steps, dtype=np.int64)
    d[:width] = [int(c) for c in start]
    for t in range(width, len(d)):
        d[t] = (d[t - 1] + d[t - width]) % 10
    return ["".join(map(str, d[k:k + width])) for k in range(1, steps + 1)]


def test_every_worked_response_matches_the_matrix_reference():
    train, held_out = generate(CFG)
    for p in train + held_out:
        start = p.text.removesuffix("=")
        assert len(start) == CFG.width and start.isdigit()
        states = reference_chain(start, CFG.steps)
        labelled = ",".join(f"{k}:{state}" for k, state in enumerate(states, 1))
        assert p.solution == f"{labelled} so {states[-1]}" and p.answer == states[-1]
        assert len(p.solution) + 1 == CFG.steps * (CFG.width + 3) + CFG.width + 4  # the field's doc


def test_hand_worked_example():
    # 4+1=5 -> 7381 then 5; 7+5=12 -> 3815 then 2
    assert worked_chain("47381", 1) == "1:73815 so 73815"
    assert worked_chain("47381", 2) == "1:73815,2:38152 so 38152"
    assert worked_chain("00000", 3) == "1:00000,2:00000,3:00000 so 00000"  # leading zeros kept


def test_splits_disjoint_deterministic_and_seeded():
    train, held_out = generate(CFG)
    assert len(train) == CFG.train_size and len(held_out) == CFG.eval_size
    starts = [p.text for p in train + held_out]
    assert len(set(starts)) == len(starts)
    assert generate(CFG) == (train, held_out)
    other = generate(ChainConfig(width=4, steps=7, train_size=1500, eval_size=300, seed=4))
    assert [p.text for p in other[1]] != [p.text for p in held_out]


def test_scorer_checks_the_last_state():
    right = worked_chain("47381", 3)
    scorer = make_scorer(RewardConfig(), answer_marker=DataConfig(source="chain").answer_marker)
    assert scorer([right + "<eos>", right[:-1] + "0", right.split(" so ")[0]], [right[-5:]] * 3) == [1.0, 0.0, 0.0]


def test_sft_rows_hold_the_whole_working_and_check_data_counts(tok):
    cfg = DataConfig(source="chain", chain=ChainConfig(width=5, steps=3, train_size=20, eval_size=5))
    task = build_task(cfg, tok)
    example = task.next_sft(1)[0]
    assert [s.split(":")[1] for s in example.solution.split(" so ")[0].split(",")] == \
        reference_chain(example.prompt[:-1], 3)
    row = encode_sft(tok, example)
    assert tok.decode(list(row.input_ids), skip_special_tokens=False) == \
        f"<bos>{example.prompt}{example.solution}<eos>"
    assert row.loss_mask == (0,) * len(example.ids) + (1,) * (len(example.solution) + 1)
    assert [s.line() for s in check_data(cfg)] == ["train: data.chain, 20 records", "eval: data.chain, 5 records"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(width=2), "data.chain.width must be in [3, 8] (got 2)"),
    (dict(steps=0), "data.chain.steps must be in [1, 9] (got 0)"),
    (dict(steps=10), "data.chain.steps must be in [1, 9] (got 10)"),
    (dict(width=3, train_size=400, eval_size=200), "data.chain.train_size must be plus eval_size must be at most"),
])
def test_config_errors(kwargs, message):
    with pytest.raises(ValueError) as err:
        ChainConfig(**kwargs)
    assert message.split(" must be plus")[0] in str(err.value)


def test_chain_config_lengths_fit(tok, monkeypatch):
    """configs/sparse_rl_chain.yaml: prompts fit data.max_prompt_tokens, every worked response (eos included)
    fits sampling.max_tokens and max_model_len, the KV budget is a quarter to a half of a response, and most
    response tokens come after the first compaction."""
    from megatron_sparse_rl.config import load_config

    monkeypatch.chdir(ROOT)
    run = load_config(ROOT / "configs/sparse_rl_chain.yaml")
    assert run.data.source == "chain" and run.data.answer_marker == "so"
    train, held_out = generate(run.data.chain)
    prompts = {len(tok(p.text)["input_ids"]) for p in train[:500] + held_out}
    responses = {len(tok(p.solution, add_special_tokens=False)["input_ids"]) + 1 for p in train[:500] + held_out}
    assert len(responses) == 1 and len(prompts) == 1  # fixed width: every problem the same length
    prompt, response = prompts.pop(), responses.pop()
    assert prompt <= run.data.max_prompt_tokens and 64 <= response <= run.rollout.sampling.max_tokens
    assert prompt + response <= run.rollout.max_model_len
    kv = run.rollout.kv
    assert kv.policy != "none" and 0.25 <= kv.budget / response <= 0.5
    assert kv.budget + kv.interval - prompt <= response / 2  # most tokens come after the first compaction


def test_every_built_in_source_has_a_generator_reading_its_section():
    from megatron_sparse_rl.config.data import BUILT_IN_SOURCES
    from megatron_sparse_rl.data.datasets import _GENERATORS

    assert set(_GENERATORS) == set(BUILT_IN_SOURCES)
    assert all(hasattr(DataConfig(), source) for source in BUILT_IN_SOURCES)
