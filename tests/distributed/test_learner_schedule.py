"""Which LR schedule a learner follows after `load_learner`: a step-0 checkpoint (what `msrl convert
hf-to-mcore` writes, or a fresh save) leaves the loading learner's configured schedule; a checkpoint saved
after training steps brings its run's schedule back (resume).
Run: .venv/bin/python -m pytest -q tests/distributed/test_learner_schedule.py
"""
from __future__ import annotations

import pytest
import torch

from tests.spawn import run_distributed

pytestmark = pytest.mark.distributed


def schedule_worker(rank, world_size, model_dir, ckpt0, ckpt1):
    from megatron_sparse_rl.learner.checkpoint import load_learner, save_learner
    from megatron_sparse_rl.learner.sft import make_sft_loss
    from tests.learner_workers import make_learner

    first = make_learner(world_size, model_dir, lr=1e-3)
    save_learner(first, ckpt0)
    tokens = torch.randint(1, 30, (2, 9))
    mask = torch.ones(2, 8)
    first.train_step(tokens, make_sft_loss(mask, mask.sum().item()))
    save_learner(first, ckpt1)
    out = {}
    for name, ckpt in (("step0", ckpt0), ("step1", ckpt1)):
        other = make_learner(world_size, model_dir, lr=5e-2, load=False)
        load_learner(other, ckpt)
        out[name] = (other.scheduler.max_lr, other.step)
    return out


def test_step0_checkpoint_keeps_the_configured_schedule_and_a_resume_restores_the_run(tmp_path):
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    model_dir = build_tiny_hf_model(tmp_path / "moe", seed=0)
    out = run_distributed(schedule_worker, 1, (str(model_dir), str(tmp_path / "c0"), str(tmp_path / "c1")),
                          timeout=240)[0]
    assert out["step0"] == (5e-2, 0)
    assert out["step1"] == (1e-3, 1)
