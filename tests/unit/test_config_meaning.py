"""Configs that would mean something else than they say are refused at load, naming the fields, with nothing
written: a temperature vLLM treats as greedy with groups of n > 1, a temperature vLLM raises to 0.01, a
StreamingLLM budget that cuts the promised window, and pathologically nested YAML or JSON (a RecursionError
traceback before).

The engine's rules are read from vLLM's own sampling_params when vLLM is installed (the reference), and from
the values written down for vLLM 0.32 otherwise.

    .venv/bin/python -m pytest -q tests/unit/test_config_meaning.py
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from megatron_sparse_rl.config import ConfigError, load_config
from megatron_sparse_rl.config.rollout import KVConfig
from tests.msrl import MSRL
from tests.snapshot import snapshot

ROOT = Path(__file__).resolve().parents[2]
TINY_MOE = ROOT / "configs" / "tiny_moe.yaml"


def _write(folder: Path, text: str, name: str = "run.yaml") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def _refused(path: Path, overrides=()) -> str:
    """The ConfigError message of loading `path`; the folder is unchanged by the attempt."""
    before = snapshot(path.parent)
    with pytest.raises(ConfigError) as err:
        load_config(path, list(overrides))
    assert snapshot(path.parent) == before
    return str(err.value)


# ---- temperature ---------------------------------------------------------------------------------------------

def test_our_thresholds_are_vllms():
    sp = pytest.importorskip("vllm.sampling_params")
    from megatron_sparse_rl.config.rollout import GREEDY_BELOW, MIN_SAMPLED_TEMPERATURE

    assert (GREEDY_BELOW, MIN_SAMPLED_TEMPERATURE) == (sp._SAMPLING_EPS, sp._MAX_TEMP)
    # what the rules stand for: vLLM samples 5e-3 at 0.01, and refuses greedy (0) with n > 1
    assert sp.SamplingParams(temperature=5e-3).temperature == pytest.approx(0.01)
    with pytest.raises(Exception, match="n must be 1 when using greedy sampling"):
        sp.SamplingParams(temperature=0.0, n=4)


@pytest.mark.parametrize("temperature", ["0", "0.0"])
def test_greedy_temperature_with_groups_is_refused_naming_both_fields(tmp_path, temperature):
    path = _write(tmp_path, f"rollout:\n  sampling:\n    n: 4\n    temperature: {temperature}\n")
    message = _refused(path)
    assert message.startswith("rollout.sampling.temperature = 0 (greedy) with rollout.sampling.n = 4")
    assert "set rollout.sampling.temperature >= 0.01, or rollout.sampling.n = 1" in message


@pytest.mark.parametrize("temperature", ["5e-6", "1e-5", "0.005", "0.00999"])
def test_a_temperature_vllm_would_raise_to_001_is_refused(tmp_path, temperature):
    path = _write(tmp_path, f"rollout:\n  sampling:\n    n: 1\n    temperature: {temperature}\n")
    message = _refused(path)
    assert message.startswith(f"rollout.sampling.temperature must be 0 (greedy) or >= 0.01 (got {float(temperature):g})")
    assert "the learner scores at the temperature written" in message


def test_the_same_rule_holds_for_evaluation(tmp_path):
    path = _write(tmp_path, "trainer:\n  eval_temperature: 0.001\n")
    assert _refused(path).startswith("trainer.eval_temperature must be 0 (greedy) or >= 0.01 (got 0.001)")
    # greedy evaluation samples once whatever eval_samples says (placement/rollout.py accuracy)
    run = load_config(_write(tmp_path, "trainer:\n  eval_temperature: 0\n  eval_samples: 4\n"))
    assert run.trainer.eval_temperature == 0.0


@pytest.mark.parametrize("text", ["n: 1\n    temperature: 0", "n: 4\n    temperature: 0.01", "n: 8\n    temperature: 0.7"])
def test_temperatures_the_engine_samples_as_written_load(tmp_path, text):
    run = load_config(_write(tmp_path, f"rollout:\n  sampling:\n    {text}\n"))
    assert run.rollout.sampling.temperature in (0.0, 0.01, 0.7)


# ---- StreamingLLM budget -------------------------------------------------------------------------------------

def test_streamingllm_budget_below_sinks_plus_window_is_refused(tmp_path):
    path = _write(tmp_path, "rollout:\n  kv:\n    policy: streamingllm\n    budget: 10\n    sinks: 4\n    window: 8\n")
    message = _refused(path)
    assert message.startswith("rollout.kv.budget must be >= sinks + window for streamingllm (got 10 < 4 + 8)")
    assert "the last budget - sinks = 6 tokens, fewer than the 8 most recent tokens rollout.kv.window promises" \
        in message


def test_streamingllm_keeps_the_whole_window_when_the_budget_holds_it():
    from megatron_sparse_rl.kv.policies import streamingllm_keep

    p = KVConfig(policy="streamingllm", budget=12, sinks=4, window=8)  # the least budget allowed
    keep = streamingllm_keep(1, 40, p)[0].tolist()
    assert keep == [0, 1, 2, 3] + list(range(32, 40))  # the sinks and every promised recent token
    # the other policies keep the window inside the budget already (budget >= window)
    assert KVConfig(policy="rkv", budget=8, window=8).budget == 8


# ---- pathologically nested files -----------------------------------------------------------------------------

DEEP_YAML = "rollout: " + "[" * 5000 + "]" * 5000 + "\n"


def test_nested_yaml_file_is_named_not_a_traceback(tmp_path):
    path = _write(tmp_path, DEEP_YAML)
    assert _refused(path) == f"{path}: nested too deeply to read (the YAML parser recurses once per level and ran " \
                             "out of stack); a run config is a mapping of sections a few levels deep"


def test_nested_override_is_named(tmp_path):
    path = _write(tmp_path, "")
    message = _refused(path, ["trainer.steps=" + "{a: " * 3000 + "1" + "}" * 3000])
    assert message.startswith("override trainer.steps=...: nested too deeply to read")


def test_validate_reports_nested_yaml_without_a_traceback(tmp_path):
    path = _write(tmp_path, DEEP_YAML)
    before = snapshot(tmp_path)
    done = subprocess.run([*MSRL, "validate", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert f"error: {path}: nested too deeply to read" in done.stderr
    assert snapshot(tmp_path) == before


def test_nested_model_config_json_is_named(tmp_path):
    from megatron_sparse_rl.formats.hf_io import _quantisation
    from megatron_sparse_rl.models import load_spec

    (tmp_path / "config.json").write_text('{"architectures": ' + "[" * 100_000 + "]" * 100_000 + "}")
    before = snapshot(tmp_path)
    for call in (lambda: load_spec(tmp_path), lambda: _quantisation(tmp_path)):
        with pytest.raises(ValueError, match=rf"{tmp_path / 'config.json'}: not (valid JSON|a readable config.json)"):
            call()
    assert snapshot(tmp_path) == before
