"""Adapter checkpoints in Hugging Face PEFT's format, tied to the base model they were trained on.

    digest = base_digest(model_dir)                        # sha256 of the base's manifest (config + weight files)
    save_adapter(path, learner, lora_cfg, model_dir)       # adapter_model.safetensors + adapter_config.json + ...
    load_adapter(path, learner, model_dir)                 # refuses an adapter of another base, naming both digests

The directory holds:
- `adapter_model.safetensors`: A and B of every adapted Hugging Face linear under PEFT's key names
  (`base_model.model.<HF module>.lora_A.weight` [r, in], `.lora_B.weight` [out, r]), so
  `PeftModel.from_pretrained(hf_model, path)` loads it;
- `adapter_config.json`: PEFT's LoraConfig (r, lora_alpha, lora_dropout, target_modules, ...);
- `base_model.json`: the base model's manifest digest (base_digest) and path;
- `optimizer.safetensors` + `trainer_state.json` (after the first step): every adapter's Adam state by the same keys,
  the learner's step and its LR scheduler, so a resume continues exactly.
The tensors are whole at any tensor and pipeline parallel size (a split adapter is gathered to save, the stages'
adapters collected, and each rank loads its shard of its stage's), so a checkpoint saved at tp 2 or pp 2 loads at
tp 1 and pp 1 and the other way. Only safetensors and JSON: nothing in it
runs code on load. It is written into a temporary directory beside `path`
and renamed into place.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_sparse_rl.formats.manifest import INDEX_SUFFIX, WEIGHT_SUFFIXES
from megatron_sparse_rl.lora.layers import LORA, gather_adapter, shard_adapter, whole_shape

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
BASE = "base_model.json"
OPTIMIZER = "optimizer.safetensors"
STATE = "trainer_state.json"
PREFIX = "base_model.model."
"""What PEFT puts before a Hugging Face module name in the keys it saves."""


def base_digest(model_dir: str | Path) -> str:
    """sha256 of the base model's manifest: the sorted (file name, sha256) of its config.json and weight files
    (tokenizer and generation files do not change the weights an adapter was trained against). Computed once per
    directory state (the files' names, sizes and mtimes), so a run saving adapters every few steps hashes its
    base once."""
    root = Path(model_dir).resolve()
    files = sorted(p for p in root.iterdir() if p.is_file() and (
        p.name == "config.json" or p.name.endswith(WEIGHT_SUFFIXES) or p.name.endswith(INDEX_SUFFIX)))
    if not any(p.name.endswith(WEIGHT_SUFFIXES) for p in files):
        raise FileNotFoundError(f"{root}: no weight files (*.safetensors) to identify the base model by")
    return _digest(root, tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files))


@functools.lru_cache(maxsize=8)
def _digest(root: Path, files: tuple[tuple[str, int, int], ...]) -> str:
    manifest = {}
    for name, _, _ in files:
        h = hashlib.sha256()
        with open(root / name, "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
        manifest[name] = h.hexdigest()
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


def peft_names(learner) -> dict[str, str]:
    """{learner adapter name: PEFT key} for every adapter (`<linear>.lora.A.q_proj` -> `base_model.model.
    model.layers.0.self_attn.q_proj.lora_A.weight`), from the model adapter's tensor maps (the HF module each
    part of a fused Megatron linear comes from)."""
    out = {}
    for tm in learner.adapter.tensor_maps(learner.spec):
        linear = tm.mcore.removesuffix(".weight")
        for hf in tm.hf:
            module = hf.removesuffix(".weight")
            leaf = module.split(".")[-1]
            for ab in ("A", "B"):
                name = f"{linear}.{LORA}.{ab}.{leaf}"
                if name in learner.lora_params:
                    out[name] = f"{PREFIX}{module}.lora_{ab}.weight"
    missing = set(learner.lora_params) - set(out)
    if missing:
        raise ValueError(f"adapters with no Hugging Face module: {sorted(missing)[:3]}")
    return out


def peft_config(lora, base_path: str) -> dict:
    """PEFT's adapter_config.json for `lora` (config.LoraConfig); the learner's adapters have no bias."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_path),
            "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": sorted(lora.target_modules), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "inference_mode": True, "init_lora_weights": True}


def _inner(learner):
    """The torch optimizers under Megatron's (chained) optimizer."""
    return [getattr(o, "optimizer", o) for o in learner._inner_optimizers()]


def _optimizer_state(learner, names: dict[str, str]) -> tuple[dict[str, torch.Tensor], dict]:
    """Each adapter's Adam state, whole: tensors by `<PEFT key>.<state name>`, scalars (per key) and param-group
    settings. Collective over the tp group (a split adapter's state is gathered as the adapter is)."""
    tensors, scalars, groups = {}, {}, []
    by_id = {id(p): n for n, p in learner.lora_params.items()}
    for opt in _inner(learner):
        for group in opt.param_groups:
            groups.append({k: v for k, v in group.items() if k != "params" and isinstance(v, (int, float, bool))})
            for p in group["params"]:  # the groups' order: the same on every tp rank, so the gathers line up
                key = names[by_id[id(p)]]
                for k, v in opt.state.get(p, {}).items():
                    if torch.is_tensor(v) and v.dim() > 0:
                        tensors[f"{key}.{k}"] = gather_adapter(p, learner.groups.tp, v).cpu().contiguous()
                    else:
                        scalars.setdefault(key, {})[k] = float(v)
    return tensors, {"scalars": scalars, "param_groups": groups}


