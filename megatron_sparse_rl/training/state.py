"""Whole-run checkpoints (learner, optimizer, RNG, schedule, data position, loop counters) and the final
Hugging Face export."""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch.distributed as dist

from megatron_sparse_rl.learner.checkpoint import is_complete, load_learner, save_learner
from megatron_sparse_rl.training.context import RunContext

log = logging.getLogger(__name__)


def checkpoint_dir(ctx: RunContext) -> Path:
    return Path(ctx.run.checkpoint.dir) if ctx.run.checkpoint.dir else ctx.run_dir / "checkpoints"


def latest_checkpoint(ctx: RunContext) -> Path | None:
    root = checkpoint_dir(ctx)
    found = sorted(p for p in root.glob("step_*") if is_complete(p)) if root.is_dir() else []
    return found[-1] if found else None


def save_run(ctx: RunContext, counters: dict) -> Path:
    """Checkpoint named after the RL step; keeps the newest `checkpoint.keep_last`."""
    root = checkpoint_dir(ctx)
    path = root / f"step_{counters['rl_step']:06d}_sft_{counters['sft_step']:06d}"
    if is_complete(path):  # already saved at this point of the run
        return path
    if ctx.writer is not None:
        counters = {**counters, "metrics_records": ctx.writer.records}
    if ctx.is_main:
        root.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    save_learner(ctx.learner, path, extra={"counters": counters, "task": ctx.task.state_dict()})
    if ctx.is_main:
        for old in sorted(p for p in root.glob("step_*") if is_complete(p))[:-ctx.run.checkpoint.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return path


def resume_run(ctx: RunContext) -> dict | None:
    """Load the newest complete checkpoint if resuming is on and there is one; returns its loop counters."""
    if not ctx.run.checkpoint.resume:
        return None
    path = latest_checkpoint(ctx)
    if path is None:
        return None
    extra = load_learner(ctx.learner, path)
    ctx.task.load_state_dict(extra["task"])
    log.info("resumed from %s", path)
    return extra["counters"]


def preemption_requested(ctx: RunContext) -> bool:
    """True on every learner rank once the launcher's preemption file ($MSRL_PREEMPT_FILE, written by the sbatch
    script on SIGUSR1) exists: the trainer then checkpoints and exits so the requeued job resumes."""
    flag = os.environ.get("MSRL_PREEMPT_FILE")
    if not flag:
        return False
    import torch

    hit = torch.tensor([float(ctx.is_main and Path(flag).exists())])
    dist.broadcast(hit, src=0, group=ctx.groups.learner)  # learner ranks only (rollout ranks are serving)
    return bool(hit.item())


def export_hf(ctx: RunContext, out: Path) -> Path | None:
    """Write the learner's weights as a Hugging Face model directory (config and tokenizer copied from the
    source model). Every rank takes part in the gathers; rank 0 writes. Atomic (temp dir, then rename)."""
    from megatron_sparse_rl.checkpoint.hf_writer import ShardedSafetensorsWriter
    from megatron_sparse_rl.checkpoint.manifest import copy_side_files
    from megatron_sparse_rl.weight_sync import iter_hf_tensors

    tmp = out.with_name(f".{out.name}.tmp")
    writer = None
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        writer = ShardedSafetensorsWriter(tmp, 2 << 30)
    for name, tensor in iter_hf_tensors(ctx.learner):
        if writer is not None:
            writer.add(name, tensor)
    if ctx.is_main:
        writer.finish()
        copy_side_files(ctx.model_dir, tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    dist.barrier()
    return out if ctx.is_main else None
