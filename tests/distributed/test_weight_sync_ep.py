"""Weight sync from an expert-parallel learner: EP2 (2 gloo ranks, each holding half the experts, one engine
per rank) after a train step syncs into an engine equal to one synced from a TP1 learner after the same
step; both ranks receive the whole, identical HF-named stream.
Run: .venv/bin/python -m pytest -q tests/distributed/test_weight_sync_ep.py
"""
import pytest
import torch

from tests.spawn import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.e2e]

TOL = 1e-4
PROBE = [[1, 5, 6, 14, 11, 18, 22, 20, 27, 21, 19, 5, 13], [1, 43, 21, 19, 9, 7, 15, 4, 4, 18, 22, 30, 31]]


def ep_sync_worker(rank, world_size, model_dir, ep):
    from megatron_sparse_rl.config.rollout import RolloutConfig
    from megatron_sparse_rl.learner.sft import make_sft_loss
    from megatron_sparse_rl.rollout import RolloutEngine
    from megatron_sparse_rl.weight_sync import iter_hf_tensors, sync_to_engine, verify_logprobs
    from tests.learner_workers import make_learner

    # lr=1, eps=1: Adam's first step is smooth in the gradient, so layouts agree to ulps (see learner_workers)
    learner = make_learner(world_size, model_dir, ep=ep, lr=1.0, eps=1.0, clip=0.0)
    tokens = torch.tensor(PROBE)
    mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
    rows = torch.arange(tokens.shape[0]).chunk(learner.layout.dp)[learner.groups.dp_rank]
    learner.train_step(tokens[rows], make_sft_loss(mask[rows], mask.sum().item()))
    streamed = {name: t.clone() for name, t in iter_hf_tensors(learner)}
    # one engine per rank: vLLM builds its groups with new_group, a collective over the whole world
    engine = RolloutEngine(model_dir, RolloutConfig(max_model_len=256, max_num_seqs=4, kv_cache_gb=1))
    stats = sync_to_engine(learner, engine, bucket_mb=0.1)
    diff = verify_logprobs(learner, engine, PROBE, tol=TOL)
    out = {"streamed": streamed, "stats": stats, "diff": diff, "engine": torch.stack(engine.prompt_logprobs(PROBE))}
    engine.shutdown()
    return out


def test_ep2_sync_equals_tp1_sync(tmp_path):
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    model_dir = str(build_tiny_hf_model(tmp_path / "moe", seed=3))
    ref = run_distributed(ep_sync_worker, 1, args=(model_dir, 1), timeout=240)[0]
    r0, r1 = run_distributed(ep_sync_worker, 2, args=(model_dir, 2), timeout=240)
    print(f"EP2 |engine - learner| = {r0['diff']:.2e}; |engine EP2 - engine TP1| = "
          f"{(r0['engine'] - ref['engine']).abs().max():.2e}; {r0['stats']}")
    assert r0["diff"] < TOL and r1["diff"] < TOL
    assert (r0["engine"] - ref["engine"]).abs().max() < 1e-5
    assert (r1["engine"] - ref["engine"]).abs().max() < 1e-5
    assert list(r0["streamed"]) == list(r1["streamed"]) == list(ref["streamed"]), "same names, same order"
    assert any(".mlp.experts.3." in n for n in r0["streamed"]), "rank 0 must receive rank 1's experts"
    for name, value in ref["streamed"].items():
        assert torch.equal(r0["streamed"][name], r1["streamed"][name]), name
        assert torch.allclose(r0["streamed"][name], value, atol=1e-5), name
    assert r0["stats"].tensors == r1["stats"].tensors == ref["stats"].tensors
    assert r0["stats"].bytes == ref["stats"].bytes
