"""Block-wise FP8 weights of DeepSeek-V3 / Kimi-K2 / DeepSeek-V3.2 / GLM-5 release checkpoints, dequantised exactly
on import, and the same format made from the learner's weights for fp8 rollouts.

Such a checkpoint stores many 2-D weights as float8_e4m3fn, each with a float32 companion `<name>_scale_inv` of
shape [ceil(rows / br), ceil(cols / bc)], and its config.json says how:

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [br, bc]}

The weight is float32(stored) * scale_inv[i // br, j // bc] for element (i, j); the last block of a row or column
may be partial. Every e4m3 value and every scale is a float32 exactly, so the product computed in float32 is the
exact product rounded once (it can need more than float32's 24 mantissa bits, hence no bf16 result). A `scale_fmt`
key (DeepSeek's "ue8m0": power-of-two scales) is not read: the product is the same for any scale the file stores
in F32 / BF16 / F16 (another scale dtype is refused, naming the scale).

    q = BlockFp8.from_config(json.load(open("config.json")), "config.json")   # None when not quantised
    q.pair_problem(name, "F8_E4M3", (576, 64), ("F32", (5, 1)))               # None, or what is wrong
    w = q.dequantize(name, stored, scale)                                      # float32

`formats/hf_io.py` (HFCheckpoint.get / header) is the one reader that applies this; the checks of
`checkpoint/checks.py` use `pair_problem` on the safetensors headers.

The other way (fp8 rollouts: the learner's weights quantised at each weight sync, weights only):

    fmt = BlockFp8(block=(128, 128))
    if fp8_quantizable(name, w.shape):                        # the release checkpoints' choice of tensors
        q, scale_inv = fmt.quantize(name, w)                  # as DeepSeek-V3's release: amax / 448 per block
        w_engine = fmt.quant_dequant(name, w).to(w.dtype)     # what an engine computing in w.dtype would use
    fmt.engine_problems(adapter, spec, tp)                    # [] or one message per tensor an engine of
                                                              # tensor-parallel size tp cannot hold in whole blocks
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, get_args

import torch

from megatron_sparse_rl.models.tensor_map import EngineSplit

if TYPE_CHECKING:
    from megatron_sparse_rl.models.base import GPTAdapter
    from megatron_sparse_rl.models.spec import ModelSpec

RELEASE_BLOCK = (128, 128)
"""The block one scale covers in DeepSeek-V3's and Qwen3's FP8 releases (and `rollout.quantization: fp8`)."""
SCALE_SUFFIX = "_scale_inv"
FP8_CODE = "F8_E4M3"
"""The safetensors dtype code of torch.float8_e4m3fn, the only fp8 storage read."""
SCALE_CODES = ("F32", "BF16", "F16")
"""Scale dtypes read (each converts to float32 exactly); release checkpoints store F32."""
QUANT_METHODS = ("fp8",)
FORMATS = ("e4m3",)
ACTIVATION_SCHEMES = ("dynamic",)
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max
"""448: the largest finite float8_e4m3fn; a block's absolute maximum is quantised to it."""
ZERO_BLOCK_SCALE = 1.0
"""The scale_inv of a block whose amax / 448 is 0 in float32 (an all-zero block, or one below about 6e-43): any
positive scale avoids 0 / 0; 1 keeps the zeros zero and dequantises the block to exact zeros."""
QUANTIZED_LINEARS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                               "kv_b_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3", "wq_b", "wk"})
"""The attention and MLP / expert projections whose 2-D `.weight` the fp8 release checkpoints store as fp8
(DeepSeek-V3, Kimi-K2, Qwen3-FP8; Mixtral's experts are w1 / w3 / w2), and the DSA lightning indexer's query and key
projections `self_attn.indexer.wq_b` / `.wk` (DeepSeek-V3.2, GLM-5: DeepSeek-V3.2-Exp's inference/model.py builds
them as its default, fp8, `Linear`; vLLM 0.32 loads wq_b as a block-fp8 linear and dequantises an fp8 wk with its
`weight_scale_inv`). Not quantised: embed_tokens, lm_head, norms (the indexer's `k_norm` included), the indexer's
`weights_proj` (bf16 in the release: the reference builds it `dtype=torch.float32` "stored in bf16", transformers
keeps it in fp32), the MoE router (`mlp.gate`, `block_sparse_moe.gate`) and its `e_score_correction_bias`, biases,
and the multi-token-prediction layer's own tensors (eh_proj, shared_head), which the adapters never name."""
_ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.")
"""An HF name inside a routed expert (`mlp.experts.3.`, `block_sparse_moe.experts.3.`; not `shared_experts.`):
vLLM serves these with FusedMoE."""


