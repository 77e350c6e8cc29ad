"""Distributed checkpoints of a Learner: model + optimizer (torch_dist, any layout reloads at any layout),
LR schedule, step, per-rank RNG states and caller-provided extra state. Atomic: written to a temporary
directory beside the target, renamed into place once every rank has finished. Every file's size and sha256 and
the id of the run that saved it go into `MANIFEST.json` (learner/integrity.py), so a damaged or foreign
checkpoint is recognised before it is loaded. A run's checkpoint also holds the run's resolved config
(`run_config.json`, covered by the manifest), which a resume compares with its own (run/run_dir.py).

    save_learner(learner, "runs/x/checkpoints/step_000010", extra={"data_position": 640}, config=to_dict(run))
    extra = load_learner(learner, "runs/x/checkpoints/step_000010")
    saved = read_config("runs/x/checkpoints/step_000010")   # the config dict, None when saved without one

No file of ours runs code when read: the step, LR schedule and extra state are JSON (`common_state.json`), each
rank's RNG states safetensors plus JSON (`rng_rank*.safetensors`). Megatron's files (`.metadata`, `common.pt`, the
byte items in `*.distcp`) are pickles: `load_learner` reads every one through `formats/safe_load.py`'s
allowlists before loading, and loads with `patches/torch_dist_safe_load.py` applied, so a file needing anything
else is refused by name (UnsafeFileError). Checkpoints written before these formats (`common_state.pt`,
`rng_rank*.pt`) still load, with torch.load(weights_only=True).
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

from megatron_sparse_rl.formats.hf_writer import write_side_files
from megatron_sparse_rl.formats.manifest import HF_FILES_DIR
from megatron_sparse_rl.formats.safe_load import check_checkpoint_files, load_torch_file
from megatron_sparse_rl.learner.chunks import load_sharded, sharded_state_dict
from megatron_sparse_rl.learner.integrity import DONE, digest_files, write_manifest
from megatron_sparse_rl.lora.checkpoint import adapter_files, write_adapter
from megatron_sparse_rl.patches import megatron_ckpt_queue, torch_dist_safe_load

log = logging.getLogger(__name__)

COMMON = "common_state.json"
COMMON_FORMAT = "msrl-common-state"
RNG_FORMAT = "msrl-rng-state"
LEGACY_COMMON = "common_state.pt"  # the torch.save formats of checkpoints written before the JSON/safetensors ones
CONFIG = "run_config.json"


class StateFileError(ValueError):
    """A checkpoint's own state file (common_state.json, an RNG file) does not hold what it must; the message names
    the file and the field. Raised before anything of the checkpoint is loaded."""


def rng_file(path: Path, rank: int, legacy: bool = False) -> Path:
    return path / f"rng_rank{rank:05d}.{'pt' if legacy else 'safetensors'}"


def _save_rng(file: Path) -> None:
    """This process's python, numpy, torch and Megatron-tracker RNG states: tensors in safetensors, the python and
    numpy states as JSON in its metadata (every value an int or a float, which JSON keeps exactly)."""
    from megatron.core import tensor_parallel
    from safetensors.torch import save_file

    version, keys, gauss = random.getstate()
    kind, np_keys, pos, has_gauss, cached = np.random.get_state()
    tensors = {"torch": torch.get_rng_state()}
    for name, state in tensor_parallel.get_cuda_rng_tracker().get_states().items():
        tensors[f"tracker.{name}"] = state.detach().cpu().clone()
    save_file(tensors, str(file), metadata={
        "format": RNG_FORMAT, "python": json.dumps([version, list(keys), gauss]),
        "numpy": json.dumps([kind, np_keys.tolist(), pos, has_gauss, cached])})


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _read_rng(file: Path) -> dict:
    """The states `_save_rng` wrote, in the form `_set_rng_state` takes; StateFileError naming the file and the field
    when one is not the state its generator takes (`_check_rng_state`)."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        if meta.get("format") != RNG_FORMAT:
            raise ValueError(f"no \"format\": \"{RNG_FORMAT}\" in its metadata")
        python, numpy = _json_list(file, meta, "python", 3), _json_list(file, meta, "numpy", 5)
    except StateFileError:
        raise
    except Exception as e:  # noqa: BLE001 - SafetensorError, KeyError, ValueError: a damaged file
        raise StateFileError(f"{file}: damaged RNG state ({type(e).__name__}: {e})") from None
    version, keys, gauss = python
    kind, np_keys, pos, has_gauss, cached = numpy
    np_keys = np.asarray(np_keys, dtype=np.uint32) if _uint32s(np_keys) else np_keys  # else refused as it is
    state = {"python": (version, tuple(keys) if isinstance(keys, list) else keys, gauss),
             "numpy": (kind, np_keys, pos, has_gauss, cached), "torch": tensors.pop("torch", None),
             "tracker": {k.removeprefix("tracker."): v for k, v in tensors.items()}}
    _check_rng_state(file, state)
    return state


