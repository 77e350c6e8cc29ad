"""Disaggregated weight sync on 2 gloo ranks: rank 0 is the Megatron learner, rank 1 owns the vLLM engine.

After SFT steps on the learner, `send_weights` (rank 0) -> `receive_weights` (rank 1) over the world group
makes the engine's prompt logprobs of a fixed probe equal the learner's forward (sent to rank 1 for the
comparison) and differ from before the sync. A bucket corrupted in transit (after the sender's digests) is
refused naming the bucket; a clean sync afterwards recovers the engine.

One world, two libraries that each build their groups over the whole world: vLLM's start-up runs collectives
on its world group (new_group, is_in_the_same_node), so the learner rank joins them by running the same
vLLM group set-up without a model (`_join_vllm_groups`); Megatron's groups are built over the learner
rank only (`_single_learner_world`: learner ranks are [0, L), so global rank == learner rank).
Run: .venv/bin/python -m pytest -q tests/distributed/test_weight_sync_disagg.py
"""
import contextlib

import pytest
import torch

from tests.spawn import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.e2e]

TOL = 1e-4
PROBE = [[1, 5, 6, 14, 11, 18, 22, 20, 27, 21, 19, 5, 13], [1, 43, 21, 19, 9, 7, 15, 4, 4, 18, 22, 30, 31]]
LEARNER, ROLLOUT = 0, 1


def _join_vllm_groups():
    """On a rank without an engine: the collective part of a vLLM TP=1 engine's start-up (world + TP/PP
    groups of 1), so that the engine's ranks do not wait on this one."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as vps

    with set_current_vllm_config(VllmConfig()):
        vps.init_distributed_environment(1, 0, "env://", 0, "gloo")
        vps.ensure_model_parallel_initialized(1, 1)


@contextlib.contextmanager
def _single_learner_world():
    """Megatron sizes its groups from the default world and all-gathers its optimizer param-group keys over
    it: while the learner (one rank here) is built, show it a world of that rank alone."""
    dist = torch.distributed
    get_world_size, all_gather_object = dist.get_world_size, dist.all_gather_object

    def gather_self(out, obj, group=None):
        if group is not None:
            return all_gather_object(out, obj, group=group)
        out[0] = obj

    dist.get_world_size = lambda group=None: 1 if group is None else get_world_size(group)
    dist.all_gather_object = gather_self
    try:
        yield
    finally:
        dist.get_world_size, dist.all_gather_object = get_world_size, all_gather_object


def _flip_one_value(bucket):
    if bucket.index == 1:
        name, tensor = bucket.tensors()[0]
        tensor.view(-1)[0] += 1.0


def learner_rank(model_dir):
    from megatron_sparse_rl.learner.sft import make_sft_loss
    from megatron_sparse_rl.weight_sync.disaggregated import send_weights
    from tests.learner_workers import make_learner

    _join_vllm_groups()
    with _single_learner_world():
        learner = make_learner(1, model_dir, lr=1e-2)
    tokens = torch.tensor(PROBE)
    mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
    for _ in range(2):
        learner.train_step(tokens, make_sft_loss(mask, mask.sum().item()))
    torch.distributed.broadcast_object_list([learner.forward_logprobs(tokens)["logprobs"]], src=LEARNER)
    stats = [send_weights(learner, src=LEARNER, bucket_mb=0.1) for _ in range(3)]  # clean, corrupted, clean
    return {"stats": stats}


def rollout_rank(model_dir):
    from megatron_sparse_rl.config.rollout import RolloutConfig
    from megatron_sparse_rl.rollout import RolloutEngine
    from megatron_sparse_rl.weight_sync import WeightSyncError
    from megatron_sparse_rl.weight_sync.disaggregated import receive_weights

    engine = RolloutEngine(model_dir, RolloutConfig(max_model_len=256, max_num_seqs=4, kv_cache_gb=1))
    before = torch.stack(engine.prompt_logprobs(PROBE))
    learner = [None]
    torch.distributed.broadcast_object_list(learner, src=LEARNER)
    out = {"before": before, "learner": learner[0], "stats": receive_weights(engine, src=LEARNER)}
    out["after"] = torch.stack(engine.prompt_logprobs(PROBE))
    try:
        receive_weights(engine, src=LEARNER, _corrupt=_flip_one_value)
        out["corruption_error"] = None
    except WeightSyncError as e:
        out["corruption_error"] = str(e)
    receive_weights(engine, src=LEARNER)
    out["recovered"] = torch.stack(engine.prompt_logprobs(PROBE))
    engine.shutdown()
    return out


def disagg_worker(rank, world_size, model_dir):
    return learner_rank(model_dir) if rank == LEARNER else rollout_rank(model_dir)


@pytest.mark.parametrize("arch", ["qwen3_moe"])
def test_disaggregated_sync_after_train_step(tmp_path, arch):
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    model_dir = str(build_tiny_hf_model(tmp_path / arch, arch=arch, seed=0))
    sent, got = run_distributed(disagg_worker, 2, args=(model_dir,), timeout=240)
    diff = (got["after"] - got["learner"]).abs().max().item()
    print(f"{arch}: |engine - learner| after disaggregated sync {diff:.2e}; sent {sent['stats'][0]}; "
          f"received {got['stats']}")
    assert (got["after"] - got["before"]).abs().max() > 1e-2, "the train step must change the engine's logprobs"
    assert diff < TOL
    assert (got["recovered"] - got["learner"]).abs().max() < TOL
    stats = got["stats"]
    assert stats.buckets > 2 and stats.tensors > 10 and stats.bytes > 0
    assert (stats.buckets, stats.tensors, stats.bytes) == (sent["stats"][0].buckets, sent["stats"][0].tensors,
                                                           sent["stats"][0].bytes)
    err = got["corruption_error"]
    assert err is not None, "a bucket corrupted in transit must be refused"
    assert "bucket 1" in err and "checksum mismatch" in err and "model." in err
