"""Block-wise fp8 quantisation for fp8 rollouts (`formats/fp8.py`: BlockFp8.quantize / quant_dequant, the release
checkpoints' choice of quantised tensors, and the engine tensor-parallel block rule).

The reference quantiser is written here in float64 and rounds to e4m3 by its own route: the 256 codes are
enumerated as float64 values and each quotient goes to the nearest one, ties to the even code (= even mantissa),
by hand. float32 steps of the specification (amax / 448, w / scale_inv) are computed in float64 and rounded to
float32 once, which is the correctly rounded float32 result (53 >= 2 * 24 + 2 bits: the double rounding is
innocuous). The comparison is bit for bit."""
import pytest
import torch

from megatron_sparse_rl.formats.fp8 import BlockFp8, fp8_quantizable
from megatron_sparse_rl.models import get_adapter
from megatron_sparse_rl.models.tiny import hf_config_kwargs
from megatron_sparse_rl.models.tiny_families import deepseek_config_kwargs

CODES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
MAGNITUDES = CODES[:127]  # codes 0x00..0x7E: 0 .. 448, increasing (0x7F is NaN, 0x80.. the negatives)
MAX = 448.0


# ---- the independent reference -----------------------------------------------------------------------------
def round_e4m3(y: torch.Tensor) -> torch.Tensor:
    """uint8 e4m3 codes of float64 `y` (|y| <= 448): the nearest value, ties to the even code."""
    a = y.abs()
    hi = torch.searchsorted(MAGNITUDES, a).clamp(max=126)  # first magnitude >= a
    lo = (hi - 1).clamp(min=0)
    below, above = a - MAGNITUDES[lo], MAGNITUDES[hi] - a
    code = torch.where((above < below) | ((above == below) & (hi % 2 == 0)), hi, lo)
    return (code + 128 * torch.signbit(y).long()).to(torch.uint8)


def reference(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes, float32 scale_inv) of `w` block by block, in float64."""
    w64, (br, bc) = w.double(), block
    rows, cols = -(-w.shape[0] // br), -(-w.shape[1] // bc)
    codes, scale = torch.empty(w.shape, dtype=torch.uint8), torch.empty(rows, cols, dtype=torch.float32)
    for i in range(rows):
        for j in range(cols):
            part = w64[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            s = (part.abs().max() / MAX).float()  # float32 amax / 448
            s = s if s > 0 else torch.tensor(1.0)
            scale[i, j] = s
            y = (part / s.double()).float().double().clamp(-MAX, MAX)  # float32 w / scale_inv, clamped
            codes[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = round_e4m3(y)
    return codes, scale


def weights(shape, seed=0, dtype=torch.float32) -> torch.Tensor:
    """Normal values with magnitudes spread over 1e-4 .. 1e2 by row, so blocks have different scales."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 10.0 ** torch.empty(shape[0], 1).uniform_(-4, 2, generator=g)
    return w.to(dtype)


# ---- quantize ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape, block", [((130, 300), (128, 128)), ((5, 7), (128, 128)), ((1, 1), (128, 128)),
                                          ((40, 50), (16, 24)), ((256, 128), (128, 128))])