def _json_list(file: Path, meta: dict, field: str, length: int) -> list:
    value = json.loads(meta[field])
    if not isinstance(value, list) or len(value) != length:
        raise StateFileError(f"{file}: field {field!r} must be a JSON list of {length} items (got "
                             f"{meta[field][:80]!r})")
    return value


def _uint32s(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and 0 <= v < 2**32 for v in value)


def _check_rng_state(file: Path, state) -> None:
    """StateFileError naming `file` and the field unless each state is one its generator takes: the python and numpy
    states and the torch CPU state are set on fresh generators of their own (the libraries are the judges), each
    Megatron-tracker state must be a 1-D uint8 tensor (a CPU or a CUDA generator's state)."""
    import random as random_module

    import torch

    if not isinstance(state, dict):
        raise StateFileError(f"{file}: expected a mapping of RNG states, got {type(state).__name__}")
    checks = {"python": lambda v: random_module.Random().setstate(v),
              "numpy": lambda v: np.random.RandomState().set_state(v),
              "torch": lambda v: torch.Generator().set_state(v)}
    for field, check in checks.items():
        try:
            check(state.get(field))
        except Exception as e:  # noqa: BLE001 - TypeError, ValueError, RuntimeError: not that generator's state
            raise StateFileError(f"{file}: field {field!r} is not a {field} RNG state ({type(e).__name__}: "
                                 f"{' '.join(str(e).split())[:200]})") from None
    tracker = state.get("tracker")
    if not isinstance(tracker, dict):
        raise StateFileError(f"{file}: field 'tracker' must be a mapping of RNG-tracker states (got "
                             f"{type(tracker).__name__})")
    for name, value in tracker.items():
        if not (isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1 and value.numel()):
            shown = f"{value.dtype} of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
            raise StateFileError(f"{file}: field 'tracker.{name}' must be an RNG state (a 1-D uint8 tensor), got "
                                 f"{shown[:200]}")


def _numpy_rng_types() -> tuple:
    """What a numpy RNG state pickles as (the legacy rng_rank*.pt files): an array of uint32 and its dtype."""
    from numpy.dtypes import UInt32DType

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1.x
        from numpy.core.multiarray import _reconstruct
    return (_reconstruct, np.ndarray, np.dtype, UInt32DType)


def _read_rank_rng(path: Path, rank: int) -> dict | None:
    """This rank's RNG states in the checkpoint at `path`, checked (`_check_rng_state`); None when it holds none."""
    if (file := rng_file(path, rank)).is_file():
        return _read_rng(file)
    if (file := rng_file(path, rank, legacy=True)).is_file():
        state = load_torch_file(file, allow=_numpy_rng_types())
        _check_rng_state(file, state)
        return state
    return None


def _load_rng(path: Path, rank: int) -> bool:
    """Restore this rank's RNG states from the checkpoint at `path`; False when it holds none for this rank."""
    state = _read_rank_rng(path, rank)
    if state is not None:
        _set_rng_state(state)
    return state is not None


def write_common_state(path: Path, state: dict) -> None:
    """Write `state` (step, scheduler, extra, world_size) as `<path>/common_state.json`. Refuses what JSON would
    not give back as it was (a tuple, a non-string key, an object), naming the file."""
    payload = {"format": COMMON_FORMAT, **state}
    try:
        text = json.dumps(payload, indent=1)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{path / COMMON}: the common state must be JSON data ({e})") from None
    if repr(json.loads(text)) != repr(payload):
        raise TypeError(f"{path / COMMON}: the common state would not read back as saved (a tuple or a non-string "
                        "key): use lists and string keys")
    (path / COMMON).write_text(text + "\n")


def read_common_state(path: str | Path) -> dict:
    """The common state of the checkpoint at `path` (`common_state.json`, or a legacy `common_state.pt` read with
    weights_only=True). A damaged file raises ValueError, one needing code UnsafeFileError, both naming it."""
    path = Path(path)
    file, legacy = path / COMMON, path / LEGACY_COMMON
    if not file.is_file() and legacy.is_file():
        data = load_torch_file(legacy)
        if not isinstance(data, dict) or "step" not in data:
            raise StateFileError(f"{legacy}: damaged common state (no step)")
        _check_common_state(legacy, data)
        return data
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise StateFileError(f"{file}: unreadable common state ({e})") from None
    if not isinstance(data, dict) or data.get("format") != COMMON_FORMAT or "step" not in data:
        raise StateFileError(f"{file}: not a checkpoint common state (format {COMMON_FORMAT!r} with a step)")
    _check_common_state(file, data)
    return data


