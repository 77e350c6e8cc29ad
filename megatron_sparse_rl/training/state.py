"""Whole-run checkpoints (learner, optimizer, RNG, schedule, data position, loop counters, the resolved config) and
the final Hugging Face export. A run saves, prunes and resumes only its own checkpoints (the run id in their
manifest), and resumes from its newest intact one (every file's size and sha256 as recorded at save) when its
saved config allows (run/run_dir.py `check_resume`)."""
from __future__ import annotations

import json
import logging
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from megatron_sparse_rl.config.loader import to_dict
from megatron_sparse_rl.formats.hf_writer import ShardedSafetensorsWriter, write_side_files
from megatron_sparse_rl.learner.checkpoint import (COMMON, StateFileError, is_complete, load_learner,
                                                  param_dtype_name, read_common_state, save_learner, temporary_path)
from megatron_sparse_rl.learner.finite import require_finite_weights
from megatron_sparse_rl.learner.integrity import owner_of, verify_files
from megatron_sparse_rl.run import run_dir
from megatron_sparse_rl.training.context import RunContext
from megatron_sparse_rl.run.run_dir import RunDirError
from megatron_sparse_rl.weight_sync import iter_hf_tensors

log = logging.getLogger(__name__)


def checkpoint_dir(ctx: RunContext) -> Path:
    return ctx.owner.checkpoints


def own_checkpoints(ctx: RunContext) -> list[Path]:
    """This run's complete checkpoints, oldest first (another run's, in a shared checkpoint.dir, never count)."""
    return run_dir.own_checkpoints(checkpoint_dir(ctx), ctx.owner.run_id)


