"""Data checks before a run starts: every dataset problem named by config field, file and line, with nothing
written or removed; `msrl validate` and `msrl train` report them as `error: ...` (exit 2, no traceback) before
Megatron or vLLM start; a JSONL without `data.eval_path` gives evaluation and probe examples.

    .venv/bin/python -m pytest -q tests/unit/test_data_checks.py
"""
from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_sparse_rl.config.data import ArithmeticConfig, DataConfig
from megatron_sparse_rl.config.loader import ConfigError
from megatron_sparse_rl.data import DatasetError, DatasetMissing, build_task, check_data
from megatron_sparse_rl.models import char_tokenizer as char_tok
from megatron_sparse_rl.tools import cli
from tests.msrl import MSRL
from tests.snapshot import snapshot

ROOT = Path(__file__).resolve().parents[2]
TINY_MOE = str(ROOT / "configs" / "tiny_moe.yaml")
GOOD = b'{"prompt": "1+1=", "answer": "2"}\n'


@pytest.fixture(scope="module")
def tok():
    return char_tok.character_tokenizer()


def jsonl(folder: Path, name: str, content: bytes) -> Path:
    path = folder / name
    path.write_bytes(content)
    return path


def good_parquet(folder: Path, field: str) -> Path:
    """A valid parquet file (needs pyarrow), or for the data.path cases a placeholder that is never read."""
    if field == "data.path":
        return jsonl(folder, "unread.parquet", b"")
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["1+1="], "answer": ["2"]}), folder / "good.parquet")
    return folder / "good.parquet"


# One case per failure class: (file name, its bytes or None for no file, data.source, expected message part).
FAILURES = {
    "missing file": ("gone.jsonl", None, "jsonl", "does not exist"),
    "malformed JSON": ("bad.jsonl", GOOD * 2 + b'{"prompt": "2+2=" "answer": "4"}\n', "jsonl",
                       ":3: not valid JSON (Expecting ',' delimiter at column 19)"),
    "missing field": ("bad.jsonl", GOOD + b"\n" + GOOD + b'{"prompt": "2+2="}\n', "jsonl",
                      ":4: missing key 'answer' (need 'prompt' and 'answer'; has ['prompt'])"),
    "undecodable bytes": ("bad.jsonl", GOOD + b'{"prompt": "caf\xe9=", "answer": "1"}\n', "jsonl",
                          ":2: undecodable bytes (not UTF-8: byte 0xe9 at byte 16 of the line)"),
    "empty file": ("empty.jsonl", b"", "jsonl", "is empty: it holds no records"),
    "blank lines only": ("blank.jsonl", b"\n  \n", "jsonl", "has only blank lines (2): it holds no records"),
    "repeated field": ("bad.jsonl", GOOD + b'{"prompt": "1+2=", "answer": "3", "answer": "4"}\n', "jsonl",
                       ":2: key 'answer' appears 2 times in one object"),
    "wrong type": ("bad.jsonl", b'{"prompt": "1+1=", "answer": [2]}\n', "jsonl",
                   ":1: 'answer' must be a string or a number (got [2])"),
    "parquet path that does not exist": ("gone.parquet", None, "parquet", "does not exist"),
    "whitespace-only prompt": ("bad.jsonl", GOOD + b'{"prompt": " \\t\\n ", "answer": "1"}\n', "jsonl",
                               ":2: 'prompt' is only whitespace (got ' \\t\\n ')"),
    "empty answer": ("bad.jsonl", GOOD + b'{"prompt": "1+2=", "answer": ""}\n', "jsonl", ":2: 'answer' is empty"),
    "blank answer": ("bad.jsonl", b'{"prompt": "1+2=", "answer": "  "}\n' + GOOD, "jsonl",
                     ":1: 'answer' is empty (got '  ')"),
    "pathologically nested JSON": ("bad.jsonl", GOOD + b"[" * 100_000 + b"]" * 100_000 + b"\n", "jsonl",
                                   ":2: JSON nested too deeply to read"),
}


