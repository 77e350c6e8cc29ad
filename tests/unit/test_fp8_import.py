"""Import of block-wise fp8 release checkpoints (DeepSeek-V3 / Kimi-K2 style) and their multi-token-prediction
layers, through the project's one HF reader (`formats/hf_io.py`) and the conversion checks
(`checkpoint/checks.py`), without a process group.

The quantised checkpoint is made here from a tiny DeepSeek-V3: every projection weight of the decoder layers is
stored as float8_e4m3fn with a float32 `_scale_inv` per (16, 24) block (read from quantization_config, so the
tiny shapes have many blocks and partial ones: 64 columns are 24 + 24 + 16, 24 rows are 16 + 8), in two
safetensors shards with an index, scales mostly in the other shard than their weight. The reference
dequantisation is computed block by block in this file, in float64 (exact: a 4-bit by 24-bit mantissa product)
and in float32."""
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_sparse_rl.checkpoint.checks import check_hf_tensors
from megatron_sparse_rl.formats.hf_io import HFCheckpoint, iter_mcore_tensors
from megatron_sparse_rl.formats.hf_writer import write_side_files
from megatron_sparse_rl.models import load_spec
from megatron_sparse_rl.models.tiny_families import build_tiny_deepseek

BLOCK = (16, 24)
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
LAYERS = 3  # the tiny model's decoder layers; the MTP layer is numbered 3
E4M3_MAX = 448.0
GATE = "model.layers.1.mlp.experts.0.gate_proj.weight"  # (24, 64): partial blocks in both dimensions
UP = "model.layers.1.mlp.experts.0.up_proj.weight"
KV_B = "model.layers.2.self_attn.kv_b_proj.weight"  # (256, 512)
ROUTER = "model.layers.1.mlp.gate.weight"  # not quantised (as in the release checkpoints)


# ---- the independent reference -----------------------------------------------------------------------------
def _blocks(shape, block):
    for i in range(0, shape[0], block[0]):
        for j in range(0, shape[1], block[1]):
            yield i // block[0], j // block[1], slice(i, i + block[0]), slice(j, j + block[1])


def quantise(w: torch.Tensor, block=BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv) with each block's absolute maximum mapped to the e4m3 maximum."""
    rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
    scale, q = torch.empty(rows, cols, dtype=torch.float32), torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for bi, bj, r, c in _blocks(w.shape, block):
        s = w[r, c].abs().max().clamp_min(1e-8) / E4M3_MAX
        scale[bi, bj] = s
        q[r, c] = (w[r, c] / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantise(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block=BLOCK) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=dtype)
    for bi, bj, r, c in _blocks(q.shape, block):
        out[r, c] = q[r, c].to(dtype) * scale[bi, bj].to(dtype)
    return out


# ---- the quantised checkpoint -------------------------------------------------------------------------------
def mtp_layer(tensors: dict, layer: int, *, last: int = LAYERS - 1) -> dict:
    """A multi-token-prediction layer as the release checkpoints store it: a decoder layer (a copy of decoder layer
    `last`, a DSA model's indexer included) plus its own embedding, projection, norms and head, numbered `layer`,
    after the last decoder layer."""
    src, dst = f"model.layers.{last}.", f"model.layers.{layer}."
    out = {dst + k[len(src):]: v.clone() for k, v in tensors.items() if k.startswith(src)}
    h = tensors["model.norm.weight"].shape[0]
    out.update({dst + "eh_proj.weight": torch.randn(h, 2 * h), dst + "enorm.weight": torch.ones(h),
                dst + "hnorm.weight": torch.ones(h), dst + "shared_head.norm.weight": torch.ones(h),
                dst + "shared_head.head.weight": tensors["lm_head.weight"].clone(),
                dst + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone()})
    return out


