"""Merge a PEFT-format LoRA adapter into its Hugging Face base and write the merged model (`msrl convert merge-lora`).

    merge_adapter(base_dir, adapter_dir, out_dir)   # every adapted weight W -> W + (alpha / r) x B A

The adapter is one saved by lora/checkpoint.py: its base digest must be the base's (check_base refuses another
base, naming both digests). The arithmetic is PEFT's `merge_and_unload` on a LoRA Linear (merged_weight), so the
merged tensors equal PEFT's bit for bit. Every other tensor, the config and the tokenizer files
are copied unchanged. Written to `.<out>.tmp` and renamed; only safetensors and JSON are read.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from megatron_sparse_rl.formats.manifest import copy_side_files
from megatron_sparse_rl.lora.checkpoint import CONFIG, PREFIX, WEIGHTS, _read_json, check_base


def merge_scale(config: dict, file: Path) -> float:
    """alpha / r from PEFT's adapter_config.json; ValueError naming the file and field for what this merge does not
    implement (another PEFT type, DoRA, rsLoRA, fan_in_fan_out, per-module ranks or alphas, a bias)."""
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{file}: peft_type must be 'LORA' (got {config.get('peft_type')!r})")
    for field, allowed in (("use_dora", False), ("use_rslora", False), ("fan_in_fan_out", False), ("bias", "none")):
        if config.get(field, allowed) != allowed:
            raise ValueError(f"{file}: {field} must be {allowed!r} to merge here (got {config[field]!r})")
    for field in ("rank_pattern", "alpha_pattern"):
        if config.get(field):
            raise ValueError(f"{file}: {field} must be empty (one rank and alpha for every module)")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"{file}: r must be an integer >= 1 and lora_alpha a number > 0 (got r {r!r}, "
                         f"lora_alpha {alpha!r})")
    return alpha / r


def merged_weight(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale x B A as PEFT's LoRA Linear merges it (get_delta_weight, then `weight += delta`): B @ A in the
    adapters' dtype (upcast to float32 when they are bf16/fp16, the delta cast back), times scale; the sum in the
    promoted dtype of W and the delta, rounded to W's dtype."""
    low = b.dtype in (torch.bfloat16, torch.float16)
    delta = (b.float() @ a.float()) * scale if low else (b @ a) * scale
    if low:
        delta = delta.to(b.dtype)
    return (w + delta).to(w.dtype)


def _pairs(adapter: dict[str, torch.Tensor], file: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{HF weight name: (A, B)} from PEFT's keys."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in adapter.items():
        module, dot, ab = key.removeprefix(PREFIX).rpartition(".lora_")
        if not key.startswith(PREFIX) or not dot or ab not in ("A.weight", "B.weight"):
            raise ValueError(f"{file}: {key!r} is not a PEFT LoRA key "
                             f"({PREFIX}<module>.lora_A.weight / .lora_B.weight)")
        out.setdefault(f"{module}.weight", {})[ab[0]] = t
    lonely = [k for k, v in out.items() if len(v) != 2]
    if lonely:
        raise ValueError(f"{file}: {lonely[0]} has only one of lora_A and lora_B")
    return {k: (v["A"], v["B"]) for k, v in out.items()}


def merge_adapter(base_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path, *,
                  overwrite: bool = False) -> Path:
    """Write base + adapter merged as a Hugging Face model at `out_dir`; returns it. Refused: an adapter of another
    base, a PEFT option the merge does not implement, an adapted module the base lacks or of another shape."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    base, adapter, out = Path(base_dir), Path(adapter_dir), Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists (pass --overwrite to replace it)")
    check_base(adapter, base)
    scale = merge_scale(_read_json(adapter / CONFIG), adapter / CONFIG)
    pairs = _pairs(load_file(str(adapter / WEIGHTS)), adapter / WEIGHTS)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    copy_side_files(base, tmp)
    for index in base.glob("*.safetensors.index.json"):
        shutil.copy2(index, tmp / index.name)
    done = set()
    for file in sorted(base.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
        for name in pairs.keys() & tensors.keys():
            a, b = pairs[name]
            w = tensors[name]
            if w.dim() != 2 or a.shape[1] != w.shape[1] or b.shape[0] != w.shape[0] or a.shape[0] != b.shape[1]:
                raise ValueError(f"{adapter / WEIGHTS}: {name}: A {list(a.shape)} and B {list(b.shape)} do not fit "
                                 f"the base weight {list(w.shape)} in {file.name}")
            tensors[name] = merged_weight(w, a, b, scale)
            done.add(name)
        save_file(tensors, str(tmp / file.name), metadata=metadata)
    if done != pairs.keys():
        shutil.rmtree(tmp)
        raise ValueError(f"{adapter / WEIGHTS}: the base at {base} has no weight {sorted(pairs.keys() - done)[0]!r}")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
