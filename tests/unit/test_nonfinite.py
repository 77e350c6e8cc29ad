"""Non-finite values are refused or stop the run: every float of the config (inf / nan, YAML's spellings and
`--set` overrides included, and `msrl validate`), a step's loss or gradient norm (learner/finite.py), the
learner's weights before a checkpoint or export, the sync probe's diagnosis (weight_sync/verify.py), and
`msrl plan`'s sizes.

    .venv/bin/python -m pytest -q tests/unit/test_nonfinite.py
"""
import contextlib
import dataclasses
import json
import math
import typing
from pathlib import Path

import pytest
import torch

from megatron_sparse_rl.config import ConfigError, RunConfig, load_config
from megatron_sparse_rl.learner.finite import (
    NonFiniteError, nonfinite_parameters, require_finite, require_finite_weights,
)
from megatron_sparse_rl.weight_sync import WeightSyncError, compare_engines
from tests.snapshot import snapshot

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs/tiny_moe.yaml"


def _float_fields(cls=RunConfig, prefix="") -> list[str]:
    """Every float (or optional float) field of the schema, dotted, read from the annotations (independently of
    the check under test, which walks values)."""
    out = []
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        args = typing.get_args(tp) or (tp,)
        sections = [a for a in args if dataclasses.is_dataclass(a)]
        if sections:
            out += _float_fields(sections[0], f"{prefix}{f.name}.")
        elif float in args:
            out.append(f"{prefix}{f.name}")
    return out


FLOATS = _float_fields()


def test_the_schema_has_the_float_fields_this_test_walks():
    assert {"learner.optimizer.lr", "trainer.sft.lr", "algorithm.loss.clip_high", "trainer.verify_sync_tol",
            "rollout.sampling.temperature", "model.tiny.init_std"} <= set(FLOATS)


@pytest.mark.parametrize("spelling", [".inf", "-.inf", ".nan", "inf", "nan", "1e999"])
@pytest.mark.parametrize("field", FLOATS)
def test_every_float_field_refuses_inf_and_nan_naming_the_field(field, spelling):
    sets = [f"{field}={spelling}"] + (["model.tiny.arch=qwen3_moe"] if field.startswith("model.tiny.") else [])
    with pytest.raises(ConfigError) as err:
        load_config(CONFIG, sets)
    msg = str(err.value)
    assert msg.startswith(field + " ") or f" {field} " in msg, msg
    assert ("nan" in msg) if "nan" in spelling else ("inf" in msg), msg


def test_an_infinite_learning_rate_says_it_must_be_finite():
    with pytest.raises(ConfigError, match=r"^learner\.optimizer\.lr must be finite \(got inf\)$"):
        load_config(CONFIG, ["learner.optimizer.lr=.inf"])
    with pytest.raises(ConfigError, match=r"^trainer\.verify_sync_tol must be finite \(got inf\)$"):
        load_config(CONFIG, ["trainer.verify_sync_tol=inf"])


def test_a_yaml_file_with_inf_is_refused_by_msrl_validate(tmp_path, capsys):
    from megatron_sparse_rl.tools.cli import main

    cfg = tmp_path / "run.yaml"
    cfg.write_text(CONFIG.read_text() + "\nalgorithm:\n  loss:\n    clip_high: .inf\n")
    assert main(["validate", str(cfg), "--no-files"]) == 2
    err = capsys.readouterr().err
    assert "error: algorithm.loss.clip_high must be finite (got inf)" in err and "Traceback" not in err


def test_a_step_with_a_non_finite_loss_or_grad_norm_names_the_step_and_quantity():
    require_finite({"loss": 0.5, "grad norm": 3.0}, "RL step 1")
    with pytest.raises(NonFiniteError) as err:
        require_finite({"loss": math.nan, "grad norm": math.inf}, "RL step 3")
    msg = str(err.value)
    assert msg.startswith("RL step 3: loss is nan and grad norm is inf") and "learner.optimizer.lr" in msg
    assert isinstance(err.value, ConfigError)  # msrl train prints it as `error: ...`, exit 2, no traceback


