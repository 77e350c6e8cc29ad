"""Data: the arithmetic generator against Python's own arithmetic, split disjointness, determinism;
JSONL/parquet errors naming the line; templates; the resumable prompt stream; DataConfig errors.

    .venv/bin/python -m pytest -q tests/unit/test_data.py
"""
from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_sparse_rl.config.data import ArithmeticConfig, DataConfig, RewardConfig
from megatron_sparse_rl.data import (DatasetError, PromptStream, SIMPLE_CHAT_FORMAT, build_task, encode_prompts,
                                     encode_sft, generate_arithmetic, load_prompts, read_jsonl, read_parquet)
from megatron_sparse_rl.models import char_tokenizer as char_tok
from megatron_sparse_rl.data.arithmetic import problem_space_size


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(char_tok.build_tokenizer(tmp_path_factory.mktemp("tok"))))


# ---- arithmetic ---------------------------------------------------------------------------------------------

CFG = ArithmeticConfig(ops=("+", "-", "*"), min_digits=1, max_digits=3, train_size=500, eval_size=100, seed=7)


def test_answers_match_python_arithmetic():
    train, held_out = generate_arithmetic(CFG)
    for p in train + held_out:
        assert p.text.endswith("=")
        assert int(p.answer) == eval(p.text[:-1])  # the independent reference: Python evaluates the text
        assert set(p.text + p.answer) <= set(char_tok.CHARACTERS)
        assert p.difficulty == max(len(s) for s in p.text[:-1].replace("+", " ").replace("*", " ").replace("-", " ").split())
    assert all(int(p.answer) >= 0 for p in train if "-" in p.text)  # negative_results=False


def test_splits_sizes_disjoint_and_no_commuted_twins():
    train, held_out = generate_arithmetic(CFG)
    assert len(train) == 500 and len(held_out) == 100

    def canon(text):
        for op in "+*":
            if op in text:
                a, b = text[:-1].split(op)
                return (op, *sorted((int(a), int(b))))
        return text

    train_keys, eval_keys = {canon(p.text) for p in train}, {canon(p.text) for p in held_out}
    assert len(train_keys) == 500 and len(eval_keys) == 100
    assert not train_keys & eval_keys


def test_generator_is_deterministic_and_seed_dependent():
    assert generate_arithmetic(CFG) == generate_arithmetic(CFG)
    other = generate_arithmetic(dataclasses.replace(CFG, seed=8))
    assert other[1] != generate_arithmetic(CFG)[1]
    # the eval split depends on the seed and settings only, not on train_size
    bigger = generate_arithmetic(dataclasses.replace(CFG, train_size=800))
    assert bigger[1] == generate_arithmetic(CFG)[1]


def test_difficulty_levels_follow_digits_and_ops():
    train, _ = generate_arithmetic(ArithmeticConfig(ops=("*",), min_digits=3, max_digits=3, train_size=50, eval_size=5))
    assert all(p.difficulty == 3 and "*" in p.text for p in train)
    for p in train:
        a, b = map(int, p.text[:-1].split("*"))
        assert 100 <= a <= 999 and 100 <= b <= 999


def test_negative_results_allowed():
    train, _ = generate_arithmetic(ArithmeticConfig(ops=("-",), negative_results=True, train_size=300, eval_size=0))
    assert any(p.answer.startswith("-") for p in train)
    assert all(int(p.answer) == eval(p.text[:-1]) for p in train)


def test_problem_space_too_small_is_an_error():
    # 1-digit "+": 10 * 11 / 2 = 55 unordered pairs
    assert problem_space_size(ArithmeticConfig(ops=("+",), max_digits=1, train_size=1, eval_size=0)) == 55
    with pytest.raises(ValueError, match=r"data.arithmetic.train_size \+ eval_size = 40 is more than half of the 55"):
        generate_arithmetic(ArithmeticConfig(ops=("+",), max_digits=1, train_size=30, eval_size=10))


