"""Module-level worker functions for the distributed learner tests (pickled into spawned ranks)."""
from __future__ import annotations

import torch

from megatron_sparse_rl.config.schema import LearnerConfig, ModelConfig, OptimizerConfig, ParallelConfig


def make_learner(world_size, model_dir, tp=1, ep=1, pp=1, sp=None, lr=1e-3, mbs=2, load=True, clip=1.0, eps=1e-8,
                 dtype="float32", routing=None, indexer_replay="none", kernels="auto", pipeline_layout=None,
                 cp=1, lora=None, vpp=1, indexer_loss=0.0):
    from megatron_sparse_rl.learner.learner import Learner
    from megatron_sparse_rl.models import load_spec
    from megatron_sparse_rl.parallel import ParallelLayout
    from megatron_sparse_rl.patches import megatron_cpu

    megatron_cpu.apply()
    sp = tp > 1 if sp is None else sp
    adapter, spec = load_spec(model_dir)
    layout = ParallelLayout.from_config(ParallelConfig(tp=tp, ep=ep, pp=pp, sequence_parallel=sp,
                                                       pipeline_layout=pipeline_layout, cp=cp, vpp=vpp), world_size)
    layout.check_model(spec)
    groups = layout.initialize()
    learner = Learner(adapter, spec, layout, groups, model_cfg=ModelConfig(path=str(model_dir), dtype=dtype, lora=lora,
                                                                  dsa_indexer_loss_coeff=indexer_loss),
                      cfg=LearnerConfig(micro_batch_size=mbs, optimizer=OptimizerConfig(lr=lr, clip_grad=clip, eps=eps),
                                        kernels=kernels),
                      total_steps=10, routing=routing, indexer_replay=indexer_replay)
    if load:
        learner.load_hf(model_dir)
    return learner


def logprobs_worker(rank, world_size, model_dir, tokens, tp, ep, pp=1):
    learner = make_learner(world_size, model_dir, tp=tp, ep=ep, pp=pp)
    out = learner.forward_logprobs(tokens)
    return out["logprobs"], out["entropy"]


def train_steps_worker(rank, world_size, model_dir, tokens, mask, steps, tp, ep, save_at=None, ckpt=None,
                       resume_from=None):
    """SFT steps on `tokens` (the GLOBAL batch, split across data-parallel ranks); returns per-step losses."""
    from megatron_sparse_rl.learner.checkpoint import load_learner, save_learner
    from megatron_sparse_rl.learner.sft import make_sft_loss

    learner = make_learner(world_size, model_dir, tp=tp, ep=ep)
    if resume_from:
        load_learner(learner, resume_from)
    dp, dp_rank = learner.layout.dp, learner.groups.dp_rank
    rows = torch.arange(tokens.shape[0]).chunk(dp)[dp_rank]
    losses = []
    for step in range(steps):
        if save_at is not None and step == save_at:
            save_learner(learner, ckpt)
        torch.manual_seed(100 + step)
        loss_fn = make_sft_loss(mask[rows], mask.sum().item())
        m = learner.train_step(tokens[rows], loss_fn)
        loss = torch.tensor(m["loss"])
        torch.distributed.all_reduce(loss, group=learner.groups.dp)
        losses.append(loss.item())
    return losses


def save_load_worker(rank, world_size, model_dir, tokens, tp, ep, ckpt, mode):
    """mode 'save': load HF, take one SFT step, save, return logprobs; mode 'load': load ckpt, return logprobs."""
    from megatron_sparse_rl.learner.checkpoint import load_learner, save_learner
    from megatron_sparse_rl.learner.sft import make_sft_loss

    learner = make_learner(world_size, model_dir, tp=tp, ep=ep, load=mode == "save")
    if mode == "save":
        mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
        learner.train_step(tokens, make_sft_loss(mask, mask.sum().item()))
        save_learner(learner, ckpt)
    else:
        load_learner(learner, ckpt, load_optimizer=True)
    return learner.forward_logprobs(tokens)["logprobs"]


def step_then_logprobs_worker(rank, world_size, model_dir, tokens, tp, ep, steps=1):
    """SFT steps on the global batch (split over data-parallel ranks), then logprobs of the whole batch."""
    # Adam's first step is lr * sign(grad): a large eps makes it smooth in the gradient (~ lr * grad / eps),
    # so ulp-level differences between layouts stay ulp-level instead of flipping signs of near-zero grads.
    learner = make_learner(world_size, model_dir, tp=tp, ep=ep, lr=1.0, eps=1.0, clip=0.0)
    mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
    rows = torch.arange(tokens.shape[0]).chunk(learner.layout.dp)[learner.groups.dp_rank]
    from megatron_sparse_rl.learner.sft import make_sft_loss

    for _ in range(steps):
        learner.train_step(tokens[rows], make_sft_loss(mask[rows], mask.sum().item()))
    from megatron_sparse_rl.learner.params import gather_full

    params = {name: gather_full(lp, learner.groups).clone() for name, lp in learner.named_full_parameters()}
    return learner.forward_logprobs(tokens)["logprobs"], params


def resume_worker(rank, world_size, model_dir, tokens, tp, ep, ckpt, mode):
    """mode 'straight': 3 SFT steps, saving a checkpoint after 2; mode 'resume': load it and take step 3.
    Returns the per-step losses this process computed."""
    from megatron_sparse_rl.learner.checkpoint import load_learner, save_learner
    from megatron_sparse_rl.learner.sft import make_sft_loss

    learner = make_learner(world_size, model_dir, tp=tp, ep=ep, lr=1e-2, load=mode == "straight")
    rows = torch.arange(tokens.shape[0]).chunk(learner.layout.dp)[learner.groups.dp_rank]
    mask = torch.ones(tokens.shape[0], tokens.shape[1] - 1)
    steps = range(3)
    if mode == "resume":
        load_learner(learner, ckpt)
        steps = range(learner.step, 3)
    losses = []
    for step in steps:
        if mode == "straight" and step == 2:
            save_learner(learner, ckpt)
        m = learner.train_step(tokens[rows], make_sft_loss(mask[rows], mask.sum().item()))
        loss = torch.tensor(m["loss"])
        torch.distributed.all_reduce(loss, group=learner.groups.dp)
        losses.append(loss.item())
    return losses
