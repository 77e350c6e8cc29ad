"""Block-wise FP8 weights of DeepSeek-V3 / Kimi-K2 release checkpoints, dequantised exactly on import.

Such a checkpoint stores many 2-D weights as float8_e4m3fn, each with a float32 companion `<name>_scale_inv` of
shape [ceil(rows / br), ceil(cols / bc)], and its config.json says how:

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [br, bc]}

The weight is float32(stored) * scale_inv[i // br, j // bc] for element (i, j); the last block of a row or column
may be partial. Every e4m3 value and every scale is a float32 exactly, so the product computed in float32 is the
exact product rounded once (it can need more than float32's 24 mantissa bits, hence no bf16 result).

    q = BlockFp8.from_config(json.load(open("config.json")), "config.json")   # None when not quantised
    q.pair_problem(name, "F8_E4M3", (576, 64), ("F32", (5, 1)))               # None, or what is wrong
    w = q.dequantize(name, stored, scale)                                      # float32

`formats/hf_io.py` (HFCheckpoint.get / header) is the one reader that applies this; the checks of
`checkpoint/checks.py` use `pair_problem` on the safetensors headers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_SUFFIX = "_scale_inv"
FP8_CODE = "F8_E4M3"
"""The safetensors dtype code of torch.float8_e4m3fn, the only fp8 storage read."""
SCALE_CODES = ("F32", "BF16", "F16")
"""Scale dtypes read (each converts to float32 exactly); release checkpoints store F32."""
QUANT_METHODS = ("fp8",)
FORMATS = ("e4m3",)
ACTIVATION_SCHEMES = ("dynamic",)


def scale_name(weight: str) -> str:
    return weight + SCALE_SUFFIX


def orphan_scales(names) -> list[str]:
    """The `<name>_scale_inv` tensors among `names` whose weight `<name>` is not among them."""
    present = set(names)
    return sorted(n for n in present if n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] not in present)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _setting(q: dict, key: str, allowed: tuple[str, ...], default: str | None, where: str) -> None:
    value = q.get(key, default)
    if value not in allowed:
        raise ValueError(f"{where}: quantization_config.{key} {value!r} is not supported (supported: "
                         f"{', '.join(allowed)}; block-wise fp8 as in DeepSeek-V3 / Kimi-K2 release checkpoints)")


@dataclass(frozen=True, slots=True)
class BlockFp8:
    """The block-wise fp8 format of a checkpoint's quantization_config."""

    block: tuple[int, int]
    """(rows, cols) of the weight block one scale covers: quantization_config.weight_block_size."""

    @classmethod
    def from_config(cls, cfg: dict, where: str) -> BlockFp8 | None:
        """The format named by config.json's quantization_config (`where` names the file in errors); None when
        there is none. Anything but block-wise e4m3 fp8 with dynamic activation scales is refused."""
        q = cfg.get("quantization_config")
        if q is None:
            return None
        if not isinstance(q, dict):
            raise ValueError(f"{where}: quantization_config must be a mapping (got {type(q).__name__})")
        _setting(q, "quant_method", QUANT_METHODS, None, where)
        _setting(q, "fmt", FORMATS, "e4m3", where)
        _setting(q, "activation_scheme", ACTIVATION_SCHEMES, "dynamic", where)
        block = q.get("weight_block_size")
        if not (isinstance(block, (list, tuple)) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ValueError(f"{where}: quantization_config.weight_block_size must be two positive integers such "
                             f"as [128, 128] (got {block!r}); per-tensor fp8 scales are not supported")
        return cls(block=(block[0], block[1]))

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The scale shape a 2-D weight of `shape` needs: ceil-division by the block."""
        return _ceil_div(shape[0], self.block[0]), _ceil_div(shape[1], self.block[1])

    def pair_problem(self, name: str, code: str, shape: tuple[int, ...],
                     scale: tuple[str, tuple[int, ...]] | None) -> str | None:
        """What is wrong with weight `name` stored as (`code`, `shape`) and its scale's (code, shape) (None when it
        has none), or None when it dequantises. A non-fp8 weight must not have a scale (it would be dropped)."""
        sname = scale_name(name)
        if code.startswith("F8_") and code != FP8_CODE:
            return f"is {code}; fp8 weights must be {FP8_CODE} (quantization_config.fmt e4m3)"
        if code != FP8_CODE:
            return f"has a scale {sname!r} but is stored as {code}, not {FP8_CODE}" if scale is not None else None
        if len(shape) != 2:
            return f"is {FP8_CODE} with {len(shape)} dims (block-wise fp8 weights are 2-D)"
        if scale is None:
            return f"is {FP8_CODE} but the checkpoint has no scale {sname!r} for it"
        scode, sshape = scale
        want = self.scale_shape(shape)
        if tuple(sshape) != want:
            return (f"scale {sname!r} has shape {tuple(sshape)}, expected {want} (ceil of the weight shape "
                    f"{tuple(shape)} / weight_block_size {list(self.block)})")
        if scode not in SCALE_CODES:
            return f"scale {sname!r} has dtype {scode} (allowed: {', '.join(SCALE_CODES)})"
        return None

    def dequantize(self, name: str, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """float32(weight) * scale per block, in float32 (see the module doc); `name` names the weight in errors."""
        codes = {torch.float8_e4m3fn: FP8_CODE, torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
        problem = self.pair_problem(name, codes.get(weight.dtype, str(weight.dtype)), tuple(weight.shape),
                                    (codes.get(scale.dtype, str(scale.dtype)), tuple(scale.shape)))
        if problem:
            raise ValueError(f"{name}: {problem}")
        (rows, cols), (br, bc) = weight.shape, self.block
        expanded = scale.to(torch.float32).repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
        return weight.to(torch.float32) * expanded