@pytest.mark.parametrize("kwargs, message", [
    (dict(ops=()), "data.arithmetic.ops must be a non-empty tuple of distinct '+', '-', '*' (got ())"),
    (dict(ops=("/",)), "data.arithmetic.ops must be a non-empty tuple"),
    (dict(min_digits=0), "data.arithmetic.min_digits must be in [1, 9] (got 0)"),
    (dict(min_digits=3, max_digits=2), "data.arithmetic.max_digits must be in [min_digits=3, 9] (got 2)"),
    (dict(train_size=0), "data.arithmetic.train_size must be >= 1 (got 0)"),
])
def test_arithmetic_config_errors(kwargs, message):
    with pytest.raises(ValueError) as err:
        ArithmeticConfig(**kwargs)
    assert message in str(err.value)


@pytest.mark.parametrize("kwargs, message", [
    (dict(source="jsonl"), "data.path must be set when data.source is 'jsonl' (got '')"),
    (dict(max_prompt_tokens=0), "data.max_prompt_tokens must be >= 1 (got 0)"),
    (dict(answer_key="prompt"), "data.answer_key must differ from data.prompt_key='prompt'"),
])
def test_data_config_errors(kwargs, message):
    with pytest.raises(ValueError) as err:
        DataConfig(**kwargs)
    assert message in str(err.value)


def test_configs_load_from_yaml_overrides():
    from megatron_sparse_rl.config.loader import ConfigError, from_dict

    cfg = from_dict(DataConfig, {"arithmetic": {"ops": ["+", "*"], "max_digits": 3}, "template": "chat"}, "data")
    assert cfg.arithmetic.ops == ("+", "*") and cfg.arithmetic.max_digits == 3 and cfg.template == "chat"
    with pytest.raises(ConfigError, match=r"data.arithmetic.ops\[1\]: '/' is not allowed"):
        from_dict(DataConfig, {"arithmetic": {"ops": ["+", "/"]}}, "data")
    with pytest.raises(ConfigError, match="reward.kind: 'mathh' is not allowed.*did you mean 'math'"):
        from_dict(RewardConfig, {"kind": "mathh"}, "reward")


# ---- JSONL / parquet -----------------------------------------------------------------------------------------

def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_jsonl_reads_records_and_numbers(tmp_path):
    f = write(tmp_path / "d.jsonl", ['{"prompt": "1+1=", "answer": "2"}', "", '{"prompt": "x", "answer": 0.5}'])
    prompts = read_jsonl(f)
    assert [(p.text, p.answer) for p in prompts] == [("1+1=", "2"), ("x", "0.5")]
    assert prompts[1].source == f"{f}:3"
    g = write(tmp_path / "e.jsonl", ['{"q": "3*3=", "a": 9, "extra": 1}'])
    assert [(p.text, p.answer) for p in read_jsonl(g, "q", "a")] == [("3*3=", "9")]


def test_numeric_answers_become_the_numeral_a_response_writes(tmp_path):
    from megatron_sparse_rl.config.data import RewardConfig
    from megatron_sparse_rl.rewards import make_scorer

    # JSON number -> the decimal text a model writes (hand-written): no ".0", no exponent, no "-0"
    cases = [("19.0", "19"), ("19", "19"), ("-7.0", "-7"), ("2.50", "2.5"), ("1e-07", "0.0000001"),
             ("1E20", "100000000000000000000"), ("-0.0", "0"), ("0.1", "0.1"), ("123456789.125", "123456789.125")]
    f = write(tmp_path / "n.jsonl", [f'{{"prompt": "q{i}", "answer": {num}}}' for i, (num, _) in enumerate(cases)])
    assert [p.answer for p in read_jsonl(f)] == [text for _, text in cases]
    responses = [text for _, text in cases]
    assert make_scorer(RewardConfig())(responses, [p.answer for p in read_jsonl(f)]) == [1.0] * len(cases)
    # the same numbers given as strings in the data compare by value in the reward
    g = write(tmp_path / "s.jsonl", ['{"prompt": "q", "answer": "19.0"}', '{"prompt": "r", "answer": "19.00"}'])
    assert make_scorer(RewardConfig())(["19", "19"], [p.answer for p in read_jsonl(g)]) == [1.0, 1.0]


