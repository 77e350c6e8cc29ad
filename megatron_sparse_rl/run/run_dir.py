"""Who owns a run directory, so that two runs never mix: `run.json` in `logging.dir` names the run (a random id,
written when a fresh run starts), the process running it (`holder`) and what the run writes there (`wrote`); every
checkpoint it saves records that id (learner/integrity.py).

At start (`claim`, rank 0, before Megatron or vLLM start), first the directory is locked (run/lock.py:
an flock on the directory itself, held to the end of the run): a directory a live process holds is refused,
naming that process; a holder that died (even by SIGKILL) released its lock, and its directory is taken over.
The checkpoint directory (`checkpoint.dir`, default <logging.dir>/checkpoints; made here when missing) is locked
the same way, so that two runs with different logging.dir never share one: a checkpoint directory another live
run holds is refused, naming `checkpoint.dir`, the directory and that process. Then:
- the directory holds nothing of a run (or does not exist): a fresh run; `run.json` is written;
- it holds this run's identity and `checkpoint.resume` is on: the run continues (from its own checkpoints only);
- anything else (another run's metrics, checkpoints, exports, or a run to resume while `checkpoint.resume` is
  off) is refused, naming the directory, what is in it and the ways out: resume it, choose another
  `logging.dir`, or `logging.overwrite=true` (removes what the previous run recorded that it wrote: the names in
  its `wrote`, the checkpoints carrying its id; files no run recorded are refused, never removed).

A run that continues is checked against the config saved with its newest checkpoint (`check_resume`,
run/resume_config.py): a change to what the resumed steps compute is refused, listing each as
`path: old -> new`, unless `checkpoint.allow_config_change`; the others are listed. Then rank 0 logs, as a WARNING
the console always shows, "resuming run ... at RL step N (SFT step M) from <checkpoint>" and what was compared.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

from megatron_sparse_rl.config.loader import ConfigError, to_dict
from megatron_sparse_rl.config.schema import RunConfig
from megatron_sparse_rl.formats.safe_load import check_checkpoint_files
from megatron_sparse_rl.learner.checkpoint import is_complete, read_config
from megatron_sparse_rl.learner.integrity import owner_of
from megatron_sparse_rl.run.resume_config import compare
from megatron_sparse_rl.run.lock import (
    DirLock, RunLockedError, describe, flock_holder, is_this_process, lock, this_process,
)

log = logging.getLogger(__name__)

RUN_FILE = "run.json"
# What a run writes into logging.dir (the model directory and vLLM's cache are not run artifacts); wandb/,
# mlflow.db and mlflow_artifacts/: the W&B offline run and the default MLflow store (logging.trackers).
ARTIFACTS = (RUN_FILE, "metrics.jsonl", "metrics.png", "tensorboard", "hf_final", ".hf_final.tmp", "logs", "wandb",
             "mlflow.db", "mlflow_artifacts")
CHECKPOINT_GLOB = "step_*"


class RunDirError(ConfigError):
    """The run directory holds something this run must not mix with (the message says what and the ways out);
    `msrl train` prints it as an error, without a traceback."""


@dataclass(frozen=True)
class RunDir:
    """The directory of the current run and its identity."""

    path: Path
    checkpoints: Path
    run_id: str
    resuming: bool
    """True when the directory held this run already (`checkpoint.resume` on): its checkpoints may be resumed."""
    compared: Path | None = None
    """The checkpoint whose saved config `claim` compared with this run's (this run's newest complete one)."""
    lock: DirLock | None = field(default=None, compare=False)
    """The directory's lock, held by the process that claimed it until it exits (run/lock.py)."""
    checkpoint_lock: DirLock | None = field(default=None, compare=False)
    """The checkpoint directory's lock, held the same way."""


def checkpoint_root(run: RunConfig) -> Path:
    return Path(run.checkpoint.dir) if run.checkpoint.dir else Path(run.logging.dir) / "checkpoints"


def _present(run_dir: Path, ckpt_root: Path) -> list[Path]:
    found = [run_dir / n for n in ARTIFACTS if (run_dir / n).exists()]
    if ckpt_root.is_dir():
        found += sorted(ckpt_root.glob(CHECKPOINT_GLOB)) + sorted(ckpt_root.glob(f".{CHECKPOINT_GLOB}"))
    return found


def _refusal(run_dir: Path, present: list[Path], why: str) -> RunDirError:
    shown = ", ".join(str(p) for p in present[:6]) + (f" and {len(present) - 6} more" if len(present) > 6 else "")
    return RunDirError(
        f"logging.dir {str(run_dir)!r} {why} ({shown}). Either resume that run (checkpoint.resume=true, same "
        f"logging.dir), or start a new one in another directory (--set logging.dir=...) or replace it "
        f"(--set logging.overwrite=true removes the previous run's artifacts)")


def own_checkpoints(ckpt_root: Path, run_id: str) -> list[Path]:
    """The complete checkpoints run `run_id` saved in `ckpt_root`, oldest first (names sort by step)."""
    found = sorted(p for p in ckpt_root.glob(CHECKPOINT_GLOB) if is_complete(p)) if ckpt_root.is_dir() else []
    return [p for p in found if owner_of(p) == run_id]


