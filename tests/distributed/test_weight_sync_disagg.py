"""Disaggregated weight sync over gloo: learner ranks [0, L) hold the Megatron model, rank L owns the vLLM engine.

- L = 1 (TP1; MoE and dense): after SFT steps, `send_weights` (rank 0) -> `receive_weights` (rank 1) makes the engine's prompt
  logprobs of a fixed probe equal the learner's forward (sent to rank 1 for the comparison) and differ from
  before the sync. A bucket corrupted in transit (after the sender's digests) is refused naming the bucket;
  a clean sync afterwards recovers the engine.
- L = 2 (TP2, sequence parallel): both learner ranks join the TP gathers, rank 0 alone sends to rank 2;
  the engine's logprobs equal the learner's after a train step.

`ParallelLayout(world_size=L, rollout_ranks=1)`: every rank runs `initialize()`, which gives the learner ranks
[0, L) and the rollout ranks a default world each (Megatron's groups in the first, vLLM's in the second; the
rollout rank gets no Megatron groups), then `weight_sync_group()` (a Bridge between the two worlds).
Run: .venv/bin/python -m pytest -q tests/distributed/test_weight_sync_disagg.py
"""
import pytest
import torch

from tests.spawn import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.e2e]

TOL = 1e-4
PROBE = [[1, 5, 6, 14, 11, 18, 22, 20, 27, 21, 19, 5, 13], [1, 43, 21, 19, 9, 7, 15, 4, 4, 18, 22, 30, 31]]
SRC = 0  # the learner rank that sends


def _layout_groups(n_learners: int, tp: int, model_dir, rollout_ranks: int = 1):
    """Every rank: the disaggregated layout, its groups (None on the rollout rank) and the sync group."""
    from megatron_sparse_rl.config.schema import ParallelConfig
    from megatron_sparse_rl.models import load_spec
    from megatron_sparse_rl.parallel import ParallelLayout
    from megatron_sparse_rl.patches import megatron_cpu

    megatron_cpu.apply()
    layout = ParallelLayout.from_config(ParallelConfig(tp=tp, sequence_parallel=tp > 1), n_learners,
                                        rollout_ranks=rollout_ranks)
    layout.check_model(load_spec(model_dir)[1])
    groups = layout.initialize()
    return layout, groups, layout.weight_sync_group(src=SRC)


def _build_learner(layout, groups, model_dir):
    from megatron_sparse_rl.config.schema import LearnerConfig, ModelConfig, OptimizerConfig
    from megatron_sparse_rl.learner.learner import Learner
    from megatron_sparse_rl.models import load_spec

    adapter, spec = load_spec(model_dir)
    learner = Learner(adapter, spec, layout, groups, model_cfg=ModelConfig(path=str(model_dir)),
                      cfg=LearnerConfig(micro_batch_size=2, optimizer=OptimizerConfig(lr=1e-2)), total_steps=10)
    learner.load_hf(model_dir)
    return learner


def _flip_one_value(flipped: list):
    """A corrupt hook adding 1 to the first value of bucket 1's first tensor; appends that tensor's name."""
    def corrupt(bucket):
        if bucket.index == 1:
            name, tensor = bucket.tensors()[0]
            tensor.view(-1)[0] += 1.0
            flipped.append(name)
    return corrupt


def learner_rank(layout, groups, sync, model_dir, syncs):
    from megatron_sparse_rl.learner.sft import make_sft_loss
    from megatron_sparse_rl.weight_sync.disaggregated import send_weights

    learner = _build_learner(layout, groups, model_dir)
    tokens = torch.tensor(PROBE)
    mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
    for _ in range(2):
        learner.train_step(tokens, make_sft_loss(mask, mask.sum().item()))
    ours = learner.forward_logprobs(tokens)["logprobs"]  # collective over the TP group
    if torch.distributed.get_rank() == SRC:
        sync.broadcast_object(ours, src=SRC)
    stats = [send_weights(learner, sync, src=SRC, bucket_mb=0.1) for _ in range(syncs)]
    return {"stats": stats, "learner": ours}


def rollout_rank(sync, model_dir, syncs):
    from megatron_sparse_rl.config.rollout import RolloutConfig
    from megatron_sparse_rl.patches import vllm_cpu
    from megatron_sparse_rl.rollout import RolloutEngine
    from megatron_sparse_rl.weight_sync import WeightSyncError
    from megatron_sparse_rl.weight_sync.disaggregated import receive_weights

    vllm_cpu.apply()
    engine = RolloutEngine(model_dir, RolloutConfig(max_model_len=256, max_num_seqs=4, kv_cache_gb=1))
    before = torch.stack(engine.prompt_logprobs(PROBE))
    learner = sync.broadcast_object(None, src=SRC)
    out = {"before": before, "learner": learner, "stats": receive_weights(engine, sync, src=SRC)}
    out["after"] = torch.stack(engine.prompt_logprobs(PROBE))
    if syncs == 3:  # corrupted in transit, then clean again
        try:
            receive_weights(engine, sync, src=SRC, _corrupt=_flip_one_value(flipped := []))
            out["corruption_error"] = None
        except WeightSyncError as e:
            out["corruption_error"] = str(e)
        out["flipped"] = flipped
        receive_weights(engine, sync, src=SRC)
        out["recovered"] = torch.stack(engine.prompt_logprobs(PROBE))
    engine.shutdown()
    return out