def _check_common_state(file: Path, data: dict) -> None:
    """StateFileError naming `file` and the field unless step is an integer >= 0, scheduler and extra are mappings
    and world_size, when there, an integer >= 1 (what `save_learner` writes; `load_learner` relies on each)."""
    def integer(low):
        return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low

    rules = {"step": (integer(0), "an integer >= 0"), "scheduler": (lambda v: isinstance(v, dict), "a mapping"),
             "extra": (lambda v: isinstance(v, dict), "a mapping"), "world_size": (integer(1), "an integer >= 1")}
    for field, (ok, rule) in rules.items():
        if field == "world_size" and field not in data:  # optional: without it the RNG states are not restored
            continue
        if field not in data or not ok(data[field]):
            got = f"{data[field]!r:.200}" if field in data else "nothing"
            raise StateFileError(f"{file}: field {field!r} must be {rule} (got {got})")


def has_common_state(path: str | Path) -> bool:
    return (Path(path) / COMMON).is_file() or (Path(path) / LEGACY_COMMON).is_file()


def _sharded_state(learner, is_loading: bool, with_optimizer: bool) -> dict:
    model_sd = sharded_state_dict(learner.model)  # model chunks (parallel.vpp > 1): model0, model1, ...
    state = {"model": model_sd}
    if with_optimizer:  # Adam moments exist only after the first step
        state["optimizer"] = learner.optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
    return state


ADAPTER_DIR = "adapter"
"""Where a LoRA learner's checkpoint (with `hf_files`) also holds its adapters alone, in PEFT's format."""


def temporary_path(path: str | Path) -> Path:
    """Where `save_learner` writes the checkpoint for `path` before renaming it into place."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp")


def save_learner(learner, path: str | Path, extra: dict | None = None, *, owner: str | None = None,
                 config: dict | None = None, hf_files: str | Path | None = None) -> Path:
    """Save everything needed to resume; returns the final path. Refuses to overwrite an existing one.
    `owner`: the id of the run saving it (recorded in the manifest; a run resumes only its own checkpoints).
    `config`: the run's resolved config as a plain dict (`config.to_dict(run)`), saved as `run_config.json`.
    `hf_files`: the HF model directory whose config.json and tokenizer are saved under `hf/` (config fitted to the
    learner's dtype), so that `msrl convert mcore-to-hf` of the checkpoint needs no --hf-config; a LoRA learner's
    adapters are then also saved alone under `adapter/` (lora/checkpoint.py: PEFT's format, the base's digest)."""
    from megatron.core import dist_checkpointing

    megatron_ckpt_queue.apply()  # the writer's results queue in this process: no server for a stop signal to kill
    path = Path(path)
    tmp = temporary_path(path)
    rank = dist.get_rank()
    if rank == 0:
        if path.exists():
            raise FileExistsError(f"checkpoint {str(path)!r} already exists")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    # the adapters alone too, in PEFT's format, tied to this base: gathered whole on every rank (over tp)
    adapter = adapter_files(learner) if hf_files is not None and learner.lora_params else None
    dist_checkpointing.save(_sharded_state(learner, is_loading=False, with_optimizer=learner.step > 0), str(tmp))
    _save_rng(rng_file(tmp, rank))
    if rank == 0:
        write_common_state(tmp, {"step": learner.step, "scheduler": learner.scheduler.state_dict(),
                                 "extra": extra or {}, "world_size": dist.get_world_size()})
        if config is not None:
            (tmp / CONFIG).write_text(json.dumps(config, indent=1) + "\n")
        if hf_files is not None:
            write_side_files(Path(hf_files), tmp / HF_FILES_DIR, dtype=param_dtype_name(learner))
            if adapter is not None:
                write_adapter(tmp / ADAPTER_DIR, adapter, learner.lora, hf_files)
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
    """Load a checkpoint saved at any parallel layout into `learner`; returns the saved extra state. Every pickle
    in it is read through the allowlists first (a file needing anything else raises UnsafeFileError naming it)."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    if not is_complete(path):
        raise FileNotFoundError(f"{str(path)!r} is not a complete checkpoint (no {DONE} marker)")
    torch_dist_safe_load.apply()
    check_checkpoint_files(path)
    common = read_common_state(path)
    same_layout = load_rng and common.get("world_size") == dist.get_world_size()
    rng = _read_rank_rng(path, dist.get_rank()) if same_layout else None  # checked before anything is loaded
    with_optimizer = load_optimizer and common["step"] > 0
    state = dist_checkpointing.load(_sharded_state(learner, True, with_optimizer), str(path))
    load_sharded(learner.model, state["model"])
    if with_optimizer:
        learner.optimizer.load_state_dict(state["optimizer"])
    learner.step = common["step"]
    if common["step"] > 0:  # resuming a run continues its schedule; a step-0 (e.g. converted) checkpoint
        learner.scheduler.load_state_dict(common["scheduler"])  # leaves this learner's configured one
    if rng is not None:
        _set_rng_state(rng)
    log.info("loaded checkpoint %s (step %d)", path, learner.step)
    return common["extra"]
