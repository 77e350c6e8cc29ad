"""Colocated weight sync, real Megatron learner -> real vLLM engine (CPU, fp32, tiny Qwen3-MoE and Qwen3).

One process per architecture: the learner takes an SFT step (its weights change), `sync_to_engine` moves
them in several checksummed buckets, and the engine's prompt logprobs of a fixed probe then equal the
learner's forward (an independent implementation) and differ from before the sync. A bucket corrupted
after its checksum was taken is refused, naming the bucket and its tensors; a clean sync afterwards
recovers the engine.
Run: .venv/bin/python -m pytest -q tests/e2e/test_weight_sync.py
"""
import pytest
import torch

from tests.spawn import run_distributed

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

# fp32 learner vs engine after sync, measured ~1e-6 (MoE and dense); the tolerance leaves margin for other ISAs.
TOL = 1e-4
PROBE = [[1, 5, 6, 14, 11, 18, 22, 20, 27, 21, 19, 5, 13], [1, 43, 21, 19, 9, 7, 15, 4, 4, 18, 22, 30, 31]]


def _flip_one_value(flipped: list):
    """A corrupt hook adding 1 to the first value of bucket 1's first tensor; appends that tensor's name."""
    def corrupt(bucket):
        if bucket.index == 1:
            name, tensor = bucket.tensors()[0]
            tensor.view(-1)[0] += 1.0  # after the checksum was computed
            flipped.append(name)
    return corrupt


def sync_worker(rank, world_size, model_dir):
    from megatron_sparse_rl.config.rollout import RolloutConfig
    from megatron_sparse_rl.learner.sft import make_sft_loss
    from megatron_sparse_rl.patches import vllm_cpu
    from megatron_sparse_rl.rollout import RolloutEngine
    from megatron_sparse_rl.weight_sync import WeightSyncError, sync_to_engine, verify_logprobs
    from tests.learner_workers import make_learner

    learner = make_learner(world_size, model_dir, lr=1e-2)
    vllm_cpu.apply()
    engine = RolloutEngine(model_dir, RolloutConfig(max_model_len=256, max_num_seqs=4, kv_cache_gb=1))
    out = {"diff_loaded": verify_logprobs(learner, engine, PROBE, tol=TOL)}
    before = torch.stack(engine.prompt_logprobs(PROBE))
    tokens = torch.tensor(PROBE)
    mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
    for _ in range(2):
        learner.train_step(tokens, make_sft_loss(mask, mask.sum().item()))
    stale = learner.forward_logprobs(tokens)["logprobs"]
    stats = sync_to_engine(learner, engine, bucket_mb=0.1)
    after = torch.stack(engine.prompt_logprobs(PROBE))
    out.update(stats=stats, before=before, after=after, learner=stale,
               diff_synced=verify_logprobs(learner, engine, PROBE, tol=TOL))
    try:
        sync_to_engine(learner, engine, bucket_mb=0.1, _corrupt=_flip_one_value(flipped := []))
        out["corruption_error"] = None
    except WeightSyncError as e:
        out["corruption_error"] = str(e)
    out["flipped"] = flipped
    sync_to_engine(learner, engine, bucket_mb=0.1)
    out["diff_recovered"] = verify_logprobs(learner, engine, PROBE, tol=TOL)
    engine.shutdown()
    return out


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3"])
def test_sync_after_train_step(tmp_path, arch):
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    model_dir = str(build_tiny_hf_model(tmp_path / arch, arch=arch, seed=0))
    out = run_distributed(sync_worker, 1, args=(model_dir,), timeout=240)[0]
    print(f"{arch}: |engine - learner| loaded {out['diff_loaded']:.2e}, synced {out['diff_synced']:.2e}; "
          f"{out['stats']}")
    assert out["diff_loaded"] < TOL
    assert (out["after"] - out["before"]).abs().max() > 1e-2, "the train step must change the engine's logprobs"
    assert (out["after"] - out["learner"]).abs().max() < TOL
    assert out["diff_synced"] < TOL and out["diff_recovered"] < TOL
    stats = out["stats"]
    assert stats.buckets > 2 and stats.tensors > 10 and stats.bytes > 0
    err = out["corruption_error"]
    assert err is not None, "a corrupted bucket must be refused"
    assert "bucket 1" in err and "checksum mismatch" in err and "model." in err
    assert out["flipped"] and f"tensors ['{out['flipped'][0]}']" in err, "the error names the corrupted tensor"