def disagg_worker(rank, world_size, model_dir, tp, syncs):
    layout, groups, sync = _layout_groups(world_size - 1, tp, model_dir)
    if groups is None:
        return rollout_rank(sync, model_dir, syncs)
    return learner_rank(layout, groups, sync, model_dir, syncs)


def _check_synced(sent, got):
    diff = (got["after"] - got["learner"]).abs().max().item()
    assert (got["after"] - got["before"]).abs().max() > 1e-2, "the train step must change the engine's logprobs"
    assert diff < TOL
    stats = got["stats"]
    assert stats.buckets > 2 and stats.tensors > 10 and stats.bytes > 0
    assert (stats.buckets, stats.tensors, stats.bytes) == (sent["stats"][0].buckets, sent["stats"][0].tensors,
                                                           sent["stats"][0].bytes)
    return diff


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3"])
def test_disaggregated_sync_after_train_step(tmp_path, arch):
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    model_dir = str(build_tiny_hf_model(tmp_path / arch, arch=arch, seed=0))
    sent, got = run_distributed(disagg_worker, 2, args=(model_dir, 1, 3), timeout=240)
    diff = _check_synced(sent, got)
    print(f"{arch}: |engine - learner| after disaggregated sync {diff:.2e}; sent {sent['stats'][0]}; "
          f"received {got['stats']}")
    assert (got["recovered"] - got["learner"]).abs().max() < TOL
    err = got["corruption_error"]
    assert err is not None, "a bucket corrupted in transit must be refused"
    assert "bucket 1" in err and "checksum mismatch" in err and "model." in err
    assert got["flipped"] and f"tensors ['{got['flipped'][0]}']" in err, "the error names the corrupted tensor"


def test_disaggregated_sync_from_tp2_learner(tmp_path):
    """Learner TP2 on ranks 0-1 (Megatron groups over [0, 2) only), engine on rank 2."""
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    model_dir = str(build_tiny_hf_model(tmp_path / "moe", seed=0))
    sent0, sent1, got = run_distributed(disagg_worker, 3, args=(model_dir, 2, 1), timeout=300)
    diff = _check_synced(sent0, got)
    print(f"TP2 learner: |engine - learner| after disaggregated sync {diff:.2e}; received {got['stats']}")
    assert torch.equal(sent0["learner"], sent1["learner"]), "both TP ranks score the whole probe"
    # rank 1 gathered the same stream without sending it
    assert (sent1["stats"][0].tensors, sent1["stats"][0].bytes) == (got["stats"].tensors, got["stats"].bytes)


class _ShiftedShards:
    """Engine slices with one rule wrong on purpose: engine rank 1 is told its o_proj columns start at 0
    (what rank 0 keeps), while vLLM's loader reads its own columns."""

    def __init__(self, shards):
        self.shards, self.tp = shards, shards.tp

    def cut(self, name, tensor, rank):
        from megatron_sparse_rl.weight_sync.engine_shards import Cut

        piece, where = self.shards.cut(name, tensor, rank)
        if where is not None and name.endswith("o_proj.weight") and rank == 1:
            return tensor.narrow(where.dim, 0, where.length), Cut(where.full_shape, where.dim, 0, where.length)
        return piece, where


