"""Sparsity-aware SFT (trainer.sft.kv_keep) with the real Megatron learner against independent references.

Real vLLM (CPU, tiny Qwen3-MoE, fp32) generates with an R-KV cache and records what it kept; the learner's simulation
(training/sft_kv.py) is then run on the engine's own tokens, as if they were SFT rows:
- keys "sequential" (forward c under the masks of compactions 0..c-1) must give the engine's keep sets exactly, at
  the engine's compaction points;
- keys "dense" (one causal forward) must give what a transformers forward's keys and queries, captured here in its
  attention function, give under `select_keep` at the compaction points of the rule written out in
  tests/e2e/test_sparse_kv.py;
- the SFT loss trained under the sequential records equals the mean NLL a transformers forward computes with the
  same per-layer, per-KV-head masks (built here from the records), and differs from the dense one.
Run: .venv/bin/python -m pytest -q tests/distributed/test_sft_kv_keep.py
"""
from __future__ import annotations

import pytest
import torch

from megatron_sparse_rl.config.rollout import KVConfig
from megatron_sparse_rl.config.trainer import SFTKVKeepConfig
from tests.e2e.test_sparse_kv import PROMPTS, engine, hf_masked_logprobs, mask_from_keeps, row_tokens, rule_compactions
from tests.e2e.test_sparse_kv import sampling
from tests.learner_workers import make_learner
from tests.spawn import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.e2e]

KV = KVConfig(policy="rkv", budget=24, interval=8, window=8, block_size=32, record_keep=True)


def sft_worker(rank, world_size, model_dir, tokens, prompt_lens, lengths, loss_mask):
    from megatron_sparse_rl.learner.sft import make_sft_loss
    from megatron_sparse_rl.training.sft_kv import sft_keep_records, sft_kv_extras

    learner = make_learner(world_size, model_dir, mbs=2)
    dense = sft_keep_records(learner, tokens, prompt_lens, lengths, KV, "dense")
    sequential = sft_keep_records(learner, tokens, prompt_lens, lengths, KV, "sequential")
    cfg = SFTKVKeepConfig(enabled=True, keys="sequential")
    extras, counts = sft_kv_extras(learner, tokens, loss_mask, prompt_lens, lengths, KV, cfg)
    out = learner.train_step(tokens, make_sft_loss(loss_mask, float(loss_mask.sum())), lengths=lengths, lr=1e-9,
                             extras=extras)
    return dense, sequential, out["loss"], counts


@pytest.fixture(scope="module")
def simulated(tmp_path_factory):
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    model_dir = build_tiny_hf_model(tmp_path_factory.mktemp("sft_kv_keep") / "moe", seed=0)
    with engine(model_dir, KV) as e:
        batch = e.generate(PROMPTS[:3], sampling(64, seed=5))
    rows = [row_tokens(batch, i) for i in range(len(batch))]
    width = max(map(len, rows))
    tokens = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    prompt_lens = [int(p) for p in batch.prompt_lens]
    lengths = [len(r) for r in rows]
    loss_mask = torch.zeros(len(rows), width - 1)
    for i, (p, n) in enumerate(zip(prompt_lens, lengths)):
        loss_mask[i, p - 1:n - 1] = 1.0  # column t scores token t + 1: the response tokens
    out = run_distributed(sft_worker, 1, (model_dir, tokens, prompt_lens, lengths, loss_mask), timeout=300)[0]
    return model_dir, batch, rows, loss_mask, out


def test_sequential_keep_sets_equal_the_engines(simulated):
    _, batch, rows, _, (_, sequential, _, _) = simulated
    for i, (engine_rec, rec) in enumerate(zip(batch.features.kv_keep, sequential)):
        assert engine_rec.num_compactions >= 3, engine_rec.lengths
        assert rec.lengths == engine_rec.lengths, i
        for c, (want, got) in enumerate(zip(engine_rec.kept, rec.kept)):
            assert torch.equal(got.long(), want.long()), (i, c)


def test_dense_keep_sets_equal_a_transformers_reference(simulated):
    from megatron_sparse_rl.kv.policies import select_keep

    model_dir, batch, rows, _, (dense, sequential, _, _) = simulated
    differs = 0
    for i, (tokens, rec) in enumerate(zip(rows, dense)):
        p = int(batch.prompt_lens[i])
        qk: dict = {}
        total, layers = len(tokens), len(rec.kept[0])
        heads = rec.kept[0].shape[1]
        hf_masked_logprobs(model_dir, tokens, mask_from_keeps(total, layers, heads, []), qk=qk)
        points = rule_compactions(p, total - p, KV.budget, KV.interval)
        assert list(rec.lengths) == points
        prev = None
        for c, tc in enumerate(points):
            for li, (q, k) in qk.items():
                held = [sorted(set(range(tc)) if prev is None else set(prev[li][h]) | set(range(points[c - 1], tc)))
                        for h in range(heads)]
                keep = select_keep(KV.policy, torch.stack([k[h, held[h]] for h in range(heads)]),
                                   q[:, tc - KV.window:tc], KV)
                want = [[held[h][j] for j in keep[h].tolist()] for h in range(heads)]
                assert rec.kept[c][li].tolist() == want, (i, c, li)
            prev = [[rec.kept[c][li][h].tolist() for h in range(heads)] for li in range(layers)]
        differs += sum(not torch.equal(a, b) for a, b in zip(rec.kept, sequential[i].kept))
    print(f"dense-key keep sets that differ from the sequential ones: {differs} of "
          f"{sum(r.num_compactions for r in dense)} compactions")


def test_masked_sft_loss_equals_transformers_under_the_same_masks(simulated):
    model_dir, batch, rows, loss_mask, (_, sequential, loss, counts) = simulated
    nll = dense_nll = 0.0
    compressed = 0
    for i, (tokens, rec) in enumerate(zip(rows, sequential)):
        total, layers, heads = len(tokens), rec.kept[0].shape[0], rec.kept[0].shape[1]
        events = [(tc, [[kept[li][h].tolist() for h in range(heads)] for li in range(layers)])
                  for tc, kept in zip(rec.lengths, rec.kept)]
        cols = loss_mask[i, :total - 1].bool()
        nll -= float(hf_masked_logprobs(model_dir, tokens, mask_from_keeps(total, layers, heads, events))[cols].sum())
        dense_nll -= float(hf_masked_logprobs(model_dir, tokens, mask_from_keeps(total, layers, heads, []))[cols].sum())
        compressed += int((cols & (torch.arange(total - 1) >= rec.lengths[0])).sum())
    n = float(loss_mask.sum())
    print(f"SFT loss under the keep sets: learner {loss:.6f}, transformers {nll / n:.6f}; dense {dense_nll / n:.6f}")
    assert abs(loss - nll / n) <= 1e-5 * max(1.0, abs(nll / n))
    assert abs(dense_nll / n - nll / n) > 1e-3, "the keep sets should change the loss"
    assert counts == [float(compressed), 3.0, float(sum(r.num_compactions for r in sequential))]