class Learner:
    """A stand-in learner: a real module, and logprobs computed from its weight."""

    def __init__(self, value: float):
        self.model = torch.nn.Linear(3, 3)
        with torch.no_grad():
            self.model.weight.fill_(0.1)
            self.model.bias[1] = value

    @contextlib.contextmanager
    def scoring_temperature(self, t):
        yield

    def forward_logprobs(self, rows):
        return {"logprobs": torch.full((rows.shape[0], rows.shape[1] - 1), -1.0) * self.model.bias.sum()}


def test_nonfinite_parameters_names_them():
    assert nonfinite_parameters(Learner(0.0).model) == []
    assert nonfinite_parameters(Learner(math.nan).model) == ["bias: nan"]
    assert nonfinite_parameters(Learner(math.inf).model) == ["bias: inf"]


def test_weights_are_checked_before_they_are_written():
    require_finite_weights(Learner(0.0), "checkpoint")
    with pytest.raises(NonFiniteError, match=r"the learner's weights are not finite \(bias: nan\): refusing to "
                                             r"write them as a checkpoint"):
        require_finite_weights(Learner(math.nan), "checkpoint")


def test_the_probe_blames_the_learners_weights_not_the_sync():
    rows = [[1, 2, 3]]
    engine = {"rank 0": torch.full((1, 2), -1.0)}
    with pytest.raises(NonFiniteError) as err:  # the learner's weights are NaN: so are its probe logprobs
        compare_engines(Learner(math.nan), rows, 1e-3, lambda r: engine)
    assert "the learner's weights are not finite (bias: nan)" in str(err.value)
    assert "weight sync is not at fault" in str(err.value)
    with pytest.raises(NonFiniteError, match="the learner's weights are not finite"):  # a rank comparing nothing
        compare_engines(Learner(math.nan), rows, 1e-3, None)
    with pytest.raises(WeightSyncError, match="the weight sync moved wrong weights"):  # finite learner: the sync
        compare_engines(Learner(3.0), rows, 1e-3, lambda r: engine)


@pytest.mark.parametrize("argv, flag", [(["--gpu-mem", "inf"], "--gpu-mem"), (["--gpu-mem", "nan"], "--gpu-mem"),
                                        (["--gpu-mem", "80", "--margin", "nan"], "--margin"),
                                        (["--gpu-mem", "80", "--margin=-inf"], "--margin"),
                                        (["--gpu-mem", "80", "--sync-bandwidth", "inf"], "--sync-bandwidth")])
def test_msrl_plan_refuses_non_finite_sizes_naming_the_argument(capsys, argv, flag):
    from megatron_sparse_rl.tools.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["plan", "qwen3-30b-a3b", "--gpus", "8", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: must be a" in err and ("finite" in err or "GB/s" in err)


def test_msrl_plan_refuses_a_model_config_with_infinite_sizes(tmp_path, capsys):
    from megatron_sparse_rl.planner.shapes import ASSETS
    from megatron_sparse_rl.tools.cli import main

    cfg = json.loads((ASSETS / "qwen3-30b-a3b.json").read_text())
    text = json.dumps({**cfg, "hidden_size": 1.0}).replace('"hidden_size": 1.0', '"hidden_size": Infinity')
    (tmp_path / "config.json").write_text(text)
    before = snapshot(tmp_path)
    assert main(["plan", str(tmp_path), "--gpus", "8", "--gpu-mem", "80"]) == 2
    err = capsys.readouterr().err
    assert f"error: {tmp_path / 'config.json'}: Infinity is not a number" in err and "Traceback" not in err
    assert snapshot(tmp_path) == before


def test_the_planners_options_refuse_non_finite_sizes():
    from megatron_sparse_rl.planner import PlanOptions

    with pytest.raises(ValueError, match=r"gpu_mem_gib must be finite \(got inf\)"):
        PlanOptions(gpus=8, gpu_mem_gib=math.inf)
    with pytest.raises(ValueError, match=r"margin must be finite \(got nan\)"):
        PlanOptions(gpus=8, gpu_mem_gib=80.0, margin=math.nan)
