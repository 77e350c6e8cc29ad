"""Distributed checkpoints of a Learner: model + optimizer (torch_dist, any layout reloads at any layout),
LR schedule, step, per-rank RNG states and caller-provided extra state. Atomic: written to a temporary
directory beside the target, renamed into place once every rank has finished. Every file's size and sha256 and
the id of the run that saved it go into `MANIFEST.json` (learner/integrity.py), so a damaged or foreign
checkpoint is recognised before it is loaded. A run's checkpoint also holds the run's resolved config
(`run_config.json`, covered by the manifest), which a resume compares with its own (training/run_dir.py).

    save_learner(learner, "runs/x/checkpoints/step_000010", extra={"data_position": 640}, config=to_dict(run))
    extra = load_learner(learner, "runs/x/checkpoints/step_000010")
    saved = read_config("runs/x/checkpoints/step_000010")   # the config dict, None when saved without one
"""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

COMMON = "common_state.pt"
DONE = "COMPLETE"
CONFIG = "run_config.json"


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded_state(learner, is_loading: bool, with_optimizer: bool) -> dict:
    model_sd = learner.model.module.sharded_state_dict()
    state = {"model": model_sd}
    if with_optimizer:  # Adam moments exist only after the first step
        state["optimizer"] = learner.optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
    return state


def save_learner(learner, path: str | Path, extra: dict | None = None, *, owner: str | None = None,
                 config: dict | None = None, hf_files: str | Path | None = None) -> Path:
    """Save everything needed to resume; returns the final path. Refuses to overwrite an existing one.
    `owner`: the id of the run saving it (recorded in the manifest; a run resumes only its own checkpoints).
    `config`: the run's resolved config as a plain dict (`config.to_dict(run)`), saved as `run_config.json`.
    `hf_files`: the HF model directory whose config.json and tokenizer are saved under `hf/` (config fitted to the
    learner's dtype), so that `msrl convert mcore-to-hf` of the checkpoint needs no --hf-config."""
    from megatron.core import dist_checkpointing

    from megatron_sparse_rl.learner.integrity import digest_files, write_manifest

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    rank = dist.get_rank()
    if rank == 0:
        if path.exists():
            raise FileExistsError(f"checkpoint {str(path)!r} already exists")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(_sharded_state(learner, is_loading=False, with_optimizer=learner.step > 0), str(tmp))
    torch.save(_rng_state(), tmp / f"rng_rank{rank:05d}.pt")
    if rank == 0:
        torch.save({"step": learner.step, "scheduler": learner.scheduler.state_dict(), "extra": extra or {},
                    "world_size": dist.get_world_size()}, tmp / COMMON)
        if config is not None:
            (tmp / CONFIG).write_text(json.dumps(config, indent=1) + "\n")
        if hf_files is not None:
            from megatron_sparse_rl.checkpoint.hf_writer import write_side_files
            from megatron_sparse_rl.checkpoint.manifest import HF_FILES_DIR

            write_side_files(Path(hf_files), tmp / HF_FILES_DIR, dtype=param_dtype_name(learner))
    dist.barrier()
    files = digest_files(tmp)  # collective: each rank hashes a share of the files
    if rank == 0:
        write_manifest(tmp, files, owner=owner)
        (tmp / DONE).write_text("ok\n")
        os.replace(tmp, path)
    dist.barrier()
    log.info("saved checkpoint %s (step %d)", path, learner.step)
    return path


def param_dtype_name(learner) -> str:
    """The learner's parameter dtype as config.json spells it ("float32", "bfloat16")."""
    return str(next(learner.model.parameters()).dtype).removeprefix("torch.")


def is_complete(path: str | Path) -> bool:
    return (Path(path) / DONE).is_file()


def read_config(path: str | Path) -> dict | None:
    """The run config saved with the checkpoint at `path` (a plain dict); None when it was saved without one
    (by a version before configs were stored, or outside a run). A file that is there but unreadable is an
    error: the checkpoint is damaged."""
    file = Path(path) / CONFIG
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{file}: unreadable ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a mapping of config sections, got {type(data).__name__}")
    return data


def load_learner(learner, path: str | Path, *, load_optimizer: bool = True, load_rng: bool = True) -> dict:
    """Load a checkpoint saved at any parallel layout into `learner`; returns the saved extra state."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not is_complete(path):
        raise FileNotFoundError(f"{str(path)!r} is not a complete checkpoint (no {DONE} marker)")
    common = torch.load(path / COMMON, weights_only=False)
    with_optimizer = load_optimizer and common["step"] > 0
    state = dist_checkpointing.load(_sharded_state(learner, True, with_optimizer), str(path))
    learner.model.module.load_state_dict(state["model"])
    if with_optimizer:
        learner.optimizer.load_state_dict(state["optimizer"])
    learner.step = common["step"]
    if common["step"] > 0:  # resuming a run continues its schedule; a step-0 (e.g. converted) checkpoint
        learner.scheduler.load_state_dict(common["scheduler"])  # leaves this learner's configured one
    rng_file = path / f"rng_rank{dist.get_rank():05d}.pt"
    if load_rng and rng_file.is_file() and common.get("world_size") == dist.get_world_size():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    log.info("loaded checkpoint %s (step %d)", path, learner.step)
    return common["extra"]