def sliced_worker(rank, world_size, model_dir):
    """Ranks 0-1: learner TP2; ranks 2-3: ONE vLLM engine of TP2. Syncs: sliced, whole, wrong slices, sliced."""
    from megatron_sparse_rl.learner.sft import make_sft_loss
    from megatron_sparse_rl.models import load_spec
    from megatron_sparse_rl.weight_sync import WeightSyncError
    from megatron_sparse_rl.weight_sync.disaggregated import receive_weights, send_weights
    from megatron_sparse_rl.weight_sync.engine_shards import EngineShards

    layout, groups, sync = _layout_groups(2, 2, model_dir, rollout_ranks=2)
    slices = layout.engine_shard_groups(SRC, 2)
    if groups is None:
        from megatron_sparse_rl.config.rollout import RolloutConfig
        from megatron_sparse_rl.patches import vllm_cpu
        from megatron_sparse_rl.rollout import RolloutEngine

        vllm_cpu.apply()
        engine = RolloutEngine(model_dir, RolloutConfig(max_model_len=256, max_num_seqs=4, kv_cache_gb=1,
                                                        tensor_parallel_size=2))
        mine = slices[rank % 2]
        out = {"before": torch.stack(engine.prompt_logprobs(PROBE))}
        out["learner"] = sync.broadcast_object(None, src=SRC)
        out["sliced_stats"] = receive_weights(engine, mine, src=SRC)
        out["sliced"] = torch.stack(engine.prompt_logprobs(PROBE))
        out["whole_stats"] = receive_weights(engine, sync, src=SRC)
        out["whole"] = torch.stack(engine.prompt_logprobs(PROBE))
        try:
            receive_weights(engine, mine, src=SRC)
            out["wrong_error"] = None
        except WeightSyncError as e:
            out["wrong_error"] = str(e)
        receive_weights(engine, mine, src=SRC)
        out["recovered"] = torch.stack(engine.prompt_logprobs(PROBE))
        engine.shutdown()
        return out
    learner = _build_learner(layout, groups, model_dir)
    tokens = torch.tensor(PROBE)
    mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
    for _ in range(2):
        learner.train_step(tokens, make_sft_loss(mask, mask.sum().item()))
    ours = learner.forward_logprobs(tokens)["logprobs"]
    if rank == SRC:
        sync.broadcast_object(ours, src=SRC)
    shards = EngineShards(load_spec(model_dir)[1], 2)
    sent = {"sliced": send_weights(learner, src=SRC, bucket_mb=0.1, shards=shards, shard_groups=slices),
            "whole": send_weights(learner, sync, src=SRC, bucket_mb=0.1)}
    send_weights(learner, src=SRC, bucket_mb=0.1, shards=_ShiftedShards(shards), shard_groups=slices)
    send_weights(learner, src=SRC, bucket_mb=0.1, shards=shards, shard_groups=slices)
    return sent


def test_sliced_sync_into_a_tp2_engine(tmp_path):
    """Each rank of a TP2 engine receives only its slices; the engine ends up exactly as after a whole-tensor
    sync (vLLM's own loaders narrowing), and a slice that disagrees with vLLM's loader is caught."""
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    model_dir = str(build_tiny_hf_model(tmp_path / "moe", seed=0))
    sent, _, got2, got3 = run_distributed(sliced_worker, 4, args=(model_dir,), timeout=420)
    for got in (got2, got3):
        assert (got["sliced"] - got["before"]).abs().max() > 1e-2, "the train steps must change the engine"
        assert (got["sliced"] - got["learner"]).abs().max() < TOL
        assert torch.equal(got["sliced"], got["whole"]), "sliced and whole-tensor syncs must load the same weights"
        assert (got["recovered"] - got["learner"]).abs().max() < TOL
        assert got["sliced_stats"].tensors == got["whole_stats"].tensors
    ratio = [g["sliced_stats"].bytes / g["whole_stats"].bytes for g in (got2, got3)]
    print(f"|engine - learner| after a sliced sync {(got2['sliced'] - got2['learner']).abs().max():.2e}; "
          f"bytes received per engine rank, sliced / whole: {ratio[0]:.3f}, {ratio[1]:.3f}; "
          f"sent {sent['sliced'].bytes} sliced vs {sent['whole'].bytes} whole")
    assert all(r < 0.6 for r in ratio), ratio
    assert sent["sliced"].bytes == got2["sliced_stats"].bytes + got3["sliced_stats"].bytes
    # engine rank 1 (global rank 3) got rank 0's o_proj columns, placed where rank 0 keeps them: its loader
    # reads NaN
    assert got2["wrong_error"] is None
    err = got3["wrong_error"]
    assert err is not None and "read outside the slices" in err, err
    assert "model.layers.0.self_attn.o_proj.weight" in err and "q_proj" not in err, err


def _wrong_world_worker(rank, world_size):
    from megatron_sparse_rl.config.schema import ParallelConfig
    from megatron_sparse_rl.parallel import ParallelLayout

    try:
        ParallelLayout.from_config(ParallelConfig(), 1, rollout_ranks=2).initialize()
    except ValueError as e:
        return str(e)
    return None


def test_disaggregated_layout_rejects_bad_settings():
    from megatron_sparse_rl.config.schema import ParallelConfig
    from megatron_sparse_rl.parallel import ParallelLayout

    with pytest.raises(ValueError, match="rollout_ranks must be >= 0"):
        ParallelLayout.from_config(ParallelConfig(), 1, rollout_ranks=-1)
    with pytest.raises(ValueError, match="needs rollout ranks"):
        ParallelLayout.from_config(ParallelConfig(), 2).weight_sync_group()
    with pytest.raises(ValueError, match=r"learner rank in \[0, 2\) \(got 2\)"):
        ParallelLayout.from_config(ParallelConfig(), 2, rollout_ranks=1).weight_sync_group(src=2)
    errors = run_distributed(_wrong_world_worker, 2, timeout=60)
    assert all(e == "layout was made for 1 learner + 2 rollout = 3 ranks, but torch.distributed has 2 ranks"
               for e in errors), errors