@pytest.mark.parametrize("bad, message", [
    ('{"prompt": "2+2=", "answer": ""}', "'answer' is empty (got '')"),
    ('{"prompt": "   ", "answer": "4"}', "'prompt' is only whitespace (got '   ')"),
    ('{"prompt": "2+2=", "answer": "4"', "not valid JSON"),
    ('["2+2=", "4"]', "expected a JSON object"),
    ('{"prompt": "2+2="}', "missing key 'answer'"),
    ('{"prompt": 5, "answer": "4"}', "'prompt' must be a non-empty string (got 5)"),
    ('{"prompt": "2+2=", "answer": [4]}', "'answer' must be a string or a number (got [4])"),
    ('{"prompt": "2+2=", "answer": true}', "'answer' must be a string or a number (got True)"),
])
def test_jsonl_malformed_line_names_file_and_line(tmp_path, bad, message):
    f = write(tmp_path / "bad.jsonl", ['{"prompt": "1+1=", "answer": "2"}', "", bad])
    with pytest.raises(DatasetError) as err:
        read_jsonl(f)
    assert f"{f}:3: " in str(err.value) and message in str(err.value)


def test_jsonl_missing_or_empty_file(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        read_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(DatasetError, match="holds no records"):
        read_jsonl(write(tmp_path / "empty.jsonl", [""]))


def test_load_prompts_dispatch(tmp_path):
    f = write(tmp_path / "t.jsonl", ['{"prompt": "1+1=", "answer": "2"}'])
    cfg = DataConfig(source="jsonl", path=str(f))
    assert [p.answer for p in load_prompts(cfg, "train")] == ["2"]
    assert load_prompts(cfg, "eval") == []  # no eval_path
    arith = DataConfig(arithmetic=ArithmeticConfig(train_size=20, eval_size=5))
    assert len(load_prompts(arith, "train")) == 20 and len(load_prompts(arith, "eval")) == 5


def test_parquet_without_pyarrow_says_what_to_install(tmp_path):
    from megatron_sparse_rl._optional import _has

    if _has("pyarrow"):
        pytest.skip("pyarrow is installed")
    f = tmp_path / "x.parquet"
    f.write_bytes(b"PAR1")  # an existing path: a missing one is reported first (tests/unit/test_data_checks.py)
    with pytest.raises(ImportError, match="needs the 'pyarrow' package.*pip install pyarrow"):
        read_parquet(f)


def test_parquet_round_trip_and_row_errors(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["1+1=", "2*3="], "answer": ["2", "6"]}), f)
    assert [(p.text, p.answer) for p in read_parquet(f)] == [("1+1=", "2"), ("2*3=", "6")]
    pq.write_table(pa.table({"prompt": ["1+1=", None], "answer": ["2", "6"]}), f)
    with pytest.raises(DatasetError, match=r"d.parquet:row 2: 'prompt' must be a non-empty string"):
        read_parquet(f)
    with pytest.raises(DatasetError, match="missing column 'solution'"):
        read_parquet(f, answer_key="solution")


# ---- templates and encoding ----------------------------------------------------------------------------------

def test_plain_and_chat_templates(tok):
    from megatron_sparse_rl.data import encode_prompt

    text, ids = encode_prompt(tok, "12+7=", "plain")
    assert text == "12+7=" and ids == [char_tok.BOS_ID] + [char_tok.CHARACTERS.index(c) + 4 for c in "12+7="]
    text, ids = encode_prompt(tok, "12+7=", "chat")  # the char tokenizer has no chat template
    assert text == SIMPLE_CHAT_FORMAT.format(prompt="12+7=") == "q: 12+7=\na: "
    assert ids[0] == char_tok.BOS_ID and len(ids) == 1 + len(text)


