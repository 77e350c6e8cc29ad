"""The file checks `msrl validate` and `msrl train` share (training/preflight.py): each bad file is named before
anything starts, and `msrl train` refuses it with the same message, exit 2, no traceback and nothing written."""
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from megatron_sparse_rl.config import ConfigError, load_config
from megatron_sparse_rl.validation.resolve import resolve
from megatron_sparse_rl.validation.validate import validate
from megatron_sparse_rl.models.tiny import build_tiny_hf_model
from megatron_sparse_rl.training.preflight import check_files
from tests.msrl import MSRL
from tests.unit.test_fp8_import import GATE, QUANT, _variant, plain, stored, write_checkpoint  # noqa: F401

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE with its tokenizer, sharded in two files with an index."""
    from safetensors.torch import load_file

    src = build_tiny_hf_model(tmp_path_factory.mktemp("src") / "m", seed=1)
    return write_checkpoint(src, tmp_path_factory.mktemp("model") / "m", load_file(str(src / "model.safetensors")))


def _run(model_dir: Path, tmp_path: Path, *sets: str):
    cfg = load_config(REPO / "configs/tiny_moe.yaml", [f"model.path={model_dir}", "model.tiny=null",
                                                       f"logging.dir={tmp_path / 'run'}", *sets])
    return resolve(cfg, validate(cfg, 1, cuda=False))


def _check(run, cuda=False):
    return check_files(run, validate(run, 1, cuda=False), cuda=cuda)


def _copy(model_dir: Path, tmp_path: Path) -> Path:
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(model_dir, out)
    return out


def test_a_sound_model_passes(model, tmp_path):
    lines = _check(_run(model, tmp_path))
    assert any("train:" in line for line in lines)


def test_a_missing_shard_is_named(model, tmp_path):
    broken = _copy(model, tmp_path)
    (broken / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ConfigError, match="model-00002-of-00002.safetensors"):
        _check(_run(broken, tmp_path))


def test_a_tokenizer_larger_than_the_vocabulary_is_named(model, tmp_path):
    from transformers import AutoTokenizer

    broken = _copy(model, tmp_path)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    tok = AutoTokenizer.from_pretrained(str(broken))
    tok.add_tokens([f"<extra_{i}>" for i in range(vocab)])
    tok.save_pretrained(str(broken))
    with pytest.raises(ConfigError, match=rf"more than the model's vocab_size {vocab}"):
        _check(_run(broken, tmp_path))


def test_msrl_train_runs_the_same_checks_before_anything_starts(model, tmp_path):
    """The tokenizer check `msrl train` used to skip: refused with validate's message, exit 2, no traceback, and
    no run directory written (it is checked before the directory is claimed)."""
    from transformers import AutoTokenizer

    broken = _copy(model, tmp_path)
    tok = AutoTokenizer.from_pretrained(str(broken))
    tok.add_tokens([f"<extra_{i}>" for i in range(1000)])
    tok.save_pretrained(str(broken))
    run_dir = tmp_path / "run"
    proc = subprocess.run([*MSRL, "train", str(REPO / "configs/tiny_moe.yaml"), "--set",
                           f"model.path={broken}", "model.tiny=null", f"logging.dir={run_dir}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error:" in proc.stderr and "vocab_size" in proc.stderr and "Traceback" not in proc.stderr
    assert not run_dir.exists()


def test_an_fp8_scale_of_the_wrong_shape_is_named(plain, stored, tmp_path):  # noqa: F811
    d = _variant(plain, tmp_path, stored, lambda t: t.update({GATE + "_scale_inv": torch.ones(1, 3)}))
    run = _run(d, tmp_path)
    with pytest.raises(ConfigError, match=rf"scale '{GATE}_scale_inv' has shape \(1, 3\), expected \(2, 3\)"):
        _check(run, cuda=True)


def test_an_fp8_release_is_refused_where_the_engine_cannot_serve_it(plain, stored, tmp_path):  # noqa: F811
    d = _variant(plain, tmp_path, stored)
    run = _run(d, tmp_path)
    _check(run, cuda=True)  # a GPU engine serves it
    with pytest.raises(ConfigError, match=r"block-wise fp8 checkpoint .* GPUs only"):
        _check(run, cuda=False)


def test_a_prompt_longer_than_max_model_len_is_named_with_its_line(model, tmp_path):
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"},
            {"prompt": "9" * 80 + "+1=", "answer": "1" + "0" * 80}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = _run(model, tmp_path, "data.source=jsonl", f"data.path={data}", "rollout.max_model_len=64",
               "rollout.sampling.max_tokens=8")
    with pytest.raises(ConfigError, match=rf"{data}:3: the templated prompt is \d+ tokens, but rollout.max_model_len "
                                          r"is 64"):
        _check(run)
    assert data.read_text().count("\n") == 3  # read, not rewritten


def test_a_failed_checkpoint_write_names_its_path_and_leaves_no_partial_files(tmp_path):
    """A full disk's OSError names no file: the save names the checkpoint and removes its temporary directory."""
    import errno

    from megatron_sparse_rl.run.run_dir import RunDirError
    from megatron_sparse_rl.training.state import _writing

    path, tmp = tmp_path / "step_000002_sft_000000", tmp_path / ".step_000002_sft_000000.tmp"
    with pytest.raises(RunDirError, match=rf"could not write the checkpoint '{path}': No space left on device"):
        with _writing(path, "checkpoint", cleanup=tmp):
            tmp.mkdir()
            (tmp / "half.distcp").write_bytes(b"x" * 10)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert sorted(p.name for p in tmp_path.iterdir()) == []