def test_quantize_matches_float64_reference_bit_for_bit(shape, block):
    w = weights(shape, seed=sum(shape))
    if shape == (130, 300):
        w[:128, 128:256] = 0.0  # an all-zero block
        w[129, 299] = -0.0
    q, scale = BlockFp8(block=block).quantize("w", w)
    codes, ref_scale = reference(w, block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == ref_scale.shape
    assert torch.equal(scale.view(torch.int32), ref_scale.view(torch.int32))
    assert torch.equal(q.view(torch.uint8), codes)
    if shape == (130, 300):
        assert scale[0, 1] == 1.0 and not q[:128, 128:256].view(torch.uint8).any()
        assert q[129, 299].view(torch.uint8) == 0x80  # -0 keeps its sign


def test_block_amax_goes_to_plus_or_minus_448():
    w = weights((130, 300), seed=1)
    q, _ = BlockFp8(block=(128, 128)).quantize("w", w)
    for r in (slice(0, 128), slice(128, 130)):
        for c in (slice(0, 128), slice(128, 256), slice(256, 300)):
            k = w[r, c].abs().argmax()
            expected = 0xFE if w[r, c].flatten()[k] < 0 else 0x7E  # +-448: sign bit, exponent 1111, mantissa 110
            assert q[r, c].flatten()[k].view(torch.uint8) == expected


def test_values_at_the_e4m3_max_and_ties_go_to_the_even_code():
    """A block whose amax is 448 has scale 1, so its values are rounded directly: every midpoint of two
    consecutive magnitudes goes to the even code of the two (hand rule), and 448 stays 448."""
    mids = (MAGNITUDES[:-1] + MAGNITUDES[1:]) / 2  # 126 midpoints, exact in float32
    w = torch.cat([mids, -mids, torch.tensor([MAX, -MAX, 0.0, 2.0 ** -10])]).float().reshape(16, 16)
    q, scale = BlockFp8(block=(16, 16)).quantize("w", w)
    assert scale.item() == 1.0
    got = q.view(torch.uint8).flatten().long()
    lower = torch.arange(126)
    even = torch.where(lower % 2 == 0, lower, lower + 1)
    assert torch.equal(got[:126], even) and torch.equal(got[126:252], even + 128)
    assert got[252:].tolist() == [0x7E, 0xFE, 0x00, 0x00]  # 2^-10 is halfway between 0 and 2^-9: even is 0


def test_quotients_next_to_midpoints_match_reference():
    """Values m * s and their float32 neighbours (m: the e4m3 midpoints, s = float32(1/3), the block's scale_inv)
    put w / scale_inv within an ulp of a tie, where only the specified float32 division (not a multiplication by
    the reciprocal, which differs on about a hundred of these) gives the reference."""
    s = torch.tensor(1 / 3, dtype=torch.float32)
    mids = ((MAGNITUDES[:-1] + MAGNITUDES[1:]) / 2).float() * s
    near = torch.cat([mids, torch.nextafter(mids, torch.full_like(mids, 1e9)), torch.nextafter(mids, 0 * mids)])
    w = torch.cat([near, -near, (MAX * s).reshape(1), torch.zeros(11)]).reshape(24, 32)
    q, scale = BlockFp8(block=(24, 32)).quantize("w", w)
    codes, ref_scale = reference(w, (24, 32))
    assert ref_scale.item() == s.item() and torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), codes)


def test_bfloat16_input_matches_reference():
    w = weights((130, 200), seed=2, dtype=torch.bfloat16)
    q, scale = BlockFp8(block=(128, 128)).quantize("w", w)
    codes, ref_scale = reference(w, (128, 128))
    assert torch.equal(q.view(torch.uint8), codes) and torch.equal(scale, ref_scale)


def test_quant_dequant_error_is_within_half_an_e4m3_ulp_times_the_scale():
    block = (128, 128)
    w = weights((130, 300), seed=3)
    out = BlockFp8(block=block).quant_dequant("w", w)
    assert out.dtype == torch.float32 and out.shape == w.shape
    _, ref_scale = reference(w, block)
    s = ref_scale.double().repeat_interleave(128, 0)[:130].repeat_interleave(128, 1)[:, :300]
    y = w.double().abs() / s
    exponent = torch.floor(torch.log2(y.clamp_min(2.0 ** -6))).clamp_min(-6)  # below 2^-6: subnormal ulp 2^-9
    half_ulp = 2.0 ** (exponent - 3) / 2
    slack = s * MAX * 2.0 ** -21  # the float32 roundings of w / scale and of q * scale
    assert ((out.double() - w.double()).abs() <= half_ulp * s + slack).all()


@pytest.mark.parametrize("bad", [torch.zeros(4), torch.zeros(2, 3, 4), torch.zeros(4, 4, dtype=torch.int32),
                                 torch.zeros(4, 4).to(torch.float8_e4m3fn)])
def test_quantize_refuses_what_is_not_a_2d_float_weight(bad):
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj.weight"):
        BlockFp8(block=(128, 128)).quantize("model.layers.0.mlp.down_proj.weight", bad)


def test_quantize_refuses_non_finite_values():
    w = torch.ones(4, 4)
    w[1, 2] = float("nan")
    with pytest.raises(ValueError, match="x.weight: has non-finite"):
        BlockFp8(block=(128, 128)).quantize("x.weight", w)


