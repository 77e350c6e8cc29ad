"""Import of a block-wise fp8 DeepSeek-V3.2 / GLM-5 release checkpoint (DSA: a lightning indexer in every layer)
through the project's HF reader (`formats/hf_io.py`) and the conversion checks (`checkpoint/checks.py`), without a
process group.

The release is made here from a tiny DSA model as DeepSeek-V3.2-Exp's FP8 release stores one (its
inference/model.py: every MLA and MLP / expert projection and the indexer's `wq_b` and `wk` are fp8 linears with a
`weight_scale_inv`; the indexer's `weights_proj` is bf16, its `k_norm` unquantised), with a multi-token-prediction
layer. The (24, 16) blocks straddle the indexer's heads and its rope / non-rope rows, so the rows the adapter
reorders on import (models/dsa.py `indexer_row_order`) come from differently scaled blocks: reordering before
dequantising would give other values. The DeepSeek-V3.2 release has power-of-two scales and `scale_fmt: ue8m0` in
its quantization_config, the GLM-5 one amax / 448 scales; the indexer's weights are scaled by 1, 4, 16 by block
of rows first, so neighbouring blocks' scales differ. The references are written in this file: the
quantisation and the dequantisation block by block in float64, and the Megatron row order per head from the two
rope layouts (half-split for DeepSeek-V3.2, interleaved for GLM-5).

Run: .venv/bin/python -m pytest -q tests/unit/test_fp8_dsa_import.py
"""
import logging
import math

import pytest
import torch
from safetensors.torch import load_file

from megatron_sparse_rl.checkpoint.checks import check_hf_tensors
from megatron_sparse_rl.formats.fp8 import fp8_quantizable
from megatron_sparse_rl.formats.hf_io import HFCheckpoint, iter_mcore_tensors
from megatron_sparse_rl.models import load_spec
from tests.unit.test_fp8_import import mtp_layer, write_checkpoint

BLOCK = (24, 16)
LAYERS = 2  # decoder layers; the MTP layer is numbered 2
HEADS, DIM, ROPE = 4, 128, 64  # indexer heads, index_head_dim, qk_rope_head_dim
E4M3_MAX = 448.0
ARCHS = {"deepseek_v32": dict(rope="yarn", seed=3, pow2=True), "glm_moe_dsa": dict(rope="default", seed=5, pow2=False)}
RELEASE_FP8 = ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj",
               "self_attn.o_proj", "gate_proj", "up_proj", "down_proj", "self_attn.indexer.wq_b",
               "self_attn.indexer.wk")