def scale_name(weight: str) -> str:
    return weight + SCALE_SUFFIX


def orphan_scales(names) -> list[str]:
    """The `<name>_scale_inv` tensors among `names` whose weight `<name>` is not among them."""
    present = set(names)
    return sorted(n for n in present if n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] not in present)


def fp8_quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Whether the HF tensor `name` of `shape` is stored as block-wise fp8 in a release checkpoint: the 2-D
    `.weight` of an attention or MLP / expert projection (`QUANTIZED_LINEARS`), nothing else."""
    parts = name.split(".")
    return len(shape) == 2 and len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in QUANTIZED_LINEARS


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

    def quantize(self, name: str, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q float8_e4m3fn of `weight`'s shape, scale_inv float32 of `scale_shape`), as DeepSeek-V3's release: per
        block (a partial last block over the elements it has) amax = max |w| in float32, scale_inv = amax / 448
        (`ZERO_BLOCK_SCALE` where that is 0), q = clamp(w / scale_inv, -448, 448) cast to e4m3 (torch's cast:
        nearest, ties to even). float32 division, on `weight`'s device. Refuses anything but a 2-D floating-point
        weight with finite values, naming `name`."""
        if weight.dim() != 2 or not weight.is_floating_point() or weight.element_size() < 2:
            raise ValueError(f"{name}: block-wise fp8 quantises 2-D float16 / bfloat16 / float32 / float64 weights "
                             f"(got shape {tuple(weight.shape)}, {weight.dtype})")
        (rows, cols), (br, bc) = weight.shape, self.block
        sr, sc = self.scale_shape(tuple(weight.shape))
        # zero padding fills the partial blocks without changing their amax; the padding is cut off again below
        padded = torch.nn.functional.pad(weight.to(torch.float32), (0, sc * bc - cols, 0, sr * br - rows))
        blocks = padded.view(sr, br, sc, bc)
        amax = blocks.abs().amax(dim=(1, 3))
        if not bool(torch.isfinite(amax).all()):
            raise ValueError(f"{name}: has non-finite values; fp8 quantisation needs finite weights")
        scale = amax / E4M3_MAX
        scale = torch.where(scale > 0, scale, torch.full_like(scale, ZERO_BLOCK_SCALE))
        q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return q.view(sr * br, sc * bc)[:rows, :cols].contiguous(), scale

    def quant_dequant(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """dequantize(quantize(weight)) in float32: what an engine serving the fp8 weights computes with. Each
        value is an e4m3 value times a float32 scale, exact in float32; a caller computing in bfloat16 casts it
        (`.to(weight.dtype)`), which rounds once more (an e4m3 mantissa times a scale can need 28 bits)."""
        return self.dequantize(name, *self.quantize(name, weight))

    def block_problem(self, name: str, shape: tuple[int, ...], tp: int, split: EngineSplit, *,
                      kv_heads: int | None = None, stacked: bool = False) -> str | None:
        """Why weight `name` of `shape`, quantised in this format, does not fit an engine of tensor-parallel size
        `tp` in whole blocks, or None. `split` is how an engine rank slices it: the model adapter's fact
        (`GPTAdapter.engine_splits`; models/tensor_map.py). `kv_heads`: the model's KV heads (needed for a
        "kv_heads" split when tp exceeds them: each rank then holds one head). `stacked`: vLLM stacks the weight
        in front of another in one merged weight (see `engine_problems`).

        Rule (vLLM 0.32's block-fp8 linear and FusedMoE layers, fp8_utils.py `validate_fp8_block_shape` and
        `validate_fp8_block_shape_moe`): with tp > 1 a row-split shard's columns, and a column- or kv_heads-split
        shard's rows, are whole blocks; at any tp the rows of a stacked weight and of a routed expert's gate / up
        (w1 / w3) shard are whole blocks. Stricter than vLLM on two points: vLLM skips its check for a merged layer
        with a misaligned part (linear.py `_maybe_allow_fp8_block_shape_mismatch`), whose kernel would then read
        one block's scale across two parts; and its Triton MoE kernels may refine the scales of misaligned expert
        shards. vLLM expert parallelism (experts whole per rank) is not modelled: the engines do not enable it."""
        if tp < 1:
            raise ValueError(f"engine tensor-parallel size must be >= 1 (got {tp})")
        if split not in get_args(EngineSplit):
            raise ValueError(f"{name}: engine split {split!r} is not one of {', '.join(get_args(EngineSplit))}")
        if len(shape) != 2:
            return f"{name}: block-wise fp8 weights are 2-D (got shape {tuple(shape)})"
        (rows, cols), (br, bc) = shape, self.block
        if tp > 1 and split == "row":
            return self._shard_problem(name, "columns", cols, tp, bc, f"split by columns over tp={tp}")
        if tp > 1 and split in ("column", "kv_heads"):
            if split == "kv_heads" and kv_heads is None:
                raise ValueError(f"{name}: a kv_heads split needs the model's KV heads (kv_heads=)")
            # with fewer KV heads than ranks, each rank holds one head
            parts = tp if split == "column" else min(tp, kv_heads)
            return self._shard_problem(name, "rows", rows, parts, br, f"split by rows over tp={tp}")
        if stacked:
            return self._shard_problem(name, "rows", rows, 1, br, "stacked in front of another projection in one "
                                       "merged vLLM weight")
        if split == "column" and _ROUTED_EXPERT.search(name):
            return self._shard_problem(name, "rows", rows, 1, br, "a routed expert's gate / up in vLLM's FusedMoE")
        return None

    def _shard_problem(self, name: str, what: str, size: int, parts: int, block: int, why: str) -> str | None:
        """The message when `size` entries cut in `parts` equal shards are not whole blocks of `block` each."""
        if size % parts == 0 and (size // parts) % block == 0:
            return None
        held = f"its {size} {what} in {parts} shards of {size / parts:g}" if parts > 1 else f"its {size} {what}"
        return (f"{name}: {held} ({why}) are not whole fp8 blocks of {block} (weight_block_size {list(self.block)}); "
                f"vLLM's block-fp8 layers need whole blocks in every engine shard")

    def engine_problems(self, adapter: GPTAdapter, spec: ModelSpec, tp: int, *, merged: bool = True) -> list[str]:
        """`block_problem` of every `fp8_quantizable` weight of `spec`'s model (HF names, shapes and engine splits
        from `adapter`'s tensor maps) in an engine of tensor-parallel size `tp`; empty when all fit. Stacked are the
        parts before the last of a q/k/v or gate/up map (vLLM's qkv_proj and gate_up_proj stack them the same way)
        and DeepSeek's q_a_proj (vLLM's fused_qkv_a_proj = [q_a_proj; kv_a_proj_with_mqa]); `merged=False` leaves
        that stacking rule out (an engine computing with the dequantised values has no merged FP8 weight)."""
        out = []
        for tm in adapter.tensor_maps(spec):
            for k, (name, shape, split) in enumerate(zip(tm.hf, tm.shapes, tm.engine_splits, strict=True)):
                stacked = merged and ((tm.kind != "copy" and k < len(tm.hf) - 1)
                                      or name.endswith(".self_attn.q_a_proj.weight"))
                if fp8_quantizable(name, shape) and (problem := self.block_problem(
                        name, shape, tp, split, kv_heads=spec.num_kv_heads, stacked=stacked)):
                    out.append(problem)
        return out
