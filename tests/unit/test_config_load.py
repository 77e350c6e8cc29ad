"""Loading run configs: every file in configs/ loads and validates; the strict loader's errors; --set overrides.

    .venv/bin/python -m pytest -q tests/unit/test_config_load.py
"""
from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import torch
import yaml

from megatron_sparse_rl.config import ConfigError, RunConfig, load_config, to_dict
from megatron_sparse_rl.validation import validate
from megatron_sparse_rl.config.loader import parse_override

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.fixture(autouse=True)
def _at_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # model paths in configs/ are relative to the repository root


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_the_promised_configs_exist():
    assert {"tiny_moe.yaml", "tiny_moe_tp2ep2.yaml", "tiny_dense.yaml", "tiny_deepseek_v3.yaml",
            "deepseek_v3_slurm.yaml", "kimi_k2_slurm.yaml"} <= {p.name for p in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_config_loads_and_validates(path):
    assert path.read_text().startswith("#"), f"{path.name} must open with a comment saying what it is"
    run = load_config(path)
    world = run.launch.nodes * run.launch.nproc_per_node
    # A config naming NCCL is a GPU config: check it as if CUDA were present.
    cuda = torch.cuda.is_available() or run.parallel.backend == "nccl"
    validate(run, world, cuda=cuda)


def test_tiny_configs_say_what_they_promise():
    moe, dense = load_config(ROOT / "configs/tiny_moe.yaml"), load_config(ROOT / "configs/tiny_dense.yaml")
    tp2ep2 = load_config(ROOT / "configs/tiny_moe_tp2ep2.yaml")
    assert moe.model.path == "runs/tiny_moe/model" and moe.model.tiny.experts > 0
    assert moe.launch.nodes * moe.launch.nproc_per_node == 1
    assert dense.model.tiny.experts == 0
    assert (tp2ep2.parallel.tp, tp2ep2.parallel.ep, tp2ep2.launch.nproc_per_node) == (2, 2, 4)


def test_tiny_deepseek_config_is_a_tiny_mla_model_on_cpu():
    run = load_config(ROOT / "configs/tiny_deepseek_v3.yaml")
    assert run.model.tiny.arch == "deepseek_v3" and run.model.path == "runs/tiny_deepseek_v3/model"
    assert run.launch.world_size == 1 and run.rollout.kv.policy == "none"
    spec = validate(run, 1, cuda=False)  # on CPU: the 576 latent vLLM's CPU MLA runs
    assert spec.architecture == "DeepseekV3ForCausalLM" and spec.latent_width == 576
    assert spec.is_moe and spec.n_group == 2 and spec.rope_type == "default"


# The GPU examples: the bundled config.json of the model they name, the world they ask for, the GPUs they assume.
SLURM_EXAMPLES = {"deepseek_v3_slurm.yaml": ("deepseek-v3", 256), "kimi_k2_slurm.yaml": ("kimi-k2", 512)}
GPU_MEM_GIB = 141  # H200, as their comments say


@pytest.mark.parametrize("name", sorted(SLURM_EXAMPLES))
def test_slurm_examples_fit_the_model_they_name(tmp_path, capsys, name):
    """A cluster model.path is not here: validate the layout against the bundled config.json of the same model
    (model checks: TP divides heads and vocabulary, PP the 61 layers, EP the experts), check the SLURM launch, and
    run the `msrl plan` line of the file's header, which must describe this config and fit."""
    import json

    from megatron_sparse_rl.launch.checks import check_launch
    from megatron_sparse_rl.planner.shapes import ASSETS
    from megatron_sparse_rl.tools import cli

    model, world = SLURM_EXAMPLES[name]
    path = ROOT / "configs" / name
    run = load_config(path)
    assert run.launch.world_size == world and run.launch.nproc_per_node == 8 and run.launch.rollout_world_size == 0
    assert run.model.dtype == run.rollout.dtype == "bfloat16" and run.model.tiny is None
    assert validate(run, world, cuda=True) is None  # model.path is a cluster path: model checks skipped here
    check_launch(run, run.launch, slurm=True)
    (tmp_path / "config.json").write_text(json.dumps(json.loads((ASSETS / f"{model}.json").read_text())))
    spec = validate(load_config(path, [f"model.path={tmp_path}"]), world, cuda=True)
    assert spec.latent_width == 576
    p, r = run.parallel, run.rollout
    argv = ["plan", model, "--nodes", str(run.launch.nodes), "--gpus-per-node", "8", "--gpu-mem", str(GPU_MEM_GIB),
            "--seq-len", str(r.max_model_len), "--layout", f"{p.tp},{p.pp},{p.ep}",
            "--rollout-gpus", str(r.tensor_parallel_size)]
    assert f"#   msrl {' '.join(argv)}\n" in path.read_text()
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert f"layout tp{p.tp} pp{p.pp} ep{p.ep}: " in capsys.readouterr().out


def test_empty_file_gives_the_defaults(tmp_path):
    assert load_config(_write(tmp_path, "# nothing\n")) == RunConfig()


def test_unknown_top_level_key(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key modle \(did you mean model\?\); allowed under the top level: "):
        load_config(_write(tmp_path, "modle:\n  path: x\n"))


def test_unknown_nested_key_names_the_dotted_path(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, "rollout:\n  sampling:\n    temprature: 0.7\n"))
    assert "unknown key rollout.sampling.temprature (did you mean rollout.sampling.temperature?)" in str(e.value)


def _sections(cls=RunConfig, path=""):
    """(dotted path, dataclass) of every nested section, `model.tiny` (an optional one) included."""
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        sub = next((c for c in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(c)), None)
        if sub is not None:
            dotted = f"{path}{f.name}"
            yield dotted, sub
            yield from _sections(sub, dotted + ".")


def _nest(dotted: str, value) -> dict:
    for part in reversed(dotted.split(".")):
        value = {part: value}
    return value


SECTIONS = sorted(_sections())


def test_every_nesting_level_is_walked():
    names = {name for name, _ in SECTIONS}
    assert {"model.tiny", "rollout.kv", "rollout.sampling", "algorithm.corrections.sparse_rl", "launch.slurm"} <= names


@pytest.mark.parametrize("section, cls", SECTIONS, ids=[name for name, _ in SECTIONS])
@pytest.mark.parametrize("via", ["file", "--set"])
def test_unknown_key_in_any_section_is_named_with_a_suggestion(tmp_path, section, cls, via):
    field = max((f.name for f in dataclasses.fields(cls)), key=len)  # a long name: one clear nearest match
    typo = field + field[-1]
    path = tmp_path / "run.yaml"
    path.write_text("# run\n" + (yaml.safe_dump(_nest(f"{section}.{typo}", 1)) if via == "file" else ""))
    with pytest.raises(ConfigError) as e:
        load_config(path, [f"{section}.{typo}=1"] if via == "--set" else [])
    assert str(e.value).startswith(f"unknown key {section}.{typo} (did you mean {section}.{field}?); "
                                   f"allowed under {section}: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]  # nothing written


def test_misspelt_tiny_model_key_is_named_not_a_type_mismatch(tmp_path):
    model_dir = tmp_path / "model"
    path = _write(tmp_path, f"model:\n  path: {model_dir}\n  tiny: {{hiden: 8}}\n")
    with pytest.raises(ConfigError, match=r"^unknown key model\.tiny\.hiden \(did you mean model\.tiny\.hidden\?\)"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"^unknown key rollout\.kv\.windw \(did you mean rollout\.kv\.window\?\)"):
        load_config(path, ["model.tiny=null", "rollout.kv.windw=8"])
    assert not model_dir.exists()


def test_set_opens_a_section_the_file_leaves_null(tmp_path):
    path = _write(tmp_path, "model:\n  tiny: null\n")
    assert load_config(path, ["model.tiny.hidden=32"]).model.tiny.hidden == 32
    with pytest.raises(ConfigError, match=r"model\.tiny: expected TinyModelConfig or null, got 5"):
        load_config(path, ["model.tiny=5"])


def test_wrong_type_names_field_type_and_value(tmp_path):
    with pytest.raises(ConfigError, match=r"learner\.micro_batch_size: expected int, got 'four'"):
        load_config(_write(tmp_path, "learner:\n  micro_batch_size: four\n"))
    with pytest.raises(ConfigError, match=r"parallel\.sequence_parallel: expected bool \(true/false\), got 1"):
        load_config(_write(tmp_path, "parallel:\n  sequence_parallel: 1\n"))
    with pytest.raises(ConfigError, match=r"model: expected a mapping of ModelConfig fields, got 'x'"):
        load_config(_write(tmp_path, "model: x\n"))


def test_unknown_enum_value_lists_the_choices(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(_write(tmp_path, "algorithm:\n  loss:\n    name: grpoo\n"))
    msg = str(e.value)
    assert msg.startswith("algorithm.loss.name: 'grpoo' is not allowed")
    for choice in ("grpo", "dapo", "dual_clip", "gspo", "gspo_token", "cispo"):
        assert repr(choice) in msg
    assert "did you mean 'grpo'" in msg


def test_out_of_range_value_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout\.sampling\.top_p must be in \(0, 1\] \(got 1\.5\)"):
        load_config(_write(tmp_path, "rollout:\n  sampling:\n    top_p: 1.5\n"))


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_write(tmp_path, "model: [unclosed\n"))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(_write(tmp_path, "- a\n- b\n"))


@pytest.mark.parametrize("text, parts, value", [
    ("a.b=1", ["a", "b"], 1),
    ("learner.optimizer.lr=3e-5", ["learner", "optimizer", "lr"], "3e-5"),  # YAML 1.1 reads this as a string
    ("x=true", ["x"], True),
    ("model.tiny=null", ["model", "tiny"], None),
    ("s=a=b", ["s"], "a=b"),
    ("l=[1, 2]", ["l"], [1, 2]),
    ("e=", ["e"], ""),
])
def test_parse_override(text, parts, value):
    assert parse_override(text) == (parts, value)


@pytest.mark.parametrize("text, message", [
    ("noequals", "must look like section.field=value"),
    ("a..b=1", "empty name in the dotted path"),
    ("a=[unclosed", "not valid YAML"),
])
def test_bad_override(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_override(text)


def test_overrides_set_nested_fields_over_the_file(tmp_path):
    path = _write(tmp_path, "parallel:\n  tp: 2\nrollout:\n  sampling:\n    n: 2\n")
    run = load_config(path, ["parallel.tp=1", "learner.optimizer.lr=3e-5",
                             "algorithm.corrections.sparse_rl.enabled=true", "rollout.sampling.stop=['###']"])
    assert run.parallel.tp == 1
    assert run.rollout.sampling.n == 2  # untouched by the overrides
    assert run.learner.optimizer.lr == pytest.approx(3e-5) and isinstance(run.learner.optimizer.lr, float)
    assert run.algorithm.corrections.sparse_rl.enabled is True
    assert run.rollout.sampling.stop == ("###",)
    assert load_config(path, ()).parallel.tp == 2


def test_override_errors_name_the_field(tmp_path):
    path = _write(tmp_path, "model:\n  path: x\n")
    with pytest.raises(ConfigError, match="'path' is a value, not a section"):
        load_config(path, ["model.path.x=1"])
    with pytest.raises(ConfigError, match=r"unknown key learner\.optimiser \(did you mean learner\.optimizer\?\)"):
        load_config(path, ["learner.optimiser.lr=1"])
    with pytest.raises(ConfigError, match=r"parallel\.tp: expected int, got 'two'"):
        load_config(path, ["parallel.tp=two"])


def test_to_dict_round_trips():
    run = load_config(ROOT / "configs/tiny_moe_tp2ep2.yaml")
    from megatron_sparse_rl.config.loader import from_dict

    assert from_dict(RunConfig, to_dict(run)) == run