# ---- which tensors --------------------------------------------------------------------------------------------
def _config(arch: str) -> dict:
    """Realistic shapes (Qwen3-30B-A3B, Mixtral-8x7B, DeepSeek-V3, Qwen2-7B), one or two layers, few experts."""
    rope = {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "hidden_act": "silu"}
    if arch == "qwen3_moe":
        _, kw = hf_config_kwargs("qwen3_moe", hidden=2048, layers=1, heads=32, kv_heads=4, head_dim=128, experts=4,
                                 topk=2, moe_ffn=768, ffn=6144)
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **rope, **kw}
    if arch == "deepseek_v3":
        kw = deepseek_config_kwargs(hidden=7168, layers=2, heads=128, experts=4, topk=2, n_group=2, topk_group=1,
                                    moe_ffn=2048, ffn=18432, kv_lora_rank=512, q_lora_rank=1536, qk_nope=128,
                                    qk_rope=64, v_head=128, rope="default")
        return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_act": "silu", **kw}
    common = dict(vocab_size=1000, hidden_size=4096, num_hidden_layers=1, num_attention_heads=32,
                  num_key_value_heads=8, **rope)
    if arch == "mixtral":
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **common, "intermediate_size": 14336,
                "num_local_experts": 2, "num_experts_per_tok": 2, "sliding_window": None}
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **common, "intermediate_size": 18944}


def _spec(arch: str):
    adapter = get_adapter(_config(arch))
    return adapter, adapter.spec_from_hf(_config(arch))


ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLA = ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj",
       "self_attn.o_proj")
GLU = ("gate_proj", "up_proj", "down_proj")
EXPECTED = {  # layer -> the modules whose weight the release checkpoints store in fp8 (written out by hand)
    "qwen3_moe": {0: ATTENTION + tuple(f"mlp.experts.{e}.{p}" for e in range(4) for p in GLU)},
    "mixtral": {0: ATTENTION + tuple(f"block_sparse_moe.experts.{e}.w{k}" for e in range(2) for k in (1, 2, 3))},
    "qwen2": {0: ATTENTION + tuple(f"mlp.{p}" for p in GLU)},
    "deepseek_v3": {0: MLA + tuple(f"mlp.{p}" for p in GLU),
                    1: MLA + tuple(f"mlp.experts.{e}.{p}" for e in range(4) for p in GLU)
                    + tuple(f"mlp.shared_experts.{p}" for p in GLU)},
}


