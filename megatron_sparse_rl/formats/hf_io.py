"""Read Hugging Face safetensors checkpoints (single file or sharded with an index json) lazily.

`HFCheckpoint.get(name)` returns the model's weight: in a block-wise fp8 release checkpoint (DeepSeek-V3 /
Kimi-K2: `quantization_config` in config.json) an F8_E4M3 weight comes back dequantised to float32 with its
`<name>_scale_inv` companion (`formats/fp8.py`), and `header(name)` reports that float32 tensor. The scales
are consumed, never yielded as tensors of their own. Multi-token-prediction layers of such a checkpoint are not
part of the model: `skip_mtp_layers` names them (one log line) so the readers and checks pass over them.

`iter_mcore_tensors` walks the adapter's tensor map and yields full Megatron tensors one at a time, opening
only the HF tensors each one needs, so peak memory is about one (fused) tensor, not the model.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterable, Iterator

import torch

from megatron_sparse_rl.formats import fp8
from megatron_sparse_rl.formats.json_file import read_json
from megatron_sparse_rl.models.base import GPTAdapter
from megatron_sparse_rl.models.spec import ModelSpec
from megatron_sparse_rl.models.tensor_map import to_mcore

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
# safetensors header dtype code -> (torch dtype name, bytes per element)
DTYPE_CODES = {"F32": ("float32", 4), "BF16": ("bfloat16", 2), "F16": ("float16", 2), "F64": ("float64", 8),
               "I64": ("int64", 8), "I32": ("int32", 4), "I8": ("int8", 1), "U8": ("uint8", 1), "BOOL": ("bool", 1)}


def _quantisation(model_dir: Path) -> fp8.BlockFp8 | None:
    """The block-wise fp8 format named by `model_dir`/config.json (None without config.json or quantization_config)."""
    config = model_dir / "config.json"
    if not config.is_file():
        return None
    cfg = read_json(config, "not a readable config.json")
    return fp8.BlockFp8.from_config(cfg, str(config)) if isinstance(cfg, dict) else None


class HFCheckpoint:
    """Name -> file index of a HF safetensors checkpoint, with lazy per-tensor reads. `weight_map` lists every
    stored tensor (fp8 scales and MTP layers included); `fp8` is the checkpoint's block-wise fp8 format or None."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        index = self.dir / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, KeyError, TypeError) as e:
                raise ValueError(f"{index}: not a valid safetensors index ({e})") from None
        elif (self.dir / "model.safetensors").is_file():
            weight_map = {name: "model.safetensors" for name in self._keys(self.dir / "model.safetensors")}
        else:
            raise FileNotFoundError(f"{self.dir}: no model.safetensors or {INDEX}")
        self.weight_map: dict[str, str] = weight_map
        self.fp8 = _quantisation(self.dir)
        if orphans := fp8.orphan_scales(weight_map):
            raise ValueError(f"{self.dir}: {len(orphans)} fp8 scale tensor(s) without their weight, e.g. "
                             f"{orphans[0]!r} (in {weight_map[orphans[0]]}) but no "
                             f"{orphans[0].removesuffix(fp8.SCALE_SUFFIX)!r}")
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

    def _read(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise KeyError(f"{self.dir}: tensor {name!r} is not in the checkpoint")
        try:
            return self._handle(self.weight_map[name]).get_tensor(name)
        except Exception as e:
            if isinstance(e, (KeyError, FileNotFoundError)):
                raise
            raise ValueError(f"{self.dir}: cannot read tensor {name!r} from {self.weight_map[name]} ({e})") from None

    def _is_quantised(self, name: str, code: str) -> bool:
        return code.startswith("F8_") or (self.fp8 is not None and fp8.scale_name(name) in self.weight_map)

    def fp8_problem(self, name: str) -> str | None:
        """Why weight `name` cannot be read as a plain or dequantised float tensor, fp8-wise (headers only): an fp8
        weight without quantization_config or without its scale, a scale of the wrong shape or dtype, a scale on
        a weight that is not fp8. None when there is nothing wrong."""
        code, shape = self.raw_header(name)
        sname = fp8.scale_name(name)
        scale = self.raw_header(sname) if sname in self.weight_map else None
        if self.fp8 is None:
            if code.startswith("F8_"):
                return (f"is {code} but {self.dir / 'config.json'} has no quantization_config (fp8 weights are read "
                        "only from block-wise quantised checkpoints: quant_method fp8, fmt e4m3, weight_block_size)")
            return None
        return self.fp8.pair_problem(name, code, shape, scale)

    def get(self, name: str) -> torch.Tensor:
        """Tensor `name` as the model holds it: an fp8 weight dequantised to float32 with its scale."""
        code, _ = self.raw_header(name)
        if not self._is_quantised(name, code):
            return self._read(name)
        if problem := self.fp8_problem(name):
            raise ValueError(f"{self.dir}: tensor {name!r} (in {self.weight_map[name]}) {problem}")
        return self.fp8.dequantize(name, self._read(name), self._read(fp8.scale_name(name)))

    def names(self) -> list[str]:
        return list(self.weight_map)

    def raw_header(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype code such as "BF16", shape) of tensor `name` from its file header, no data read."""
        if name not in self.weight_map:
            raise KeyError(f"{self.dir}: tensor {name!r} is not in the checkpoint")
        handle = self._handle(self.weight_map[name])
        try:
            info = handle.get_slice(name)
        except Exception as e:  # safetensors has its own error types
            raise ValueError(f"{self.dir}: cannot read tensor {name!r} from {self.weight_map[name]} ({e})") from None
        return info.get_dtype(), tuple(info.get_shape())

    def header(self, name: str) -> tuple[str, tuple[int, ...], int]:
        """(dtype name, shape, bytes) of tensor `name` as `get` returns it (an fp8 weight: float32), from the file
        headers, without reading the data."""
        code, shape = self.raw_header(name)
        if self.fp8 is not None and self._is_quantised(name, code):
            if problem := self.fp8_problem(name):
                raise ValueError(f"{self.dir}: tensor {name!r} (in {self.weight_map[name]}) {problem}")
            code = "F32"
        if code not in DTYPE_CODES:
            raise ValueError(f"{self.dir}: tensor {name!r} has dtype {code}; supported: {', '.join(DTYPE_CODES)}")
        dtype, size = DTYPE_CODES[code]
        numel = 1
        for d in shape:
            numel *= d
        return dtype, shape, numel * size


def _layer_index(name: str) -> int:
    return int(name.split(".")[2])  # model.layers.<i>.*, as the adapter's mtp_layer_names selected it


def skip_mtp_layers(ckpt: HFCheckpoint, adapter: GPTAdapter, spec: ModelSpec) -> set[str]:
    """The tensors of the checkpoint's multi-token-prediction layers (`num_nextn_predict_layers` of them, numbered
    from num_hidden_layers on; their fp8 scales included), which the model does not have. Logs once which layers
    and how many tensors are skipped. Tensors of layers past those stay unknown (a wrong file, refused by the
    checks)."""
    count = getattr(spec, "mtp_layers", 0)  # only specs of families with MTP layers carry the field
    if not count:
        return set()
    last = spec.num_layers + count
    skipped = {n for n in adapter.mtp_layer_names(spec, list(ckpt.weight_map)) if _layer_index(n) < last}
    if skipped:
        layers = sorted({_layer_index(n) for n in skipped})
        log.info("%s: skipping %d tensors of multi-token-prediction layer(s) %s (num_nextn_predict_layers=%d): "
                 "the model has no MTP head", ckpt.dir, len(skipped), ", ".join(map(str, layers)), count)
    return skipped


def iter_mcore_tensors(model_dir, adapter: GPTAdapter, spec: ModelSpec,
                       wanted: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (full Megatron name, tensor) for each adapter tensor map (only `wanted` names if given); fp8 weights
    come dequantised, MTP layers are skipped (one log line)."""
    ckpt = HFCheckpoint(model_dir)
    skip_mtp_layers(ckpt, adapter, spec)
    wanted = set(wanted) if wanted is not None else None
    for tm in adapter.tensor_maps(spec):
        if wanted is not None and tm.mcore not in wanted:
            continue
        yield tm.mcore, to_mcore(tm, [ckpt.get(n) for n in tm.hf], spec)