def _quantised(plain: dict, mtp: int) -> dict:
    tensors = dict(plain)
    for layer in range(LAYERS, LAYERS + mtp):
        tensors.update(mtp_layer(plain, layer))
    for name in [n for n in tensors if n.startswith("model.layers.") and n.endswith("proj.weight")]:
        tensors[name], tensors[name + "_scale_inv"] = quantise(tensors[name])
    return tensors


def write_checkpoint(src: Path, out: Path, tensors: dict, **config) -> Path:
    """`tensors` in two shards with an index (a weight and its scale mostly in different shards), the side files
    of `src` and its config.json updated with `config` (None values delete a key)."""
    out.mkdir(parents=True)
    for p in src.iterdir():
        if p.name != "model.safetensors" and p.is_file():
            shutil.copy(p, out / p.name)
    cfg = {**json.loads((src / "config.json").read_text()), **config}
    (out / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k not in config or v is not None},
                                                indent=2))
    names = sorted(tensors)
    files = {n: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, n in enumerate(names)}
    for f in sorted(set(files.values())):
        save_file({n: tensors[n].contiguous() for n in names if files[n] == f}, str(out / f), metadata={"format": "pt"})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": files}))
    return out


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """(directory, tensors) of a tiny fp32 DeepSeek-V3 with FFN sizes that are not multiples of the block."""
    d = build_tiny_deepseek(tmp_path_factory.mktemp("plain"), seed=3, layers=LAYERS, moe_ffn=24, ffn=40)
    return d, load_file(str(d / "model.safetensors"))


@pytest.fixture(scope="module")
def stored(plain):
    """The quantised tensors of the tiny model plus one MTP layer, as a release checkpoint stores them."""
    return _quantised(plain[1], mtp=1)


@pytest.fixture(scope="module")
def release(plain, stored, tmp_path_factory):
    return write_checkpoint(plain[0], tmp_path_factory.mktemp("rel") / "hf", stored, quantization_config=QUANT,
                            num_nextn_predict_layers=1, torch_dtype="bfloat16")


def _variant(plain, tmp_path, stored, edit=None, **config) -> Path:
    tensors = dict(stored)
    if edit:
        edit(tensors)
    return write_checkpoint(plain[0], tmp_path / "hf", tensors, **{"quantization_config": QUANT,
                                                                   "num_nextn_predict_layers": 1, **config})


def _check(d: Path):
    adapter, spec = load_spec(d)
    check_hf_tensors(HFCheckpoint(d), adapter, spec, d / "config.json")


# ---- dequantisation -----------------------------------------------------------------------------------------
def test_fp8_weights_read_back_dequantised_exactly(release, stored, plain):
    ckpt = HFCheckpoint(release)
    quantised = [n for n, t in stored.items() if t.dtype == torch.float8_e4m3fn]
    assert GATE in quantised and KV_B in quantised and len(quantised) > 40
    assert {ckpt.weight_map[GATE], ckpt.weight_map[GATE + "_scale_inv"]} == {"model-00001-of-00002.safetensors",
                                                                            "model-00002-of-00002.safetensors"}
    for name in quantised:
        q, scale = stored[name], stored[name + "_scale_inv"]
        got, exact = ckpt.get(name), dequantise(q, scale, torch.float64)
        assert got.dtype == torch.float32 and got.shape == q.shape, name
        assert torch.equal(got, dequantise(q, scale, torch.float32)), name   # the float32 product
        assert torch.equal(got, exact.to(torch.float32)), name               # = the exact one rounded once
        assert ((got.double() - exact).abs() <= exact.abs() * 2.0 ** -24).all(), name
        assert ckpt.header(name) == ("float32", tuple(q.shape), q.numel() * 4)
    # what the release keeps unquantised comes through untouched
    assert ckpt.get(ROUTER).dtype == torch.float32 and torch.equal(ckpt.get(ROUTER), plain[1][ROUTER])
    # quantisation really changed the weights (the test would pass on a no-op otherwise)
    assert not torch.equal(ckpt.get(GATE), plain[1][GATE])
    assert (ckpt.get(GATE) - plain[1][GATE]).abs().max() < 0.1 * plain[1][GATE].abs().max()


