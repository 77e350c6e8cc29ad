"""Read Hugging Face safetensors checkpoints (single file or sharded with an index json) lazily.

`iter_mcore_tensors` walks the adapter's tensor map and yields full Megatron tensors one at a time, opening
only the HF tensors each one needs, so peak memory is about one (fused) tensor, not the model.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator

import torch

from megatron_sparse_rl.models.base import GPTAdapter
from megatron_sparse_rl.models.spec import ModelSpec
from megatron_sparse_rl.models.tensor_map import to_mcore

INDEX = "model.safetensors.index.json"
# safetensors header dtype code -> (torch dtype name, bytes per element)
DTYPE_CODES = {"F32": ("float32", 4), "BF16": ("bfloat16", 2), "F16": ("float16", 2), "F64": ("float64", 8),
           "I64": ("int64", 8), "I32": ("int32", 4), "I8": ("int8", 1), "U8": ("uint8", 1), "BOOL": ("bool", 1)}


class HFCheckpoint:
    """Name -> file index of a HF safetensors checkpoint, with lazy per-tensor reads."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        index = self.dir / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"{index}: not a valid safetensors index ({e})") from None
        elif (self.dir / "model.safetensors").is_file():
            weight_map = {name: "model.safetensors" for name in self._keys(self.dir / "model.safetensors")}
        else:
            raise FileNotFoundError(f"{self.dir}: no model.safetensors or {INDEX}")
        self.weight_map: dict[str, str] = weight_map
        self._handles: dict[str, object] = {}

    @staticmethod
    def _keys(file: Path) -> list[str]:
        from safetensors import safe_open

        try:
            with safe_open(str(file), "pt") as f:
                return list(f.keys())
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ValueError(f"{file}: not a readable safetensors file ({e})") from None

    def _handle(self, file: str):
        from safetensors import safe_open

        if file not in self._handles:
            path = self.dir / file
            if not path.is_file():
                raise FileNotFoundError(f"{self.dir}: shard {file!r} named in {INDEX} is missing")
            try:
                self._handles[file] = safe_open(str(path), "pt")
            except Exception as e:
                raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
        return self._handles[file]

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise KeyError(f"{self.dir}: tensor {name!r} is not in the checkpoint")
        try:
            return self._handle(self.weight_map[name]).get_tensor(name)
        except Exception as e:
            if isinstance(e, (KeyError, FileNotFoundError)):
                raise
            raise ValueError(f"{self.dir}: cannot read tensor {name!r} from {self.weight_map[name]} ({e})") from None

    def names(self) -> list[str]:
        return list(self.weight_map)

    def raw_header(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype code such as "BF16", shape) of tensor `name` from its file header, no data read."""
        if name not in self.weight_map:
            raise KeyError(f"{self.dir}: tensor {name!r} is not in the checkpoint")
        info = self._handle(self.weight_map[name]).get_slice(name)
        return info.get_dtype(), tuple(info.get_shape())

    def header(self, name: str) -> tuple[str, tuple[int, ...], int]:
        """(dtype name, shape, bytes) of tensor `name` from its file header, without reading the data."""
        code, shape = self.raw_header(name)
        if code not in DTYPE_CODES:
            raise ValueError(f"{self.dir}: tensor {name!r} has dtype {code}; supported: {', '.join(DTYPE_CODES)}")
        dtype, size = DTYPE_CODES[code]
        numel = 1
        for d in shape:
            numel *= d
        return dtype, shape, numel * size


def iter_mcore_tensors(model_dir, adapter: GPTAdapter, spec: ModelSpec,
                       wanted: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (full Megatron name, tensor) for each adapter tensor map (only `wanted` names if given)."""
    ckpt = HFCheckpoint(model_dir)
    wanted = set(wanted) if wanted is not None else None
    for tm in adapter.tensor_maps(spec):
        if wanted is not None and tm.mcore not in wanted:
            continue
        yield tm.mcore, to_mcore(tm, [ckpt.get(n) for n in tm.hf], spec)
