"""routing.indexer_replay (DSA indexer replay, learner/indexer_replay.py): the choices, and what validate refuses.

    .venv/bin/python -m pytest -q tests/unit/test_indexer_replay_config.py
"""
from __future__ import annotations

import pytest

from megatron_sparse_rl.config import ConfigError
from megatron_sparse_rl.validation import validate
from megatron_sparse_rl.config.routing import RoutingConfig
from tests.unit.test_config_validate import asset_model, run_of


def test_choices():
    assert RoutingConfig().indexer_replay == "none"
    assert RoutingConfig(indexer_replay="R2").indexer_replay == "R2"
    assert RoutingConfig(indexer_replay="R3").indexer_replay == "R3"
    with pytest.raises(ValueError, match=r"routing\.indexer_replay must be one of \('none', 'R2', 'R3'\) "
                                         r"\(got 'r2'\)"):
        RoutingConfig(indexer_replay="r2")


def test_r3_accepted_on_a_dsa_model_with_cuda(tmp_path):
    path = asset_model(tmp_path, "deepseek-v3.2")
    spec = validate(run_of(f"model.path={path}", "routing.indexer_replay=R3"), 1, cuda=True)
    assert spec.architecture == "DeepseekV32ForCausalLM"


def test_r3_refusals(tmp_path):
    path = asset_model(tmp_path, "deepseek-v3.2")
    with pytest.raises(ConfigError, match=r"routing\.indexer_replay = 'R3' replays the indices the rollout engine's "
                                          r"indexers chose, which only the GPU engine records"):
        validate(run_of(f"model.path={path}", "routing.indexer_replay=R3"), 1, cuda=False)
    with pytest.raises(ConfigError, match=r"^algorithm\.old_logprobs = 'engine' skips the learner's old-policy "
                                          r"forward, which is where routing\.indexer_replay = 'R3' replays"):
        validate(run_of(f"model.path={path}", "routing.indexer_replay=R3", "algorithm.old_logprobs=engine"), 1,
                 cuda=True)
    with pytest.raises(ConfigError, match=r"^routing\.indexer_replay = 'R3' captures the engine's indices with forward "
                                          r"hooks, which a CUDA graph does not replay: set rollout\.enforce_eager"):
        validate(run_of(f"model.path={path}", "routing.indexer_replay=R3", "rollout.enforce_eager=false"), 1,
                 cuda=True)
    with pytest.raises(ConfigError, match=r"^routing\.indexer_replay = 'R3' needs every position run by the engine"):
        validate(run_of(f"model.path={path}", "routing.indexer_replay=R3", "rollout.prefix_caching=true"), 1,
                 cuda=True)
    with pytest.raises(ConfigError, match=r"^routing\.indexer_replay = 'R3' replays a DeepSeek Sparse Attention "
                                          r"indexer's top-k, but Qwen3MoeForCausalLM has no indexer"):
        validate(run_of("routing.indexer_replay=R3"), 1, cuda=True)


def test_model_without_indexer_refused():
    with pytest.raises(ConfigError, match=r"^routing\.indexer_replay = 'R2' replays a DeepSeek Sparse Attention "
                                          r"indexer's top-k, but Qwen3MoeForCausalLM has no indexer"):
        validate(run_of("routing.indexer_replay=R2"), 1, cuda=False)


def test_dsa_model_needs_the_learner_old_forward(tmp_path):
    path = asset_model(tmp_path, "deepseek-v3.2")
    spec = validate(run_of(f"model.path={path}", "routing.indexer_replay=R2"), 1, cuda=True)
    assert spec.architecture == "DeepseekV32ForCausalLM"
    with pytest.raises(ConfigError, match=r"^algorithm\.old_logprobs = 'engine_mean' skips the learner's old-policy "
                                          r"forward, which is where routing\.indexer_replay = 'R2' records"):
        validate(run_of(f"model.path={path}", "routing.indexer_replay=R2", "algorithm.old_logprobs=engine_mean"), 1,
                 cuda=True)
