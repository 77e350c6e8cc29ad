"""Two gloo ranks (a colocated learner world) each own a RolloutEngine on CPU: no cross-rank collectives,
uneven workloads do not hang, the learner's world survives the engines' start and shutdown.
Run: .venv/bin/python -m pytest -q tests/e2e/test_rollout_engine_ranks.py
"""
import pytest

from tests.spawn import run_distributed

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]


def _rank_fn(rank, world_size, model_dir):
    import torch
    import torch.distributed as dist

    from megatron_sparse_rl.config.rollout import RolloutConfig, SamplingConfig
    from megatron_sparse_rl.patches import vllm_cpu
    from megatron_sparse_rl.rollout import RolloutEngine

    vllm_cpu.apply()
    engine = RolloutEngine(model_dir, RolloutConfig(max_model_len=128, max_num_seqs=4, sampling=SamplingConfig(max_tokens=8)))
    greedy = SamplingConfig(n=1, temperature=0.0, max_tokens=4 + 12 * rank)
    for _ in range(1 + 2 * rank):  # rank 1 does three times the work
        batch = engine.generate([[1, 5, 6, 14]] * (1 + rank), greedy)
    engine.shutdown()
    x = torch.ones(1)
    dist.all_reduce(x)  # the learner's world is intact
    return batch.responses()[0], x.item()


def test_one_engine_per_rank(tmp_path):
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    model_dir = str(build_tiny_hf_model(tmp_path / "m", seed=0))
    (r0, s0), (r1, s1) = run_distributed(_rank_fn, world_size=2, args=(model_dir,), timeout=240)
    assert s0 == s1 == 2.0
    assert r1[:4] == r0  # same model, greedy: rank 1's longer response extends rank 0's