def test_mcore_tensors_are_built_from_the_dequantised_weights(release, stored, caplog):
    adapter, spec = load_spec(release)
    caplog.set_level(logging.INFO)
    fc1 = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"
    kv_up = "decoder.layers.2.self_attention.linear_kv_up_proj.weight"
    router = "decoder.layers.1.mlp.router.weight"
    got = dict(iter_mcore_tensors(release, adapter, spec, wanted={fc1, kv_up, router}))
    ref = {n: dequantise(stored[n], stored[n + "_scale_inv"], torch.float64).float() for n in (GATE, UP, KV_B)}
    assert torch.equal(got[fc1], torch.cat([ref[GATE], ref[UP]]))  # Megatron's fc1 = [gate; up]
    assert torch.equal(got[kv_up], ref[KV_B])
    assert torch.equal(got[router], stored[ROUTER])
    mtp_logs = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert len(mtp_logs) == 1 and "layer(s) 3 " in mtp_logs[0]


# ---- the checks -----------------------------------------------------------------------------------------------
def test_checks_accept_the_release_checkpoint_and_skip_its_mtp_layer_once(release, stored, caplog):
    caplog.set_level(logging.INFO)
    _check(release)
    mtp = [n for n in stored if n.startswith(f"model.layers.{LAYERS}.")]
    assert any(n.endswith("_scale_inv") for n in mtp) and any("eh_proj" in n for n in mtp)
    logs = [r for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert len(logs) == 1 and logs[0].levelno == logging.INFO
    assert f"skipping {len(mtp)} tensors of multi-token-prediction layer(s) 3 (num_nextn_predict_layers=1)" \
        in logs[0].getMessage()


def test_fp8_weight_without_its_scale_is_named(plain, stored, tmp_path):
    d = _variant(plain, tmp_path, stored, lambda t: t.pop(GATE + "_scale_inv"))
    with pytest.raises(ValueError, match="do not fit the model") as err:
        _check(d)
    assert f"{GATE} (in " in str(err.value) and f"no scale '{GATE}_scale_inv'" in str(err.value)
    with pytest.raises(ValueError, match=rf"tensor '{GATE}' \(in model-0000\d-of-00002.safetensors\) is F8_E4M3 but "
                                         rf"the checkpoint has no scale '{GATE}_scale_inv'"):
        HFCheckpoint(d).get(GATE)


def test_scale_of_the_wrong_shape_is_named(plain, stored, tmp_path):
    d = _variant(plain, tmp_path, stored, lambda t: t.update({GATE + "_scale_inv": torch.ones(1, 3)}))
    expect = f"scale '{GATE}_scale_inv' has shape (1, 3), expected (2, 3)"
    with pytest.raises(ValueError, match="do not fit the model") as err:
        _check(d)
    assert expect in str(err.value) and "weight_block_size [16, 24]" in str(err.value)
    with pytest.raises(ValueError, match=expect.replace("(", r"\(").replace(")", r"\)")):
        HFCheckpoint(d).get(GATE)


def test_scale_without_its_weight_is_named(plain, stored, tmp_path):
    orphan = "model.layers.0.mlp.extra_scale_inv"
    d = _variant(plain, tmp_path, stored, lambda t: t.update({orphan: torch.ones(1)}))
    with pytest.raises(ValueError, match=rf"1 fp8 scale tensor\(s\) without their weight, e.g. '{orphan}' "
                                         r"\(in .*\) but no 'model.layers.0.mlp.extra'"):
        _check(d)


def test_a_wrong_shape_is_still_refused_in_a_quantised_checkpoint(plain, stored, tmp_path):
    def transpose(t):  # the weight transposed, with a scale that fits the transposed weight
        t[GATE], t[GATE + "_scale_inv"] = quantise(plain[1][GATE].t().contiguous())

    with pytest.raises(ValueError, match="do not fit the model") as err:
        _check(_variant(plain, tmp_path, stored, transpose))
    assert f"{GATE} (in model-0000" in str(err.value) and "expected shape (24, 64), found (64, 24)" in str(err.value)


def test_scale_on_a_weight_that_is_not_fp8_is_refused(plain, stored, tmp_path):
    d = _variant(plain, tmp_path, stored, lambda t: t.update({GATE: plain[1][GATE]}))
    with pytest.raises(ValueError, match=f"has a scale '{GATE}_scale_inv' but is stored as F32, not F8_E4M3"):
        _check(d)


@pytest.mark.parametrize("quant,shown", [
    ({**QUANT, "quant_method": "awq"}, "quantization_config.quant_method 'awq' is not supported (supported: fp8"),
    ({**QUANT, "fmt": "e5m2"}, "quantization_config.fmt 'e5m2' is not supported (supported: e4m3"),
    ({**QUANT, "activation_scheme": "static"}, "quantization_config.activation_scheme 'static' is not supported"),
    ({k: v for k, v in QUANT.items() if k != "weight_block_size"},
     "quantization_config.weight_block_size must be two positive integers such as [128, 128] (got None)"),
])
def test_unsupported_quantization_config_is_named(quant, shown, plain, stored, tmp_path):
    d = _variant(plain, tmp_path, stored, quantization_config=quant)
    with pytest.raises(ValueError) as err:
        HFCheckpoint(d)
    assert str(err.value).startswith(f"{d / 'config.json'}: {shown}"), str(err.value)


def test_fp8_weight_without_quantization_config_is_refused(plain, stored, tmp_path):
    d = _variant(plain, tmp_path, stored, quantization_config=None)
    with pytest.raises(ValueError, match=f"tensor '{GATE}' .* is F8_E4M3 but .*config.json has no quantization_config"):
        HFCheckpoint(d).get(GATE)
    with pytest.raises(ValueError, match="unmapped .*_scale_inv"):  # the scales are nobody's tensors then
        _check(d)


def test_layers_past_the_mtp_layers_are_still_unknown(plain, stored, tmp_path):
    extra = "model.layers.4.input_layernorm.weight"
    d = _variant(plain, tmp_path, stored, lambda t: t.update({extra: torch.ones(64)}))
    with pytest.raises(ValueError, match=rf"unmapped \['{extra}'\] \(1\)"):
        _check(d)


def test_mtp_layers_without_num_nextn_predict_layers_are_unknown(plain, stored, tmp_path):
    d = _variant(plain, tmp_path, stored, num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match=r"unmapped \['model.layers.3.eh_proj.weight', "):
        _check(d)


# ---- export --------------------------------------------------------------------------------------------------
def test_exported_config_claims_no_quantisation_and_no_mtp_layers(release, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    names = write_side_files(release, tmp_path / "out")
    assert "config.json" in names and "tokenizer.json" in names
    src, out = (json.loads((d / "config.json").read_text()) for d in (release, tmp_path / "out"))
    assert "quantization_config" not in out and out["num_nextn_predict_layers"] == 0
    assert {k: v for k, v in src.items() if k not in ("quantization_config", "num_nextn_predict_layers")} == \
        {k: v for k, v in out.items() if k != "num_nextn_predict_layers"}
    logs = [r.getMessage() for r in caplog.records if "num_nextn_predict_layers 1 -> 0" in r.getMessage()]
    assert len(logs) == 1 and "quantization_config (fp8) dropped" in logs[0]


def test_hf_to_mcore_verify_on_a_quantised_input_is_refused_before_anything_is_written(release, tmp_path):
    from megatron_sparse_rl.checkpoint.convert import hf_to_mcore

    with pytest.raises(ValueError, match=r"--verify .* fp8 .* mcore-to-hf \.\.\. --verify"):
        hf_to_mcore(release, tmp_path / "out", tp=1, ep=1, verify=True)
    assert not (tmp_path / "out").exists()
