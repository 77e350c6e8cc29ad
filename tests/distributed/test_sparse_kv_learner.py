"""The learner recomputes pi_sparse exactly from the engine's kv_keep record.

Real vLLM (CPU, tiny Qwen3-MoE, fp32) generates with an R-KV / SnapKV compressed cache and records what
every layer and KV head kept; the Megatron learner (TP1, and TP2 with sequence parallel: each rank holds one
of the two KV heads) scores the same tokens with that record as a per-layer, per-head attention mask. The
reference is the engine's own sampled-token logprobs: the masked learner must match them within the
dense engine-vs-learner numerics, while the dense (causal) learner must not, after the first compaction.
A tiny DeepSeek-V3 (multi-head latent attention) does the same with its one-set-per-layer record (TP1 and TP2).
Run: .venv/bin/python -m pytest -q tests/distributed/test_sparse_kv_learner.py
"""
from __future__ import annotations

import pytest
import torch

from megatron_sparse_rl.config.rollout import KVConfig
from megatron_sparse_rl.kv.record import KVKeepRecord, batch_attention_mask
from megatron_sparse_rl.learner.extras import ForwardExtras
from tests.e2e.test_sparse_kv import PROMPTS, engine, row_tokens, sampling
from tests.learner_workers import make_learner
from tests.spawn import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.e2e]

ATOL = 1e-4  # fp32 engine vs Megatron learner on the same visible keys (dense prompt logprobs: ~2.4e-6)


def masked_logprobs_worker(rank, world_size, model_dir, tokens, allowed, tp):
    learner = make_learner(world_size, model_dir, tp=tp)
    masked = learner.forward_logprobs(tokens, extras=ForwardExtras(attention_mask=allowed))["logprobs"]
    dense = learner.forward_logprobs(tokens)["logprobs"]  # the hooks are a no-op without a mask
    return masked, dense


def assert_masked_equals_engine(batch, masked, dense, label: str) -> None:
    """The masked learner's logprobs of every sampled token equal the engine's sparse ones; the dense learner's
    differ once a query saw the compressed cache."""
    worst_masked = worst_dense = 0.0
    for i, rec in enumerate(batch.features.kv_keep):
        p, n = int(batch.prompt_lens[i]), int(batch.response_lens[i])
        engine_lp = batch.rollout_logprobs[i, :n]
        after = torch.arange(n) + p - 1 >= rec.lengths[0]  # columns whose query saw the compressed cache
        worst_masked = max(worst_masked, (masked[i, p - 1:p - 1 + n] - engine_lp).abs().max().item())
        worst_dense = max(worst_dense, (dense[i, p - 1:p - 1 + n] - engine_lp)[after].abs().max().item())
    print(f"{label}: max |learner masked - engine sparse| = {worst_masked:.2e}; "
          f"dense learner after compaction: {worst_dense:.2e}")
    assert worst_masked <= ATOL
    assert worst_dense > 100 * ATOL, "compression should change the logprobs the dense learner sees"


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    model_dir = build_tiny_hf_model(tmp_path_factory.mktemp("sparse_kv_learner") / "moe", seed=0)
    kv = KVConfig(policy="rkv", budget=40, interval=24, window=8, block_size=32, record_keep=True)
    with engine(model_dir, kv) as e:
        batch = e.generate(PROMPTS[:3], sampling(96, seed=5))
    rows = [row_tokens(batch, i) for i in range(len(batch))]
    width = max(map(len, rows))
    tokens = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    # one row the engine never compacted: it must be scored causally beside the compacted ones
    records = list(batch.features.kv_keep) + [KVKeepRecord(lengths=())]
    tokens = torch.cat([tokens, tokens[:1]])
    return model_dir, batch, tokens, records


@pytest.mark.parametrize("tp", [1, 2])
def test_masked_recompute_matches_engine_sparse_logprobs(rollout, tp):
    model_dir, batch, tokens, records = rollout
    assert all(r.num_compactions >= 2 for r in batch.features.kv_keep), [r.lengths for r in batch.features.kv_keep]
    allowed = batch_attention_mask(records, tokens.shape[1] - 1)
    masked, dense = run_distributed(masked_logprobs_worker, tp, (model_dir, tokens, allowed, tp), timeout=240)[0]
    assert_masked_equals_engine(batch, masked, dense, f"tp={tp}")
    # the uncompacted copy of row 0 is the dense forward of row 0
    assert torch.allclose(masked[-1], dense[0], atol=1e-6)


def test_mask_of_wrong_shape_is_refused(tmp_path):
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    model_dir = build_tiny_hf_model(tmp_path / "moe", seed=0)
    tokens = torch.randint(1, 30, (2, 9))
    bad = torch.ones(2, 2, 2, 9, 9, dtype=torch.bool)  # seq must be 8 (tokens 9 -> 8 scored positions)
    with pytest.raises(Exception, match=r"attention_mask must be bool \[batch, layers, kv_heads, seq-1, seq-1\]"):
        run_distributed(masked_logprobs_worker, 1, (model_dir, tokens, bad, 1), timeout=120)


# ---- multi-head latent attention (tiny DeepSeek-V3): one keep set per layer for every head ------------------------
@pytest.fixture(scope="module")
def mla_rollout(tmp_path_factory):
    from megatron_sparse_rl.models.tiny_families import build_tiny_deepseek
    from tests.e2e.test_sparse_kv_mla import PROMPTS as MLA_PROMPTS
    from tests.e2e.test_sparse_kv_mla import engine as mla_engine

    model_dir = build_tiny_deepseek(tmp_path_factory.mktemp("sparse_kv_learner_mla") / "yarn", seed=0, rope="yarn")
    kv = KVConfig(policy="rkv", budget=24, interval=8, window=6, record_keep=True)
    with mla_engine(model_dir, kv) as e:
        batch = e.generate(MLA_PROMPTS, sampling(40, seed=5))
    rows = [row_tokens(batch, i) for i in range(len(batch))]
    width = max(map(len, rows))
    tokens = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    return model_dir, batch, tokens


@pytest.mark.parametrize("tp", [1, 2])
def test_mla_masked_recompute_matches_engine_sparse_logprobs(mla_rollout, tp):
    """The record is [layers, 1, kept] (one latent row set per layer); the learner applies it to every head of
    Megatron's MLA core attention, on each TP rank's heads."""
    model_dir, batch, tokens = mla_rollout
    assert all(r.num_compactions >= 2 and r.kept[0].shape[1] == 1 for r in batch.features.kv_keep)
    allowed = batch_attention_mask(batch.features.kv_keep, tokens.shape[1] - 1)
    masked, dense = run_distributed(masked_logprobs_worker, tp, (model_dir, tokens, allowed, tp), timeout=240)[0]
    assert_masked_equals_engine(batch, masked, dense, f"MLA tp={tp}")