def test_sft_example_is_prompt_answer_eos_with_mask(tok):
    from megatron_sparse_rl.data import encode_prompt
    from megatron_sparse_rl.data.types import Example

    _, ids = encode_prompt(tok, "12+7=", "plain")
    ex = encode_sft(tok, Example(prompt="12+7=", answer="19", ids=tuple(ids)))
    assert tok.decode(list(ex.input_ids), skip_special_tokens=False) == "<bos>12+7=19<eos>"
    assert ex.loss_mask == (0,) * 6 + (1, 1, 1)


def test_long_prompts_error_or_skip(tok, tmp_path):
    f = write(tmp_path / "t.jsonl", ['{"prompt": "1+1=", "answer": "2"}', '{"prompt": "123456789+1=", "answer": "x"}'])
    cfg = DataConfig(source="jsonl", path=str(f), max_prompt_tokens=8)
    with pytest.raises(DatasetError, match=rf"{f}:2: the prompt is 13 tokens .* data.max_prompt_tokens=8"):
        encode_prompts(read_jsonl(f), tok, cfg)
    kept, skipped = encode_prompts(read_jsonl(f), tok, dataclasses.replace(cfg, on_long_prompt="skip"))
    assert [e.answer for e in kept] == ["2"] and skipped == 1


# ---- stream and task ------------------------------------------------------------------------------------------

def test_stream_covers_each_epoch_once_and_is_deterministic():
    s = PromptStream(list(range(10)), 4, seed=3)
    batches = [s.next_batch() for _ in range(5)]  # 20 items = 2 epochs
    flat = [x for b in batches for x in b]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:]) == list(range(10))
    assert flat[:10] != flat[10:]  # reshuffled per epoch
    assert [PromptStream(list(range(10)), 4, seed=3).next_batch() for _ in range(1)][0] == batches[0]
    assert PromptStream(list(range(10)), 4, seed=3, shuffle=False).next_batch() == [0, 1, 2, 3]


def test_stream_resume_gives_the_same_next_batches():
    items = [f"p{i}" for i in range(7)]
    full = PromptStream(items, 3, seed=11)
    reference = [full.next_batch() for _ in range(8)]
    part = PromptStream(items, 3, seed=11)
    for _ in range(4):
        part.next_batch()
    state = json.loads(json.dumps(part.state_dict()))  # survives a JSON checkpoint
    resumed = PromptStream(items, 3, seed=11)
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(4)] == reference[4:]


def test_stream_rejects_a_state_from_another_dataset():
    state = PromptStream(list(range(5)), 2, seed=1).state_dict()
    with pytest.raises(ValueError, match="size was 5, is 6"):
        PromptStream(list(range(6)), 2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed was 1, is 2"):
        PromptStream(list(range(5)), 2, seed=2).load_state_dict(state)


def test_task_streams_resume_and_eval_is_fixed(tok):
    cfg = DataConfig(arithmetic=ArithmeticConfig(train_size=40, eval_size=10), seed=5)
    task = build_task(cfg, tok)
    assert len(task.train) == 40 and len(task.eval) == 10 and task.skipped == 0
    ex = task.train[0]
    assert ex.ids == tuple(tok(ex.prompt)["input_ids"]) and int(ex.answer) == eval(ex.prompt[:-1])
    assert task.eval_examples(3) == task.eval[:3] and task.eval_examples(None) == task.eval
    task.next_train(6), task.next_sft(5)
    state = task.state_dict()
    expect = (task.next_train(6), task.next_sft(5))
    again = build_task(cfg, tok)
    again.load_state_dict(state)
    assert (again.next_train(6), again.next_sft(5)) == expect
    assert {e.prompt for e in task.train}.isdisjoint({e.prompt for e in task.eval})
