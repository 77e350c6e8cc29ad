"""Who owns a run directory, so that two runs never mix: `run.json` in `logging.dir` names the run (a random id,
written when a fresh run starts); every checkpoint it saves records that id (learner/integrity.py).

At start (`claim`, before Megatron or vLLM start):
- the directory holds nothing of a run (or does not exist): a fresh run; `run.json` is written;
- it holds this run's identity and `checkpoint.resume` is on: the run continues (from its own checkpoints only);
- anything else (another run's metrics, checkpoints, exports, or a run to resume while `checkpoint.resume` is
  off) is refused, naming the directory, what is in it and the ways out: resume it, choose another
  `logging.dir`, or `logging.overwrite=true` (removes the run artifacts listed in `ARTIFACTS`, nothing else).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from megatron_sparse_rl.config.loader import ConfigError
from megatron_sparse_rl.config.schema import RunConfig
from megatron_sparse_rl.learner.integrity import owner_of

log = logging.getLogger(__name__)

RUN_FILE = "run.json"
# What a run writes into logging.dir (the model directory and vLLM's cache are not run artifacts).
ARTIFACTS = (RUN_FILE, "metrics.jsonl", "metrics.png", "tensorboard", "hf_final", ".hf_final.tmp", "logs")
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


def checkpoint_root(run: RunConfig) -> Path:
    return Path(run.checkpoint.dir) if run.checkpoint.dir else Path(run.logging.dir) / "checkpoints"


def _read_id(path: Path) -> str | None:
    try:
        data = json.loads((path / RUN_FILE).read_text())
        return str(data["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


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


def _foreign_checkpoints(ckpt_root: Path, run_id: str) -> list[Path]:
    if not ckpt_root.is_dir():
        return []
    return [p for p in sorted(ckpt_root.glob(CHECKPOINT_GLOB)) if owner_of(p) != run_id]


def _remove(paths: list[Path]) -> None:
    for p in paths:
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def _write_id(run_dir: Path, run: RunConfig) -> str:
    run_id = uuid.uuid4().hex
    record = {"run_id": run_id, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "model": run.model.path}
    tmp = run_dir / f".{RUN_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, run_dir / RUN_FILE)
    return run_id


def claim(run: RunConfig) -> RunDir:
    """Decide whether this run starts fresh or continues (rank 0 only; see the module docstring). Raises
    RunDirError, having written and removed nothing, when the directory belongs to something else."""
    run_dir, ckpts = Path(run.logging.dir), checkpoint_root(run)
    present = _present(run_dir, ckpts)
    run_id = _read_id(run_dir)
    if present and run.logging.overwrite:
        log.warning("logging.overwrite: removing the previous run's artifacts: %s", ", ".join(map(str, present)))
        _remove(present)
        present, run_id = [], None
    if run_id is not None and run.checkpoint.resume:
        foreign = _foreign_checkpoints(ckpts, run_id)
        if foreign:
            raise _refusal(run_dir, foreign, f"holds checkpoints in {str(ckpts)!r} that run {run_id} did not write")
        return RunDir(run_dir, ckpts, run_id, resuming=True)
    if present:
        why = ("holds a previous run and checkpoint.resume is off" if run_id is not None
               else "holds another run's files")
        raise _refusal(run_dir, present, why)
    run_dir.mkdir(parents=True, exist_ok=True)
    return RunDir(run_dir, ckpts, _write_id(run_dir, run), resuming=False)