@pytest.mark.parametrize("case", list(FAILURES))
@pytest.mark.parametrize("field", ["data.path", "data.eval_path"])
def test_each_failure_names_field_file_and_line_and_changes_nothing(tmp_path, case, field):
    name, content, source, message = FAILURES[case]
    bad = tmp_path / name if content is None else jsonl(tmp_path, name, content)
    good = jsonl(tmp_path, "good.jsonl", GOOD) if source == "jsonl" else good_parquet(tmp_path, field)
    paths = {"path": str(bad), "eval_path": str(good)} if field == "data.path" else \
        {"path": str(good), "eval_path": str(bad)}
    before = snapshot(tmp_path)
    with pytest.raises(DatasetError) as err:
        check_data(DataConfig(source=source, **paths))
    assert str(err.value).startswith(f"{field}: ")
    assert str(bad) in str(err.value) and message in str(err.value)
    assert isinstance(err.value, ConfigError)  # the command line prints it as `error: ...`, exit 2
    assert isinstance(err.value, DatasetMissing) == (content is None)
    assert snapshot(tmp_path) == before


def test_byte_order_mark_and_crlf_lines_are_read(tmp_path):
    f = jsonl(tmp_path, "win.jsonl", b"\xef\xbb\xbf" + GOOD.replace(b"\n", b"\r\n") * 2 + b"\r\n")
    train, _ = check_data(DataConfig(source="jsonl", path=str(f)))
    assert train.records == 2


def test_a_directory_and_an_unreadable_parquet_are_named(tmp_path):
    (tmp_path / "d.jsonl").mkdir()
    with pytest.raises(DatasetError, match=r"data.path: dataset file '.*d.jsonl' is not a file"):
        check_data(DataConfig(source="jsonl", path=str(tmp_path / "d.jsonl")))
    pytest.importorskip("pyarrow")
    fake = jsonl(tmp_path, "fake.parquet", GOOD)
    with pytest.raises(DatasetError, match=r"data.path: .*fake.parquet: not a readable parquet file"):
        check_data(DataConfig(source="parquet", path=str(fake)))


def test_parquet_without_pyarrow_is_a_config_error(tmp_path):
    from megatron_sparse_rl._optional import _has

    if _has("pyarrow"):
        pytest.skip("pyarrow is installed")
    f = jsonl(tmp_path, "d.parquet", b"PAR1")
    with pytest.raises(DatasetError, match="data.source is 'parquet': .*needs the 'pyarrow' package"):
        check_data(DataConfig(source="parquet", path=str(f)))


