"""Module-level worker functions for the distributed learner tests (pickled into spawned ranks)."""
from __future__ import annotations

import torch

from megatron_sparse_rl.config.schema import LearnerConfig, ModelConfig, OptimizerConfig, ParallelConfig


def make_learner(world_size, model_dir, tp=1, ep=1, pp=1, sp=False, lr=1e-3, mbs=2, load=True, clip=1.0):
    from megatron_sparse_rl.learner.learner import Learner
    from megatron_sparse_rl.models import load_spec
    from megatron_sparse_rl.parallel import ParallelLayout
    from megatron_sparse_rl.patches import megatron_cpu

    megatron_cpu.apply()
    adapter, spec = load_spec(model_dir)
    layout = ParallelLayout.from_config(ParallelConfig(tp=tp, ep=ep, pp=pp, sequence_parallel=sp), world_size)
    layout.check_model(spec)
    groups = layout.initialize()
    learner = Learner(adapter, spec, layout, groups, model_cfg=ModelConfig(path=str(model_dir)),
                      cfg=LearnerConfig(micro_batch_size=mbs, optimizer=OptimizerConfig(lr=lr, clip_grad=clip)),
                      total_steps=10)
    if load:
        learner.load_hf(model_dir)
    return learner


def logprobs_worker(rank, world_size, model_dir, tokens, tp, ep):
    learner = make_learner(world_size, model_dir, tp=tp, ep=ep)
    out = learner.forward_logprobs(tokens)
    return out["logprobs"], out["entropy"]