def save_run(ctx: RunContext, loop: LoopState, task_state: dict | None = None) -> Path:
    """Checkpoint named after the RL step; keeps this run's newest `checkpoint.keep_last`. `task_state`: the task's
    position to resume from (default: now; asynchronous RL passes the one before the batch sampled ahead, which the
    checkpoint drops and a resumed run samples again)."""
    root = checkpoint_dir(ctx)
    path = root / f"step_{loop.rl_step:06d}_sft_{loop.sft_step:06d}"
    if is_complete(path):  # already saved at this point of the run
        if owner_of(path) != ctx.owner.run_id:
            raise RunDirError(f"checkpoint {str(path)!r} was not written by this run ({ctx.owner.run_id}); "
                              "refusing to treat it as this run's")
        return path
    require_finite_weights(ctx.learner, "checkpoint", group=ctx.groups.learner)  # never a checkpoint of NaN weights
    counters = loop.saved(ctx.writer.records if ctx.writer is not None else None)
    if ctx.is_main:
        root.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    with _writing(path, "checkpoint", cleanup=temporary_path(path) if ctx.is_main else None):
        save_learner(ctx.learner, path, extra={"counters": counters, "task": task_state or ctx.task.state_dict()},
                     owner=ctx.owner.run_id, config=to_dict(ctx.run), hf_files=ctx.model_dir)
    if ctx.is_main:
        for old in own_checkpoints(ctx)[:-ctx.run.checkpoint.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return path


FULL_BELOW = 1 << 20
"""A filesystem with fewer free bytes than this (1 MiB) after a failed write is taken as full: writers that fill a
disk leave at most a block free."""


def _free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of `path` (its nearest existing ancestor)."""
    folder = next(p for p in (path, *path.parents) if p.exists())
    stat = os.statvfs(folder)
    return stat.f_bavail * stat.f_frsize


@contextmanager
def _writing(path: Path, what: str, *, cleanup: Path | None):
    """Name `path` in a failed write of it as a RunDirError, after removing the partial temporary directory `cleanup`
    (nothing half-written is left behind; other errors are re-raised after the removal). A full disk shows as an
    OSError naming no file, or from Megatron's checkpoint writer as a CheckpointException whose worker failure says
    only "unexpected pos" (PyTorch's zip writer losing bytes): a filesystem left with under FULL_BELOW free bytes is
    reported as full either way, naming the directory, with the space free there."""
    try:
        yield
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException, not an Exception
        free = _free_bytes(path.parent)  # before the partial files are removed
        if cleanup is not None:
            shutil.rmtree(cleanup, ignore_errors=True)
        if free < FULL_BELOW:
            detail = (f"No space left on device ({free:,} bytes free on the filesystem of {str(path.parent)!r}; "
                      f"{_cause(e)})")
        elif isinstance(e, OSError):
            detail = e.strerror or str(e)
            detail += f" ({e.filename})" if e.filename and str(e.filename) != str(path) else ""
        else:
            raise
        raise RunDirError(f"could not write the {what} {str(path)!r}: {detail}; nothing of it was kept, and the "
                          "older checkpoints are as they were (free space or fix permissions there, then run the same "
                          "command again to resume)") from e


def _cause(e: BaseException) -> str:
    """`e` in one line; a CheckpointException by its first rank's error (what the worker that failed raised)."""
    failures = getattr(e, "failures", None)
    if failures:
        e = next(iter(failures.values()))[0]
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def newest_intact(ctx: RunContext) -> Path | None:
    """This run's newest checkpoint whose files match their manifest (sizes and sha256). A damaged newer one is
    skipped with a warning naming its bad files; when this run has checkpoints but none is intact, the error
    names every damaged file. Collective over the learner ranks (they share the hashing)."""
    damaged: dict[Path, list[str]] = {}
    candidates = own_checkpoints(ctx)
    for path in reversed(candidates):
        problems = verify_files(path)
        if not problems:
            for bad, lines in damaged.items():
                log.warning("checkpoint %s is damaged, resuming from the older %s instead: %s", bad, path,
                            "; ".join(lines))
            return path
        damaged[path] = problems
    if damaged:
        detail = "\n  ".join(line for lines in damaged.values() for line in lines)
        raise RunDirError(f"no intact checkpoint of this run in {str(checkpoint_dir(ctx))!r} to resume from; "
                          f"damaged files:\n  {detail}\n(start over with --set logging.overwrite=true, or restore "
                          "the files)")
    return None


def resume_run(ctx: RunContext) -> LoopState | None:
    """Load this run's newest intact checkpoint when the run is resuming and has one; returns its loop state.
    Its saved config is compared with the run's again (`run_dir.check_resume`): the claim compared the newest
    checkpoint's; when that one was damaged and this older one is loaded, a refusal is raised here, on every
    learner rank alike, and otherwise a second resume line names it."""
    if not ctx.owner.resuming:
        return None
    path = newest_intact(ctx)
    if path is None:
        return None
    compared = run_dir.check_resume(path, ctx.run)  # a JSON read; the claim did it for the newest checkpoint
    if path != ctx.owner.compared and ctx.is_main:
        run_dir.announce_resume(ctx.owner.run_id, path, compared)
    try:  # the checkpoint's own state is checked (JSON reads) before any weight is loaded
        extra = read_common_state(path)["extra"]
        loop = LoopState.from_saved(path / COMMON, extra)
        try:
            ctx.task.load_state_dict(extra["task"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise StateFileError(f"{path / COMMON}: field 'extra.task' is not a data position of this run's task "
                                 f"({type(e).__name__}: {e})") from None
        load_learner(ctx.learner, path)  # its RNG files are checked before its weights load
    except StateFileError as e:
        raise RunDirError(f"cannot resume from {str(path)!r}: {e}. Its manifest matches these bytes, so it was "
                          "written so: move that checkpoint out of the directory to resume from the one before it, or "
                          "start over with --set logging.overwrite=true") from None
    log.info("resumed from %s\n  %s", path, "\n  ".join(compared))  # the log file's record of the comparison
    return loop


@dataclass
class LoopState:
    """The run loop's counters, saved in every run checkpoint as `extra.counters` of its common_state.json (the
    format is unchanged: `saved()` writes the same keys `from_saved()` reads)."""

    rl_step: int = 0
    sft_step: int = 0
    syncs: int = 0
    """Weight syncs done: the every-N probe schedule counts them across restarts."""
    sft_done: bool = False
    kv_budget: int | None = None
    """The budget rollout.kv.budget_schedule had reached (None without a schedule)."""
    metrics_records: int = 0
    """Records of metrics.jsonl at the checkpoint (a resumed run keeps that many); set on load only."""

    def saved(self, metrics_records: int | None) -> dict:
        """The mapping a checkpoint holds; `metrics_records`: the writer's records now (None: no writer)."""
        out = {"rl_step": self.rl_step, "sft_step": self.sft_step, "syncs": self.syncs, "sft_done": self.sft_done}
        if metrics_records is not None:
            out["metrics_records"] = metrics_records
        if self.kv_budget is not None:
            out["kv_budget"] = self.kv_budget
        return out

    @classmethod
    def from_saved(cls, file: Path, extra: dict) -> LoopState:
        """`extra["counters"]` checked against SAVED_FIELDS; StateFileError naming `file` and the field otherwise."""
        counters = extra.get("counters")
        if not isinstance(counters, dict):
            raise StateFileError(f"{file}: field 'extra.counters' must be a mapping of the run's loop counters (got "
                                 f"{counters!r:.200})")
        for name, kind in SAVED_FIELDS.items():
            if name in OPTIONAL_FIELDS and name not in counters:
                continue
            value, least = counters.get(name), 1 if name == "kv_budget" else 0
            ok = isinstance(value, bool) if kind is bool else type(value) is int and value >= least
            if not ok:
                rule = "true or false" if kind is bool else f"an integer >= {least}"
                got = f"{value!r:.200}" if name in counters else "nothing"
                raise StateFileError(f"{file}: field 'extra.counters.{name}' must be {rule} (got {got})")
        return cls(**{name: counters[name] for name in SAVED_FIELDS if name in counters})

    def where(self) -> str:
        return f"RL step {self.rl_step}, SFT step {self.sft_step}"


SAVED_FIELDS = {"rl_step": int, "sft_step": int, "syncs": int, "sft_done": bool, "metrics_records": int,
                "kv_budget": int}
"""The loop counters a run's checkpoint holds and their types; all but metrics_records (absent when the run kept
no metrics) and kv_budget (absent without rollout.kv.budget_schedule; >= 1) are required."""
OPTIONAL_FIELDS = ("metrics_records", "kv_budget")


def stop_requested(ctx: RunContext, stops, *, preemption: bool = True) -> str | None:
    """Why the run should stop at this step boundary, the same answer on every learner rank, or None: a stop signal
    (run/stops.py `StopSignals`) on any learner rank, or (`preemption`: after a step) the launcher's preemption
    file ($MSRL_PREEMPT_FILE, written by the sbatch script on SIGUSR1). With several learner ranks this is one
    collective per boundary."""
    flag = os.environ.get("MSRL_PREEMPT_FILE") if preemption else None
    preempted = bool(flag) and ctx.is_main and Path(flag).exists()
    local = 2.0 if stops.requested() else 1.0 if preempted else 0.0
    if dist.get_world_size(ctx.groups.learner) > 1:  # learner ranks only (rollout ranks are serving)
        import torch

        agreed = torch.tensor([local])
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=ctx.groups.learner)
        local = agreed.item()
    if local == 2.0:
        return f"{stops.name or 'a stop signal'} received"
    return f"preemption requested ({flag})" if local == 1.0 else None


STOP_RECORD = Path("logs") / "stop.json"
"""Where rank 0 of a run stopped on request records why, where and its checkpoint (read by `msrl launch local`)."""


def record_stop(ctx: RunContext, why: str, where: str, checkpoint: Path | None) -> Path:
    """Write the stop record (temp file, then rename)."""
    path = ctx.run_dir / STOP_RECORD
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"stopped": why, "at": where, "checkpoint": str(checkpoint) if checkpoint else None,
                               "pid": os.getpid()}) + "\n")
    os.replace(tmp, path)
    return path


def export_hf(ctx: RunContext, out: Path) -> Path | None:
    """Write the learner's weights as a Hugging Face model directory (config and tokenizer from the source model,
    config.json stating the written dtype, without fp8 quantization or MTP layers). Every rank takes part in the gathers; rank 0 writes. Atomic (temp dir, then rename)."""
    require_finite_weights(ctx.learner, "hf_final", group=ctx.groups.learner)
    tmp = out.with_name(f".{out.name}.tmp")
    writer = None
    if ctx.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        writer = ShardedSafetensorsWriter(tmp, 2 << 30)
    with _writing(out, "final Hugging Face export", cleanup=tmp if ctx.is_main else None):
        for name, tensor in iter_hf_tensors(ctx.learner):
            if writer is not None:
                writer.add(name, tensor)
        if ctx.is_main:
            writer.finish()
            write_side_files(ctx.model_dir, tmp, dtype=param_dtype_name(ctx.learner))  # config.json: the dtype
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp, out)
    dist.barrier()
    return out if ctx.is_main else None
