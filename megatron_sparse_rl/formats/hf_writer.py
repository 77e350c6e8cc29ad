"""Write HF safetensors streaming: tensors are appended one at a time and flushed into shards of at most
`max_shard_bytes` (one `model.safetensors` when everything fits, else `model-0000i-of-0000n.safetensors` plus
`model.safetensors.index.json`, the layout transformers writes). Peak memory is about one shard.

    w = ShardedSafetensorsWriter(tmp_dir, max_shard_bytes=5 * 2**30)
    for name, t in tensors: w.add(name, t)
    digests = w.finish()       # re-reads every written tensor and returns name -> sha256 of what is on disk

    write_side_files(src_dir, out_dir)   # config.json (fitted to the written weights), tokenizer, ...

The exported weights are plain float tensors (never fp8) of the model's layers only (no multi-token-prediction
layers), so the written config.json drops `quantization_config` and sets `num_nextn_predict_layers` to 0.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from megatron_sparse_rl.formats.hf_io import INDEX
from megatron_sparse_rl.formats.manifest import copy_side_files, tensor_digest
from megatron_sparse_rl.models import get_adapter

log = logging.getLogger(__name__)

SINGLE = "model.safetensors"


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '2GiB', '123' -> bytes."""
    if isinstance(text, int):
        return text
    s = text.strip().upper()
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "TB": 10**12, "B": 1}
    for unit, mult in units.items():
        if s.endswith(unit):
            num = s[: -len(unit)].strip()
            break
    else:
        num, mult = s, 1
    try:
        value = int(float(num) * mult)
    except ValueError:
        raise ValueError(f"--max-shard-size must be a size like 5GB, 500MB or 1048576 (got {text!r})") from None
    if value <= 0:
        raise ValueError(f"--max-shard-size must be > 0 (got {text!r})")
    return value


class ShardedSafetensorsWriter:
    def __init__(self, out_dir: Path, max_shard_bytes: int):
        self.out_dir = Path(out_dir)
        self.max = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._pending or any(name in s for s in self._shards):
            raise ValueError(f"tensor {name!r} written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max:
            self._flush()
        self._pending[name] = tensor.detach().cpu().contiguous()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        idx = len(self._shards)
        save_file(self._pending, str(self.out_dir / f".shard{idx:05d}.tmp"), metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def finish(self) -> dict[str, str]:
        """Write the last shard, name the files, write the index; returns name -> sha256 read back from disk."""
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        files = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for i, final in enumerate(files):
            (self.out_dir / f".shard{i:05d}.tmp").rename(self.out_dir / final)
            (self.out_dir / final).chmod(0o644)  # safetensors writes 0600; a model dir is meant to be shared
        if n > 1:
            weight_map = {name: files[i] for i, names in enumerate(self._shards) for name in names}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.out_dir / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        return self._read_back(files)

    def _read_back(self, files: list[str]) -> dict[str, str]:
        from safetensors import safe_open

        digests = {}
        for file, names in zip(files, self._shards):
            with safe_open(str(self.out_dir / file), "pt") as f:
                for name in names:
                    digests[name] = tensor_digest(f.get_tensor(name))
        return digests


def export_config(cfg: dict, dtype: str | None = None) -> tuple[dict, list[str]]:
    """The config.json of an exported checkpoint made from `cfg` (a copy), and what was changed: no
    `quantization_config` (the weights are written dequantised), `num_nextn_predict_layers` 0 (the MTP layers
    of a release checkpoint are not part of the model and are not written), the keys the model adapter assumes that
    `cfg` lacks (`GPTAdapter.config_defaults`: DeepSeek-V3's router, which vLLM needs) and, given `dtype` (e.g.
    "float32"), the dtype the weights are written in."""
    out, changes = dict(cfg), []
    if defaults := get_adapter(out).config_defaults(out):
        out.update(defaults)
        changes.append(f"{', '.join(f'{k}: {v!r}' for k, v in defaults.items())} added: what the model was built "
                       "with (absent, vLLM would read the model differently)")
    if dtype is not None:
        keys = [k for k in ("dtype", "torch_dtype") if k in out] or ["dtype"]
        for key in keys:
            if out.get(key) != dtype:
                changes.append(f"{key} {out.get(key)} -> {dtype}: the weights are written in {dtype}")
                out[key] = dtype
    if "quantization_config" in out:
        q = out.pop("quantization_config")
        method = q.get("quant_method") if isinstance(q, dict) else q
        changes.append(f"quantization_config ({method}) dropped: the weights are written dequantised")
    if (mtp := out.get("num_nextn_predict_layers") or 0) > 0:
        out["num_nextn_predict_layers"] = 0
        changes.append(f"num_nextn_predict_layers {mtp} -> 0: multi-token-prediction layers are not exported")
    return out, changes


def write_side_files(src: Path, dst: Path, dtype: str | None = None) -> list[str]:
    """Copy the side files of HF dir `src` (config, tokenizer, ...) into `dst`, with config.json fitted to the
    exported weights (`export_config`, with the weights' `dtype` when given; the changes are logged). Returns the
    files' names."""
    names = copy_side_files(src, dst)
    path = Path(dst) / "config.json"
    cfg, changes = export_config(json.loads(path.read_text()), dtype)
    if changes:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(cfg, indent=2) + "\n")
        os.replace(tmp, path)
        log.info("%s: %s", path, "; ".join(changes))
    return names