def adapter_files(learner) -> dict:
    """What save_adapter writes, the adapters and their Adam state whole: {"weights": {PEFT key: tensor},
    "optimizer": tensors or None, "state": trainer_state.json or None}. Collective over the tp group (a split
    adapter is gathered) and the pipeline group (each stage holds its layers' adapters): every rank calls it, in the
    same order."""
    names = peft_names(learner)
    weights = {names[n]: gather_adapter(p, learner.groups.tp).cpu().contiguous()
               for n, p in learner.lora_params.items()}
    if learner.step == 0:
        return {"weights": _over_stages(learner, weights), "optimizer": None, "state": None}
    tensors, state = _optimizer_state(learner, names)
    scalars = _over_stages(learner, state["scalars"])
    return {"weights": _over_stages(learner, weights), "optimizer": _over_stages(learner, tensors),
            "state": {"step": learner.step, "scheduler": learner.scheduler.state_dict(), **state,
                      "scalars": scalars}}


def _over_stages(learner, mine: dict) -> dict:
    """The union of every pipeline stage's `mine` (disjoint keys: each stage its own layers); `mine` at pp 1."""
    if learner.layout.pp == 1:
        return mine
    every: list = [None] * learner.layout.pp
    dist.all_gather_object(every, mine, group=learner.groups.pp)
    return {k: v for stage in every for k, v in stage.items()}


def write_adapter(path: str | Path, files: dict, lora, base_path: str | Path) -> Path:
    """Write `files` (adapter_files) to `path` in PEFT's format, with the digest of the base at `base_path`. Refuses
    to overwrite an existing directory."""
    from safetensors.torch import save_file

    path = Path(path)
    if path.exists():
        raise FileExistsError(f"adapter checkpoint {str(path)!r} already exists")
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(files["weights"], str(tmp / WEIGHTS), metadata={"format": "pt"})
    (tmp / CONFIG).write_text(json.dumps(peft_config(lora, str(base_path)), indent=1) + "\n")
    (tmp / BASE).write_text(json.dumps({"base_sha256": base_digest(base_path), "base_path": str(base_path)},
                                       indent=1) + "\n")
    if files["state"] is not None:
        save_file(files["optimizer"], str(tmp / OPTIMIZER), metadata={"format": "pt"})
        (tmp / STATE).write_text(json.dumps(files["state"], indent=1) + "\n")
    os.replace(tmp, path)
    return path


def save_adapter(path: str | Path, learner, lora, base_path: str | Path) -> Path:
    """Write the learner's adapters (and, after a step, their optimizer state) to `path` in PEFT's format, with the
    digest of the base at `base_path`. Every rank of the learner calls it (the split adapters are gathered over
    tp); global rank 0 writes. Refuses to overwrite an existing directory."""
    files = adapter_files(learner)
    if not dist.is_initialized() or dist.get_rank() == 0:
        write_adapter(path, files, lora, base_path)
    return Path(path)


def _read_json(file: Path) -> dict:
    try:
        doc = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{file}: unreadable ({e})") from e
    if not isinstance(doc, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return doc


def check_base(path: str | Path, base_path: str | Path) -> str:
    """The base digest recorded in adapter checkpoint `path`; ValueError naming both digests when the base at
    `base_path` is another model."""
    file = Path(path) / BASE
    saved = _read_json(file).get("base_sha256")
    have = base_digest(base_path)
    if saved != have:
        raise ValueError(f"{file}: base_sha256 {saved} was saved with this adapter, but the base model at "
                         f"{base_path} has manifest sha256 {have}: an adapter loads only onto the base it was "
                         "trained on")
    return saved


def load_adapter(path: str | Path, learner, base_path: str | Path, *, load_optimizer: bool = True) -> None:
    """Load adapter checkpoint `path` into the learner's adapters (and, with `load_optimizer`, their Adam state,
    step and scheduler). Refused: another base (check_base), a rank or target set that differs from the
    learner's, a missing or extra tensor (each naming the file)."""
    from safetensors.torch import load_file

    path = Path(path)
    check_base(path, base_path)
    names = peft_names(learner)
    tensors = load_file(str(path / WEIGHTS))
    want = set(_over_stages(learner, dict.fromkeys(names.values())))  # every stage's adapters
    if set(tensors) != want:
        raise ValueError(f"{path / WEIGHTS}: tensors differ from the learner's adapters (model.lora.target_modules): "
                         f"missing {sorted(want - set(tensors))[:3]}, extra {sorted(set(tensors) - want)[:3]}")
    group = learner.groups.tp
    with torch.no_grad():
        for n, p in learner.lora_params.items():
            t = tensors[names[n]]
            if t.shape != whole_shape(p, group):
                raise ValueError(f"{path / WEIGHTS}: {names[n]} has shape {list(t.shape)}, the learner's adapter "
                                 f"{list(whole_shape(p, group))} (model.lora.rank)")
            p.copy_(shard_adapter(p, t, group))
    if load_optimizer and (path / STATE).exists():
        _load_optimizer(path, learner, names)


def _load_optimizer(path: Path, learner, names: dict[str, str]) -> None:
    from safetensors.torch import load_file

    state = _read_json(path / STATE)
    tensors = load_file(str(path / OPTIMIZER))
    groups = iter(state["param_groups"])
    for opt in _inner(learner):
        for group in opt.param_groups:
            group.update(next(groups))
            for p in group["params"]:
                key = names[next(n for n, q in learner.lora_params.items() if q is p)]
                entry = {k.removeprefix(f"{key}."): v for k, v in tensors.items() if k.startswith(f"{key}.")}
                for k, v in state["scalars"].get(key, {}).items():
                    entry[k] = torch.tensor(v)
                opt.state[p] = {k: (shard_adapter(p, v, learner.groups.tp) if v.dim() > 0 else v).clone()
                                for k, v in entry.items()}
    learner.step = state["step"]
    learner.scheduler.load_state_dict(state["scheduler"])
