"""A DeepSeek-V3 config.json written by transformers' own `DeepseekV3Config`, which leaves out `topk_method` and
`scoring_func` (vLLM then reads softmax scores without a bias and dies on the checkpoint's bias tensors): validate
and the adapter read it as the released router, the engine is handed the same values (vLLM's hf_overrides), an
export writes them, and the user's file is never written. A router other than the released one is refused naming
config.json and the key. The engine serving such a model: tests/e2e/test_deepseek_config_defaults.py.

    .venv/bin/python -m pytest -q tests/unit/test_deepseek_config_defaults.py
"""
from __future__ import annotations

import json

import pytest

from megatron_sparse_rl.formats.hf_writer import export_config
from megatron_sparse_rl.models import engine_config_defaults, load_spec
from megatron_sparse_rl.models.tiny_families import deepseek_config_kwargs
from tests.snapshot import snapshot

RELEASE = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}  # DeepSeek-V3's released config.json


@pytest.fixture()
def transformers_dir(tmp_path):
    """A tiny config.json as transformers' DeepseekV3Config writes it (no router keys)."""
    from transformers import DeepseekV3Config

    kwargs = deepseek_config_kwargs()
    for key in RELEASE:
        kwargs.pop(key)
    DeepseekV3Config(**kwargs, architectures=["DeepseekV3ForCausalLM"]).save_pretrained(tmp_path)
    return tmp_path


def test_transformers_does_not_write_the_router_keys(transformers_dir):
    cfg = json.loads((transformers_dir / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and not set(RELEASE) & set(cfg)


def test_it_is_read_as_the_released_router_and_the_file_is_not_written(transformers_dir):
    cfg = json.loads((transformers_dir / "config.json").read_text())
    before = snapshot(transformers_dir)
    adapter, spec = load_spec(transformers_dir)
    assert spec == adapter.spec_from_hf({**cfg, **RELEASE})  # the same model as with the release keys
    moe = adapter.moe_kwargs(spec)  # Megatron's router: sigmoid scores, top-k with the correction bias
    assert moe["moe_router_score_function"] == "sigmoid" and moe["moe_router_enable_expert_bias"]
    assert engine_config_defaults(transformers_dir) == RELEASE  # what vLLM is started with
    assert adapter.config_defaults({**cfg, **RELEASE}) == {}  # a release config needs nothing
    assert snapshot(transformers_dir) == before


def test_validate_accepts_it(transformers_dir):
    from megatron_sparse_rl.config import RunConfig
    from megatron_sparse_rl.validation import validate
    from megatron_sparse_rl.config.loader import from_dict

    before = snapshot(transformers_dir)
    run = from_dict(RunConfig, {"model": {"path": str(transformers_dir)}})
    assert validate(run, 1, cuda=False).architecture == "DeepseekV3ForCausalLM"
    assert snapshot(transformers_dir) == before


def test_an_export_writes_the_router_keys(transformers_dir):
    cfg = json.loads((transformers_dir / "config.json").read_text())
    out, changes = export_config(cfg)
    assert {k: out[k] for k in RELEASE} == RELEASE
    assert any("topk_method: 'noaux_tc', scoring_func: 'sigmoid' added" in c for c in changes)
    assert export_config({**cfg, **RELEASE})[1] == []  # nothing to change on a release config


@pytest.mark.parametrize("key, value", [("scoring_func", "softmax"), ("topk_method", "greedy")])
def test_another_router_is_refused_naming_config_json_and_the_key(transformers_dir, key, value):
    from megatron_sparse_rl.config import ConfigError, RunConfig
    from megatron_sparse_rl.validation import validate
    from megatron_sparse_rl.config.loader import from_dict

    path = transformers_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), key: value}))
    before = snapshot(transformers_dir)
    with pytest.raises(NotImplementedError) as err:
        load_spec(transformers_dir)
    assert str(err.value).startswith(f"config.json: {key} {value!r} is not supported")
    assert f"set it to {RELEASE[key]!r}" in str(err.value)
    with pytest.raises(ConfigError, match=f"config.json: {key} {value!r} is not supported"):
        validate(from_dict(RunConfig, {"model": {"path": str(transformers_dir)}}), 1, cuda=False)
    assert snapshot(transformers_dir) == before