def _foreign_checkpoints(ckpt_root: Path, run_id: str) -> list[Path]:
    if not ckpt_root.is_dir():
        return []
    return [p for p in sorted(ckpt_root.glob(CHECKPOINT_GLOB)) if owner_of(p) != run_id]


def _remove(paths: list[Path]) -> None:
    for p in paths:
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def _read_record(run_dir: Path) -> dict:
    """`run.json` of the run that owns `run_dir` ({} when there is none or it cannot be read)."""
    try:
        record = json.loads((run_dir / RUN_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _write_record(run_dir: Path, record: dict) -> None:
    tmp = run_dir / f".{RUN_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, run_dir / RUN_FILE)


def _new_record(run_dir: Path, run: RunConfig, ckpt_root: Path) -> dict:
    """The run.json of a fresh run. It records what the run writes, none of which exists when it starts (a
    directory holding any of it is refused or overwritten first): its artifacts by name (`wrote`), the checkpoints
    by the run id in their manifests, and `made_checkpoint_dir` when it makes the checkpoint directory (so that the
    temporary checkpoints in it are its own too)."""
    made = not ckpt_root.exists() or (ckpt_root.is_dir() and not any(ckpt_root.iterdir()))
    return {"run_id": uuid.uuid4().hex, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "model": run.model.path,
            "holder": this_process(), "wrote": list(ARTIFACTS), "made_checkpoint_dir": str(ckpt_root) if made else None}


def _recorded(run_dir: Path, ckpt_root: Path, record: dict) -> list[Path]:
    """What the run of `record` wrote, which `logging.overwrite` removes: the names it recorded (a run.json of an
    older version, without them: the artifacts), the checkpoints carrying its id, and the temporary checkpoints in
    a checkpoint directory it made."""
    run_id = record.get("run_id")
    if run_id is None:
        return []
    wrote = record.get("wrote", ARTIFACTS)
    found = [run_dir / n for n in wrote if isinstance(n, str) and (run_dir / n).exists()]
    if ckpt_root.is_dir():
        found += [p for p in sorted(ckpt_root.glob(CHECKPOINT_GLOB)) if owner_of(p) == str(run_id)]
        made = record.get("made_checkpoint_dir", str(run_dir / "checkpoints") if "wrote" not in record else None)
        if made == str(ckpt_root):
            found += sorted(ckpt_root.glob(f".{CHECKPOINT_GLOB}"))
    return found


def _overwrite(run_dir: Path, ckpt_root: Path, record: dict, present: list[Path]) -> None:
    """`logging.overwrite`: remove what the previous run recorded that it wrote. Anything else a fresh run would
    mix with (files without a run.json, another run's checkpoints) is refused before anything is removed."""
    ours = _recorded(run_dir, ckpt_root, record)
    others = [p for p in present if p not in ours]
    if others:
        raise RunDirError(
            f"logging.dir {str(run_dir)!r} holds files no run recorded in its {RUN_FILE} that it wrote ("
            + ", ".join(str(p) for p in others[:6]) + (f" and {len(others) - 6} more" if len(others) > 6 else "")
            + "): logging.overwrite removes only a previous run's own files, never anyone else's. Move them away, "
            "or start this run in another directory (--set logging.dir=...)")
    log.warning("logging.overwrite: removing what the previous run wrote: %s", ", ".join(map(str, ours)))
    _remove(ours)


def _made_dirs(run_dir: Path) -> list[Path]:
    """Make `run_dir` (and missing parents); the directories made, deepest first (removed again on a refusal)."""
    made, p = [], run_dir
    while not p.exists() and p != p.parent:
        made.append(p)
        p = p.parent
    run_dir.mkdir(parents=True, exist_ok=True)
    return made


def claim(run: RunConfig) -> RunDir:
    """Lock `logging.dir` and the checkpoint directory (run/lock.py), then decide whether this run starts
    fresh or continues (rank 0 only; see the module docstring). Raises RunDirError, having written and removed
    nothing, when a live process holds either directory or the run directory belongs to something else."""
    run_dir, ckpts = Path(run.logging.dir), checkpoint_root(run)
    made = _made_dirs(run_dir)
    try:
        held = lock(run_dir, lambda: _read_record(run_dir).get("holder"))
    except RunLockedError as e:
        raise RunDirError(str(e)) from None
    locks = [held]
    try:
        made = _made_dirs(ckpts) + made  # deepest first: the checkpoint directory may lie in run_dir
        locks.append(_lock_checkpoints(run, ckpts))
        return replace(_decide(run, run_dir, ckpts), lock=held, checkpoint_lock=locks[1])
    except BaseException:
        for taken in locks:
            taken.release()
        for p in made:
            try:
                p.rmdir()
            except OSError:  # something is in it now (e.g. a run started at the same time): it stays
                pass
        raise


def _lock_checkpoints(run: RunConfig, ckpts: Path) -> DirLock:
    """The checkpoint directory's lock; RunDirError naming it and its holder when another live run holds it."""
    field_name = "checkpoint.dir" if run.checkpoint.dir else "checkpoint.dir (default <logging.dir>/checkpoints)"
    try:
        return lock(ckpts, lambda: flock_holder(ckpts), field=field_name,
                    way_out="give this run a checkpoint directory of its own (--set checkpoint.dir=...): two runs "
                            "must not share one",
                    unknown="a process on another host (its lock is not in this host's lock table)")
    except RunLockedError as e:
        raise RunDirError(str(e)) from None


def _decide(run: RunConfig, run_dir: Path, ckpts: Path) -> RunDir:
    """Fresh run or continuation of the run `run.json` names, with `run_dir` locked; refusals write nothing."""
    record = _read_record(run_dir)
    holder = record.get("holder")
    if holder and not is_this_process(holder):
        log.info("logging.dir %s: its last holder, %s, is no longer running (its lock was free)", run_dir,
                 describe(holder))
    present = _present(run_dir, ckpts)
    if present and run.logging.overwrite:
        _overwrite(run_dir, ckpts, record, present)
        present, record = _present(run_dir, ckpts), {}
    run_id = None if record.get("run_id") is None else str(record["run_id"])
    if run_id is not None and run.checkpoint.resume:
        foreign = _foreign_checkpoints(ckpts, run_id)
        if foreign:
            raise _refusal(run_dir, foreign, f"holds checkpoints in {str(ckpts)!r} that run {run_id} did not write")
        newest = (own_checkpoints(ckpts, run_id) or [None])[-1]
        compared = [] if newest is None else check_resume(newest, run)
        _write_record(run_dir, {**record, "holder": this_process()})
        if newest is None:
            log.warning("resuming run %s in %s from the start: it has no checkpoint in %s yet", run_id[:8], run_dir,
                        ckpts)
        else:
            announce_resume(run_id, newest, compared)
        return RunDir(run_dir, ckpts, run_id, resuming=True, compared=newest)
    if present:
        why = ("holds a previous run and checkpoint.resume is off" if run_id is not None
               else "holds another run's files")
        raise _refusal(run_dir, present, why)
    record = _new_record(run_dir, run, ckpts)
    _write_record(run_dir, record)
    return RunDir(run_dir, ckpts, record["run_id"], resuming=False)


def check_resume(checkpoint: Path, run: RunConfig) -> list[str]:
    """Compare the config saved with `checkpoint` with `run`'s (run/resume_config.py). Raises RunDirError
    listing every change to what the resumed steps compute (`path: old -> new`) unless
    `checkpoint.allow_config_change`; returns the lines saying what was compared, for `announce_resume`.
    First every pickle a load of it would read goes through the allowlists (formats/safe_load.py), so a file
    that needs code is refused here, at claim time, before Megatron or vLLM start."""
    check_checkpoint_files(checkpoint)
    try:
        saved = read_config(checkpoint)
    except ValueError as e:
        raise RunDirError(f"cannot resume from {str(checkpoint)!r}: its saved config is damaged ({e}); restore it, "
                          "or remove that checkpoint to resume from an older one") from None
    if saved is None:
        return ["its config could not be compared with this run's: the checkpoint was saved without one "
                "(by an older version); make sure the model, data, SFT stage and algorithm are the ones it trained"]
    changes = compare(saved, to_dict(run), to_dict(RunConfig()))
    refused = [str(c) for c in changes if not c.allowed]
    harmless = [str(c) for c in changes if c.allowed]
    if refused and not run.checkpoint.allow_config_change:
        raise RunDirError(
            f"cannot resume from {str(checkpoint)!r}: this run's config changes what the resumed steps compute "
            "(checkpoint's -> this run's):\n  " + "\n  ".join(refused)
            + ("\n(allowed, also changed: " + "; ".join(harmless) + ")" if harmless else "")
            + "\nRun with the checkpoint's values; or accept the changes with --set checkpoint.allow_config_change"
            "=true (what the checkpoint already did is not redone: a finished SFT stage is not run again, the "
            "learning-rate schedule continues as saved); or start a new run in another directory "
            "(--set logging.dir=...)")
    differ = ("unchanged" if not changes else "1 field differs" if len(changes) == 1
              else f"{len(changes)} fields differ")
    lines = [f"config compared with the checkpoint's: {differ}"]
    if refused:
        lines.append("ACCEPTED (checkpoint.allow_config_change) changes to what the run computes: "
                     + "; ".join(refused))
    if harmless:
        lines.append("allowed changes: " + "; ".join(harmless))
    return lines


def announce_resume(run_id: str, checkpoint: Path, compared: list[str]) -> None:
    """The resume line (rank 0): a WARNING, so that the console shows it whatever logging.level, then what was
    compared."""
    steps = re.fullmatch(r"step_(\d+)_sft_(\d+)", checkpoint.name)
    at = f" at RL step {int(steps[1])} (SFT step {int(steps[2])})" if steps else ""
    log.warning("resuming run %s%s from %s\n  %s", run_id[:8], at, checkpoint, "\n  ".join(compared))