def test_parquet_rows_are_checked_batch_by_batch(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    f = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": ["1+1="] * 5 + [""], "answer": ["2"] * 6}), f, row_group_size=2)
    with pytest.raises(DatasetError, match=r"data.path: .*d.parquet:row 6: 'prompt' must be a non-empty string"):
        check_data(DataConfig(source="parquet", path=str(f)))


def test_summary_counts_records_and_prompt_lengths(tmp_path, tok):
    f = jsonl(tmp_path, "t.jsonl", GOOD + b"\n" + b'{"prompt": "123456789+1=", "answer": "x"}\n')
    train, held_out = check_data(DataConfig(source="jsonl", path=str(f)))
    assert (train.records, train.too_long, held_out.records) == (2, None, 0)
    assert train.line() == f"train: data.path {str(f)!r}, 2 records" and held_out.line() == "eval: none"
    cfg = DataConfig(source="jsonl", path=str(f), max_prompt_tokens=8)
    with pytest.raises(DatasetError, match=rf"{f}:3: the prompt is 13 tokens .* data.max_prompt_tokens=8"):
        check_data(cfg, tok)
    train, _ = check_data(dataclasses.replace(cfg, on_long_prompt="skip"), tok)
    assert train.too_long == 1 and "1 over data.max_prompt_tokens (skipped)" in train.line()
    with pytest.raises(DatasetError, match=r"data.path .*: all 2 prompts are longer than data.max_prompt_tokens=3"):
        check_data(dataclasses.replace(cfg, on_long_prompt="skip", max_prompt_tokens=3), tok)


def test_characters_the_tokenizer_cannot_encode_are_named_with_their_line(tmp_path, tok):
    """The character tokenizer knows lowercase letters, digits and a little punctuation: "é" and "X" would be read
    as <unk>; `check_data` (msrl validate) and `build_task` (msrl train) name the line and the characters."""
    f = jsonl(tmp_path, "t.jsonl", GOOD + '{"prompt": "café+1=", "answer": "2"}\n'.encode())
    g = jsonl(tmp_path, "u.jsonl", GOOD * 2 + b'{"prompt": "1+1=", "answer": "X"}\n')
    before = snapshot(tmp_path)
    for path, line, what, shown in ((f, 2, "prompt", "'é' (U+00E9)"), (g, 3, "answer", "'X' (U+0058)")):
        cfg = DataConfig(source="jsonl", path=str(path))
        check_data(cfg)  # without a tokenizer there is nothing to check against
        for call in (lambda: check_data(cfg, tok), lambda: build_task(cfg, tok)):
            with pytest.raises(DatasetError) as err:
                call()
            assert f"{path}:{line}: the {what} holds {shown}, which the model's tokenizer cannot encode" \
                in str(err.value) and "'<unk>'" in str(err.value)
    assert snapshot(tmp_path) == before


def test_a_byte_level_tokenizer_has_no_unknown_characters():
    from megatron_sparse_rl.data.templates import unknown_characters

    class ByteLevel:  # a tokenizer without an unknown token (GPT-2 style byte-level BPE) encodes every character
        unk_token_id = None

    assert unknown_characters(ByteLevel(), "café ∑") == []


def test_arithmetic_settings_are_checked_too():
    with pytest.raises(DatasetError, match=r"data.arithmetic.train_size \+ eval_size = 40 is more than half"):
        check_data(DataConfig(arithmetic=ArithmeticConfig(ops=("+",), max_digits=1, train_size=30, eval_size=10)))


# ---- no held-out split ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg_of", [
    lambda f: DataConfig(source="jsonl", path=str(f)),
    lambda f: DataConfig(arithmetic=ArithmeticConfig(train_size=20, eval_size=0)),
], ids=["jsonl without eval_path", "arithmetic eval_size 0"])
def test_without_held_out_split_eval_and_probe_use_the_first_train_examples(tmp_path, tok, caplog, cfg_of):
    from megatron_sparse_rl.training.report import Reporter

    f = jsonl(tmp_path, "t.jsonl", GOOD + b'{"prompt": "2*3=", "answer": 6}\n')
    with caplog.at_level(logging.WARNING):
        task = build_task(cfg_of(f), tok)
    assert not task.has_held_out and task.eval == []
    assert task.eval_examples(64) == task.train and task.eval_examples(1) == task.train[:1]
    assert "evaluation and the weight-sync probe use the first train prompts" in caplog.text
    probe = Reporter.probe_tokens(SimpleNamespace(ctx=SimpleNamespace(task=task, tokenizer=tok)))  # crashed here
    first = task.train[0]
    assert probe.tolist() == [list(first.ids) + tok.encode(first.answer, add_special_tokens=False)]


# ---- the command line ----------------------------------------------------------------------------------------

def sets(tmp_path: Path, *extra: str) -> list[str]:
    """--set overrides that keep the model and run directory inside tmp_path."""
    return ["--set", f"model.path={tmp_path / 'model'}", f"logging.dir={tmp_path / 'run'}", *extra]