"""The modules whose `.weight` the release stores as fp8 (DeepSeek-V3.2-Exp inference/model.py, written by hand)."""
ROW_OCTAVES = lambda rows: 4.0 ** (torch.arange(rows) // BLOCK[0] % 3)[:, None]  # noqa: E731
"""Row factors of the indexer's wq_b and wk: 1, 4, 16 by block of rows, so neighbouring blocks' scales differ (with
power-of-two scales the random weights' blocks would otherwise share one) and a row moved to another block is
scaled differently there."""
WQ_B, WK = "model.layers.1.self_attn.indexer.wq_b.weight", "model.layers.1.self_attn.indexer.wk.weight"


def release_fp8(name: str) -> bool:
    module = name.removesuffix(".weight")
    return name.startswith("model.layers.") and name.endswith(".weight") and module.endswith(RELEASE_FP8)


# ---- the independent references -----------------------------------------------------------------------------
def _blocks(shape):
    for i in range(0, shape[0], BLOCK[0]):
        for j in range(0, shape[1], BLOCK[1]):
            yield i // BLOCK[0], j // BLOCK[1], slice(i, i + BLOCK[0]), slice(j, j + BLOCK[1])


def quantise(w: torch.Tensor, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale_inv): each block's amax / 448 in float64, rounded up to a power of two (ue8m0)
    when `pow2`, so no value exceeds 448."""
    scale = torch.empty(-(-w.shape[0] // BLOCK[0]), -(-w.shape[1] // BLOCK[1]), dtype=torch.float32)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for bi, bj, r, c in _blocks(w.shape):
        s = max(float(w[r, c].double().abs().max()), 1e-8) / E4M3_MAX
        s = 2.0 ** math.ceil(math.log2(s)) if pow2 else s
        scale[bi, bj] = s
        q[r, c] = (w[r, c].double() / float(scale[bi, bj])).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantise(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float64 product per block (exact: a 4-bit by 24-bit mantissa product)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for bi, bj, r, c in _blocks(q.shape):
        out[r, c] = q[r, c].double() * float(scale[bi, bj])
    return out


def megatron_rows(t: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """`t`'s rows (heads of DIM, HF's [rope | nope]) as Megatron holds them: per head [nope | rope], the rope rows
    in rotation pairs: HF's (i, i + ROPE/2) pairs side by side for DeepSeek-V3.2's half-split layout, unchanged for
    GLM-5's interleaved one."""
    x = t.reshape(-1, DIM, *t.shape[1:])
    rope, nope = x[:, :ROPE], x[:, ROPE:]
    if not interleaved:
        rope = torch.stack([rope[:, :ROPE // 2], rope[:, ROPE // 2:]], dim=2).flatten(1, 2)
    return torch.cat([nope, rope], dim=1).reshape(t.shape)


# ---- the release ----------------------------------------------------------------------------------------------
def make_release(root, arch: str):
    """(release directory, its stored tensors) of a tiny `arch` DSA model built under `root`."""
    from megatron_sparse_rl.models.tiny_families import build_tiny_dsa

    opts = ARCHS[arch]
    plain = build_tiny_dsa(root / "plain", arch=arch, layers=LAYERS, index_heads=HEADS, index_head_dim=DIM,
                           q_lora_rank=32, rope=opts["rope"], seed=opts["seed"])
    tensors = load_file(str(plain / "model.safetensors"))
    tensors.update(mtp_layer(tensors, LAYERS, last=LAYERS - 1))
    for name in [n for n in tensors if n.endswith(("indexer.wq_b.weight", "indexer.wk.weight"))]:
        tensors[name] = tensors[name] * ROW_OCTAVES(tensors[name].shape[0])
    for name in [n for n in tensors if release_fp8(n)]:
        tensors[name], tensors[name + "_scale_inv"] = quantise(tensors[name], opts["pow2"])
    for name in [n for n in tensors if n.endswith("indexer.weights_proj.weight")]:
        tensors[name] = tensors[name].to(torch.bfloat16)  # as the release stores it
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK),
             **({"scale_fmt": "ue8m0"} if opts["pow2"] else {})}
    hf = write_checkpoint(plain, root / "release", tensors, quantization_config=quant, num_nextn_predict_layers=1)
    return hf, tensors


@pytest.fixture(scope="module", params=list(ARCHS))
def release(request, tmp_path_factory):
    """(arch, release directory, its stored tensors)."""
    return request.param, *make_release(tmp_path_factory.mktemp(request.param), request.param)


def reference(stored: dict, name: str) -> torch.Tensor:
    """What the model holds for HF tensor `name`: an fp8 one's float64 dequantisation rounded to float32."""
    t = stored[name]
    return dequantise(t, stored[name + "_scale_inv"]).float() if t.dtype == torch.float8_e4m3fn else t


# ---- tests ----------------------------------------------------------------------------------------------------
def test_fp8_quantizable_is_the_release_choice(release):
    """The fp8 rollout's choice of tensors (`fp8_quantizable`) is the release's, indexer included."""
    arch, hf, stored = release
    adapter, spec = load_spec(hf)
    shapes = adapter.hf_shapes(spec)
    chosen = {n for n, s in shapes.items() if fp8_quantizable(n, s)}
    assert chosen == {n for n in shapes if release_fp8(n)}
    assert chosen == {n for n in shapes if stored[n].dtype == torch.float8_e4m3fn}
    indexer = {n.split(".indexer.")[1] for n in chosen if ".indexer." in n}
    assert indexer == {"wq_b.weight", "wk.weight"}, arch  # not weights_proj, not k_norm
    assert {f"model.layers.{i}.self_attn.indexer.{m}" for i in range(LAYERS)
            for m in ("weights_proj.weight", "k_norm.weight", "k_norm.bias")}.isdisjoint(chosen)


def test_indexer_rows_are_reordered_after_dequantisation(release):
    arch, hf, stored = release
    adapter, spec = load_spec(hf)
    interleaved = ARCHS[arch]["rope"] == "default"  # GLM-5's indexer rope is interleaved
    mx = "decoder.layers.{}.self_attention.core_attention.indexer."
    wanted = {mx.format(i) + m for i in range(LAYERS) for m in
              ("linear_wq_b.weight", "linear_wk.weight", "k_norm.weight", "k_norm.bias", "linear_weights_proj.weight")}
    got = dict(iter_mcore_tensors(hf, adapter, spec, wanted=wanted))
    assert sorted(got) == sorted(wanted)
    for i in range(LAYERS):
        ix, m = f"model.layers.{i}.self_attn.indexer.", mx.format(i)
        for hf_name, mc in (("wq_b.weight", "linear_wq_b.weight"), ("wk.weight", "linear_wk.weight")):
            q, scale = stored[ix + hf_name], stored[ix + hf_name + "_scale_inv"]
            want = megatron_rows(dequantise(q, scale), interleaved).float()
            assert got[m + mc].dtype == torch.float32 and torch.equal(got[m + mc], want), (arch, i, hf_name)
            # the other order (reorder the fp8 rows, then dequantise with the stored scales) differs here
            reordered = megatron_rows(q.view(torch.uint8), interleaved).view(torch.float8_e4m3fn)
            assert not torch.equal(got[m + mc], dequantise(reordered, scale).float())
        for part in ("weight", "bias"):
            assert torch.equal(got[m + "k_norm." + part], megatron_rows(stored[ix + "k_norm." + part], interleaved))
        assert torch.equal(got[m + "linear_weights_proj.weight"], stored[ix + "weights_proj.weight"])


def test_every_megatron_tensor_is_the_reference_dequantisation(release, caplog):
    """Every tensor the import yields, built by hand from the float64 references: copies, [gate; up] for fc1, the
    indexer's rows reordered; the MTP layer skipped with one log line."""
    arch, hf, stored = release
    adapter, spec = load_spec(hf)
    interleaved = ARCHS[arch]["rope"] == "default"
    caplog.set_level(logging.INFO)
    got = dict(iter_mcore_tensors(hf, adapter, spec))
    maps = {tm.mcore: tm for tm in adapter.tensor_maps(spec)}
    assert sorted(got) == sorted(maps)
    fp8_seen = 0
    for mcore, tm in maps.items():
        parts = [reference(stored, n) for n in tm.hf]
        fp8_seen += sum(stored[n].dtype == torch.float8_e4m3fn for n in tm.hf)
        want = torch.cat(parts) if tm.kind == "glu" else parts[0]
        if tm.kind == "rows":
            want = megatron_rows(want, interleaved)
        assert tm.kind in ("copy", "glu", "rows") and torch.equal(got[mcore], want), (arch, mcore)
    assert fp8_seen == sum(release_fp8(n) for n in adapter.hf_shapes(spec)) > 40
    logs = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    mtp = [n for n in stored if n.startswith(f"model.layers.{LAYERS}.")]
    assert any(n.endswith("indexer.wk.weight_scale_inv") for n in mtp)
    assert len(logs) == 1 and f"skipping {len(mtp)} tensors of multi-token-prediction layer(s) {LAYERS} " in logs[0]


def test_checks_accept_the_release(release):
    _, hf, _ = release
    adapter, spec = load_spec(hf)
    check_hf_tensors(HFCheckpoint(hf), adapter, spec, hf / "config.json")


@pytest.mark.parametrize("bad", [(1, 4), (22, 4), (4, 22)])
def test_indexer_scale_of_the_wrong_shape_is_named(release, tmp_path, bad):
    arch, hf, stored = release
    tensors = {**stored, WK + "_scale_inv": torch.ones(bad)}  # wk (128, 64) needs (6, 4)
    d = write_checkpoint(hf, tmp_path / "hf", tensors)
    expect = f"scale '{WK}_scale_inv' has shape {bad}, expected (6, 4)"
    adapter, spec = load_spec(d)
    with pytest.raises(ValueError, match="do not fit the model") as err:
        check_hf_tensors(HFCheckpoint(d), adapter, spec, d / "config.json")
    assert f"{WK} (in model-0000" in str(err.value) and expect in str(err.value), str(err.value)
    with pytest.raises(ValueError, match=rf"tensor '{WK}' .*{expect.replace('(', '.').replace(')', '.')}"):
        dict(iter_mcore_tensors(d, adapter, spec))


def test_indexer_wq_b_without_its_scale_is_named(release, tmp_path):
    _, hf, stored = release
    d = write_checkpoint(hf, tmp_path / "hf", {n: t for n, t in stored.items() if n != WQ_B + "_scale_inv"})
    adapter, spec = load_spec(d)
    with pytest.raises(ValueError, match=f"{WQ_B} .*is F8_E4M3 but the checkpoint has no scale '{WQ_B}_scale_inv'"):
        check_hf_tensors(HFCheckpoint(d), adapter, spec, d / "config.json")