@pytest.mark.parametrize("arch", sorted(EXPECTED))
def test_quantised_tensors_of_the_adapters_are_the_release_ones(arch):
    adapter, spec = _spec(arch)
    shapes = adapter.hf_shapes(spec)
    expected = {f"model.layers.{i}.{m}.weight" for i, modules in EXPECTED[arch].items() for m in modules}
    assert {n for n, s in shapes.items() if fp8_quantizable(n, s)} == expected
    left = {n for n in shapes if n not in expected}
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= left
    if arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in left
    if arch == "deepseek_v3":
        assert {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"} <= left
    if arch == "mixtral":
        assert "model.layers.0.block_sparse_moe.gate.weight" in left


def test_name_rule_needs_a_2d_weight():
    assert fp8_quantizable("model.layers.0.self_attn.o_proj.weight", (8, 8))
    assert not fp8_quantizable("model.layers.0.self_attn.o_proj.weight", (8,))
    assert not fp8_quantizable("model.layers.0.self_attn.o_proj.bias", (8, 8))
    assert not fp8_quantizable("model.layers.0.mlp.gate.weight", (8, 8))


# ---- engine tensor parallelism ----------------------------------------------------------------------------------
FMT = BlockFp8(block=(128, 128))
EXPERT = "model.layers.1.mlp.experts.0.{}.weight"


@pytest.mark.parametrize("name, shape, tp, split, kw, bad", [
    ("a.o_proj.weight", (4096, 4096), 8, "row", {}, False),        # 512 columns per rank
    ("a.o_proj.weight", (4096, 4096), 3, "row", {}, True),         # does not divide
    ("a.o_proj.weight", (2048, 640), 2, "row", {}, True),          # 320
    ("a.o_proj.weight", (2048, 640), 5, "row", {}, False),         # 128
    ("a.o_proj.weight", (2048, 640), 1, "row", {}, False),         # not split
    ("a.q_b_proj.weight", (24576, 1536), 8, "column", {}, False),  # 3072 rows per rank
    ("a.q_b_proj.weight", (576, 7168), 2, "column", {}, True),     # 288
    ("a.q_b_proj.weight", (576, 7168), 1, "column", {}, False),    # one partial block row is fine
    ("a.k_proj.weight", (512, 4096), 8, "kv_heads", {"kv_heads": 4}, False),  # one 128-row head per rank
    ("a.k_proj.weight", (256, 2048), 8, "kv_heads", {"kv_heads": 4}, True),   # one 64-row head per rank
    ("a.k_proj.weight", (256, 2048), 2, "kv_heads", {"kv_heads": 4}, False),  # two heads, 128 rows
    ("a.k_proj.weight", (64, 2048), 1, "kv_heads", {"stacked": True}, True),  # in front of v in qkv_proj
    ("a.v_proj.weight", (64, 2048), 1, "kv_heads", {}, False),                # last in qkv_proj
    ("a.q_a_proj.weight", (1536, 7168), 8, "replicated", {"stacked": True}, False),
    ("a.q_a_proj.weight", (1000, 7168), 8, "replicated", {"stacked": True}, True),
    ("a.kv_a_proj_with_mqa.weight", (576, 7168), 8, "replicated", {}, False),
    (EXPERT.format("gate_proj"), (768, 2048), 1, "column", {}, False),
    (EXPERT.format("gate_proj"), (768, 2048), 4, "column", {}, True),  # 192
    (EXPERT.format("up_proj"), (96, 64), 1, "column", {}, True),       # FusedMoE: even unsplit
    (EXPERT.format("down_proj"), (2048, 768), 2, "row", {}, False),    # 384 columns
    (EXPERT.format("down_proj"), (2048, 768), 4, "row", {}, True),     # 192
    ("model.layers.1.mlp.shared_experts.up_proj.weight", (96, 64), 1, "column", {}, False),
])
def test_block_problem(name, shape, tp, split, kw, bad):
    problem = FMT.block_problem(name, shape, tp, split, **kw)
    assert (problem is not None) == bad, problem
    if bad:
        assert problem.startswith(name + ":") and "128" in problem


def test_block_problem_needs_kv_heads_for_a_kv_heads_split():
    with pytest.raises(ValueError, match="kv_heads"):
        FMT.block_problem("a.k_proj.weight", (512, 64), 2, "kv_heads")
    with pytest.raises(ValueError, match="sideways"):
        FMT.block_problem("a.k_proj.weight", (512, 64), 2, "sideways")


def test_engine_problems_of_real_shapes():
    adapter, spec = _spec("qwen3_moe")  # experts' intermediate 768: whole blocks per rank up to tp 6
    assert FMT.engine_problems(adapter, spec, 1) == [] and FMT.engine_problems(adapter, spec, 2) == []
    bad = {p.split(":")[0] for p in FMT.engine_problems(adapter, spec, 4)}
    assert bad == {f"model.layers.0.mlp.experts.{e}.{p}.weight" for e in range(4) for p in GLU}  # 192 per rank
    adapter, spec = _spec("deepseek_v3")
    assert FMT.engine_problems(adapter, spec, 8) == [] and FMT.engine_problems(adapter, spec, 16) == []
    adapter, spec = _spec("mixtral")  # 8 KV heads of 128, intermediate 14336 = 112 blocks
    assert FMT.engine_problems(adapter, spec, 8) == []


def test_engine_problems_of_a_tiny_model_name_the_stacked_projections():
    """Tiny Qwen3-MoE (hidden 64, 4 heads of 32, 2 KV heads, expert intermediate 32) at tp 1: k (64 rows, in front
    of v in qkv_proj) and every expert's gate and up (FusedMoE) are less than a block; q's 128 rows are one block;
    v, o and down are not split."""
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu",
           "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
           **hf_config_kwargs("qwen3_moe", hidden=64, layers=1, heads=4, kv_heads=2, head_dim=32, experts=2, topk=1,
                              moe_ffn=32, ffn=64)[1]}
    adapter = get_adapter(cfg)
    bad = {p.split(":")[0] for p in FMT.engine_problems(adapter, adapter.spec_from_hf(cfg), 1)}
    assert bad == {"model.layers.0.self_attn.k_proj.weight"} | {
        f"model.layers.0.mlp.experts.{e}.{p}.weight" for e in range(2) for p in ("gate_proj", "up_proj")}