def test_validate_reports_a_bad_data_file_without_a_traceback(tmp_path):
    bad = jsonl(tmp_path, "bad.jsonl", GOOD * 2 + b'{"prompt": "2+2=" "answer": "4"}\n')
    before = snapshot(tmp_path)
    done = subprocess.run([*MSRL, "validate", TINY_MOE,
                           *sets(tmp_path, "data.source=jsonl", f"data.path={bad}")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert f"error: data.path: {bad}:3: not valid JSON" in done.stderr
    assert snapshot(tmp_path) == before


def test_train_reports_a_bad_data_file_before_anything_starts(tmp_path):
    bad = jsonl(tmp_path, "bad.jsonl", GOOD + b'{"prompt": "2+2="}\n')
    before = snapshot(tmp_path)
    done = subprocess.run([*MSRL, "train", TINY_MOE,
                           *sets(tmp_path, "data.source=jsonl", f"data.path={bad}")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert f"error: data.path: {bad}:2: missing key 'answer'" in done.stderr
    assert snapshot(tmp_path) == before  # no run directory, no tiny model: Megatron and vLLM never started


@pytest.mark.parametrize("command", ["validate", "train"])
def test_validate_and_train_name_a_character_the_tokenizer_cannot_encode(tmp_path, command):
    bad = jsonl(tmp_path, "bad.jsonl", GOOD + '{"prompt": "1+½=", "answer": "2"}\n'.encode())
    before = snapshot(tmp_path)
    done = subprocess.run([*MSRL, command, TINY_MOE,
                           *sets(tmp_path, "data.source=jsonl", f"data.path={bad}")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert f"error: {bad}:2: the prompt holds '½' (U+00BD), which the model's tokenizer cannot encode" \
        in done.stderr
    assert snapshot(tmp_path) == before  # train: no run directory, no tiny model, nothing started


def test_validate_prints_the_data_and_what_evaluation_uses(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    f = jsonl(tmp_path, "t.jsonl", GOOD * 3)
    assert cli.main(["validate", TINY_MOE, *sets(tmp_path, "data.source=jsonl", f"data.path={f}")]) == 0
    out = capsys.readouterr().out
    assert f"  train: data.path {str(f)!r}, 3 records\n  eval: none\n" in out
    assert "note: data.eval_path is unset: evaluation and the weight-sync probe use the first train prompts" in out
    assert not (tmp_path / "run").exists() and not (tmp_path / "model").exists()


def test_validate_checks_the_model_and_directories_a_config_points_to(tmp_path, capsys, monkeypatch):
    import shutil

    from megatron_sparse_rl.config.schema import TinyModelConfig
    from megatron_sparse_rl.models.tiny_config import tiny_fields, tiny_hf_config
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    monkeypatch.chdir(ROOT)
    # a file where the run directory's parent goes (a file at logging.dir itself is refused with the config)
    (tmp_path / "blocker").write_text("a file where the run directory's parent goes")
    run_dir = tmp_path / "blocker" / "run"
    argv = ["validate", TINY_MOE, *sets(tmp_path, "model.tiny=null", f"logging.dir={run_dir}")]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: 3 problems:")
    assert f"model.path {str(tmp_path / 'model')!r} does not exist (and model.tiny is not set)" in err
    assert f"logging.dir {str(run_dir)!r} cannot be created: {str(tmp_path / 'blocker')!r} is not a writable" in err
    assert "checkpoint.dir (default <logging.dir>/checkpoints)" in err
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(tiny_hf_config(TinyModelConfig())))
    assert cli.main(argv) == 2
    assert "no model.safetensors or model.safetensors.index.json" in capsys.readouterr().err
    assert cli.main([*argv, "--no-files"]) == 0  # the config alone, e.g. a cluster path on a laptop
    assert "files: not checked (--no-files)" in capsys.readouterr().out
    # the weights of that model, without its tokenizer files
    full = build_tiny_hf_model(tmp_path / "full", arch=TinyModelConfig().arch, **tiny_fields(TinyModelConfig()))
    shutil.copy(full / "model.safetensors", tmp_path / "model" / "model.safetensors")
    assert cli.main(argv) == 2  # transformers would build an empty tokenizer here, and every prompt would be []
    assert "its tokenizer encodes '12+7=' to no tokens" in capsys.readouterr().err
    char_tok.build_tokenizer(tmp_path / "model")
    (tmp_path / "blocker").unlink()
    assert cli.main(argv) == 0 and capsys.readouterr().out.rstrip().endswith("ok")
