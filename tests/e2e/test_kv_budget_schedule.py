"""A budget changed between generate calls (rollout.kv.budget_schedule) reaches a real sparse-KV vLLM engine's keep
sets: one StreamingLLM engine (tiny Qwen3-MoE, CPU) generates at its configured budget, is set to a smaller and then
a larger one (`set_sparse_kv_budget`), and each generate's compactions and keep sets are those the trigger rule and
the StreamingLLM rule give at that budget (recomputed here: tests/e2e/test_sparse_kv.py `rule_compactions`). A dense
engine refuses a budget.

    .venv/bin/python -m pytest -q tests/e2e/test_kv_budget_schedule.py      (about 30 s)
"""
from __future__ import annotations

import pytest

from megatron_sparse_rl.config.rollout import KVConfig
from megatron_sparse_rl.kv.engine_extension import set_sparse_kv_budget, sparse_kv_stats
from megatron_sparse_rl.models.tiny import build_tiny_hf_model
from tests.e2e import test_sparse_kv as base

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_hf_model(tmp_path_factory.mktemp("kv_budget") / "moe", seed=0)


def _check_rule(batch, budget: int, interval: int, sinks: int) -> None:
    for i, rec in enumerate(batch.features.kv_keep):
        p, r = int(batch.prompt_lens[i]), int(batch.response_lens[i])
        assert list(rec.lengths) == base.rule_compactions(p, r, budget, interval), (budget, i)
        assert rec.num_compactions >= 2 and not rec.preempted
        for tc, kept in zip(rec.lengths, rec.kept):
            assert kept.shape[2] == budget
            want = list(range(sinks)) + list(range(tc - (budget - sinks), tc))
            assert all(row == want for row in kept.reshape(-1, budget).tolist())


def test_a_changed_budget_reaches_the_keep_sets(model_dir):
    kv = KVConfig(policy="streamingllm", budget=48, interval=24, sinks=4, block_size=32, record_keep=True)
    with base.engine(model_dir, kv) as e:
        for budget in (48, 32, 64):
            if budget != kv.budget:
                set_sparse_kv_budget(e, budget)
            before = sparse_kv_stats(e)["compactions"]
            batch = e.generate(base.PROMPTS[:2], base.sampling(120, seed=5))
            assert (batch.response_lens == 120).all()
            _check_rule(batch, budget, kv.interval, kv.sinks)
            assert sparse_kv_stats(e)["compactions"] - before == sum(r.num_compactions for r in batch.features.kv_keep)
        with pytest.raises(ValueError, match="rollout.kv.budget must be >= sinks \\+ window"):
            set_sparse_kv_budget(e, 8)  # KVConfig's own rules hold for a budget set later


def test_a_dense_engine_refuses_a_budget(model_dir):
    with base.engine(model_dir, KVConfig()) as e:
        with pytest.raises(ValueError, match="dense KV cache"):
            set_sparse_kv_budget(e, 32)
