"""model.dsa_indexer_loss_coeff (the DSA indexer's KL loss, learner/dsa_indexer_loss.py): default off, bad values and
models without an indexer refused naming the field, and the TransformerConfig keywords it turns into.
The loss itself is tested against a float64 reference in tests/distributed/test_dsa_indexer_loss.py.

    .venv/bin/python -m pytest -q tests/unit/test_dsa_indexer_loss_config.py
"""
from __future__ import annotations

import pytest

from megatron_sparse_rl.config import ConfigError
from megatron_sparse_rl.validation import validate
from megatron_sparse_rl.config.schema import ModelConfig
from megatron_sparse_rl.learner.dsa_indexer_loss import indexer_loss_config
from megatron_sparse_rl.models import load_spec
from tests.unit.test_config_validate import asset_model, run_of


def test_default_off_and_negative_refused():
    assert ModelConfig().dsa_indexer_loss_coeff == 0.0
    assert run_of("model.dsa_indexer_loss_coeff=0.25").model.dsa_indexer_loss_coeff == 0.25
    for bad in (-0.1, float("nan")):
        with pytest.raises(ValueError, match=r"model\.dsa_indexer_loss_coeff must be >= 0 \(got "):
            ModelConfig(dsa_indexer_loss_coeff=bad)


def test_model_without_indexer_refused_by_validate():
    with pytest.raises(ConfigError, match=r"^model\.dsa_indexer_loss_coeff = 0\.1 trains a DeepSeek Sparse Attention "
                                          r"indexer, but Qwen3MoeForCausalLM has none .*; set it to 0$"):
        validate(run_of("model.dsa_indexer_loss_coeff=0.1"), 1, cuda=False)
    assert validate(run_of("model.dsa_indexer_loss_coeff=0"), 1, cuda=False).architecture == "Qwen3MoeForCausalLM"


def test_dsa_model_accepted(tmp_path):
    path = asset_model(tmp_path, "deepseek-v3.2")
    spec = validate(run_of(f"model.path={path}", "model.dsa_indexer_loss_coeff=0.1"), 1, cuda=True)
    assert spec.architecture == "DeepseekV32ForCausalLM"


def test_transformer_config_keywords(tmp_path):
    (tmp_path / "dsa").mkdir()
    (tmp_path / "qwen").mkdir()
    _, dsa = load_spec(asset_model(tmp_path / "dsa", "deepseek-v3.2"))
    _, qwen = load_spec(asset_model(tmp_path / "qwen", "qwen3-30b-a3b"))
    assert indexer_loss_config(dsa, 0.5) == {"dsa_indexer_loss_coeff": 0.5}
    assert indexer_loss_config(dsa, 0.0) == {} and indexer_loss_config(qwen, 0.0) == {}
    with pytest.raises(ValueError, match=r"model\.dsa_indexer_loss_coeff = 0\.5 trains .* but Qwen3MoeForCausalLM "
                                         r"has none"):
        indexer_loss_config(qwen, 0.5)
    for bad in (-1.0, True, "0.1"):
        with pytest.raises(ValueError, match=r"model\.dsa_indexer_loss_coeff must be a number >= 0"):
            indexer_loss_config(dsa, bad)
