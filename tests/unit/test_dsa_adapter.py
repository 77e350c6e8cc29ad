"""DSA adapters (models/dsa.py): DeepSeek-V3.2 and GLM-5 config.json -> spec -> Megatron config, the indexer's rope
layout between transformers and Megatron (checked with both libraries' own rope functions), the "rows" tensor
kind, and clear refusals.
Run: .venv/bin/python -m pytest -q tests/unit/test_dsa_adapter.py
"""
import pytest
import torch

from megatron_sparse_rl.models import get_adapter
from megatron_sparse_rl.models.dsa import DsaSpec, indexer_row_order
from megatron_sparse_rl.models.tensor_map import TensorMap, to_hf, to_mcore
from megatron_sparse_rl.models.tiny_families import deepseek_config_kwargs


def _cfg(arch="DeepseekV32ForCausalLM", model_type="deepseek_v32", **over):
    cfg = {**deepseek_config_kwargs(q_lora_rank=32, rope="default"), "architectures": [arch],
           "model_type": model_type, "index_n_heads": 16, "index_head_dim": 128, "index_topk": 4}
    cfg.update(over)
    return {k: v for k, v in cfg.items() if v is not None}


def test_spec_and_megatron_config_from_config_json():
    adapter = get_adapter(_cfg())
    spec = adapter.spec_from_hf(_cfg())
    assert isinstance(spec, DsaSpec) and spec.architecture == "DeepseekV32ForCausalLM"
    assert (spec.index_n_heads, spec.index_head_dim, spec.index_topk, spec.indexer_rope_interleaved) == (16, 128, 4,
                                                                                                         False)
    assert get_adapter(_cfg("GlmMoeDsaForCausalLM", "glm_moe_dsa")).spec_from_hf(
        _cfg("GlmMoeDsaForCausalLM", "glm_moe_dsa")).indexer_rope_interleaved
    kw = adapter.config_kwargs(spec, tp=1, pp=1, ep=1, etp=1, sequence_parallel=False, dtype=torch.float32,
                               recompute=False, aux_loss_coeff=0.0)  # MLATransformerConfig's: built in test_dsa.py
    assert kw["experimental_attention_variant"] == "dsa" and kw["multi_latent_attention"]
    assert (kw["dsa_indexer_n_heads"], kw["dsa_indexer_head_dim"], kw["dsa_indexer_topk"]) == (16, 128, 4)
    assert kw["dsa_indexer_loss_coeff"] == 0.0  # Megatron multiplies by it whenever it trains: None would raise
    # by hand: wq_b 32 x 16*128, wk 64 x 128, k_norm 2 x 128, weights_proj 64 x 16
    assert spec.indexer_params == 32 * 2048 + 64 * 128 + 256 + 64 * 16


def test_indexer_row_order_by_hand():
    # HF head [r0 r1 r2 r3 | n0 n1 n2 n3] (rope first); Megatron [nope | rope], its rope read interleaved
    assert indexer_row_order(8, 4, 1, interleaved=False) == (4, 5, 6, 7, 0, 2, 1, 3)  # halves (0,1),(2,3) -> pairs
    assert indexer_row_order(8, 4, 1, interleaved=True) == (4, 5, 6, 7, 0, 1, 2, 3)
    assert indexer_row_order(8, 4, 2, interleaved=True)[8:] == (12, 13, 14, 15, 8, 9, 10, 11)


@pytest.mark.parametrize("interleaved", [False, True], ids=["deepseek_v32", "glm_moe_dsa"])
def test_megatron_rope_on_reordered_rows_is_transformers_rope(interleaved):
    """transformers' indexer rope on the HF layout (half-split for DeepSeek-V3.2, interleaved for GLM-5) equals
    Megatron's DSAIndexer rope (rope_utils with multi_latent_attention: de-interleave, then half-split) on the
    rows the tensor map gives Megatron; the results hold the same values, [pass | rope] in Megatron."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

    seq, dim, rope = 5, 16, 8
    g = torch.Generator().manual_seed(0)
    x = torch.randn(seq, dim, generator=g, dtype=torch.float64)
    inv = 1.0 / (10000 ** (torch.arange(0, rope, 2, dtype=torch.float64) / rope))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float64), inv)
    emb = torch.cat((freqs, freqs), -1)
    rot = apply_rotary_pos_emb_interleave if interleaved else apply_rotary_pos_emb
    hf_rot, _ = rot(x[None, :, None, :rope], x[None, :, None, :rope], emb.cos()[None], emb.sin()[None],
                    unsqueeze_dim=2)
    hf = torch.cat((hf_rot[0, :, 0], x[:, rope:]), -1)
    mc_in = x[:, list(indexer_row_order(dim, rope, 1, interleaved))]
    pe = _apply_rotary_pos_emb_bshd(mc_in[:, None, None, dim - rope:], emb[:, None, None], rotary_interleaved=False,
                                    multi_latent_attention=True)
    mc = torch.cat((mc_in[:, :dim - rope], pe[:, 0, 0]), -1)
    assert torch.allclose(mc, torch.cat((hf[:, rope:], hf[:, :rope]), -1), atol=1e-12)
    wrong = x[:, list(indexer_row_order(dim, rope, 1, not interleaved))]
    pe_wrong = _apply_rotary_pos_emb_bshd(wrong[:, None, None, dim - rope:], emb[:, None, None],
                                          multi_latent_attention=True)
    assert not torch.allclose(pe_wrong[:, 0, 0], hf[:, :rope], atol=1e-3)  # the other layout would differ


def test_rows_kind_round_trip_and_validation():
    tm = TensorMap("m", ("h",), "rows", shapes=((4, 2),), rows=(2, 0, 3, 1))
    hf = torch.arange(8.0).reshape(4, 2)
    mc = to_mcore(tm, [hf], None)
    assert mc[:, 0].tolist() == [4.0, 0.0, 6.0, 2.0]
    assert torch.equal(to_hf(tm, mc, None)[0], hf)
    with pytest.raises(ValueError, match="permutation"):
        TensorMap("m", ("h",), "rows", rows=(0, 0, 1))
    with pytest.raises(ValueError, match="kind 'rows' needs"):
        TensorMap("m", ("h",), "rows")


@pytest.mark.parametrize("over,err,match", [
    ({"index_topk": None}, ValueError, "index_topk"),
    ({"index_head_dim": 96}, ValueError, "index_head_dim must be a power of two"),
    ({"q_lora_rank": None}, ValueError, "q_lora_rank"),
    ({"model_type": "deepseek_v3"}, ValueError, "model_type 'deepseek_v3'"),
    ({"layer_types": ["indexed_attention", "full_attention", "indexed_attention"]}, NotImplementedError,
     "layer_types"),
    ({"mlp_layer_types": ["sparse", "sparse", "sparse"]}, NotImplementedError, "mlp_layer_types"),
])
def test_bad_configs_are_refused_naming_the_key(over, err, match):
    with pytest.raises(err, match=match):
        get_adapter(_cfg()).spec_from_hf(_cfg(**over))


@pytest.mark.parametrize("over", [{"index_topk_freq": 2}, {"indexer_types": ["full", "shared", "full"]},
                                  {"index_topk_pattern": "FSF"}])
def test_glm_shared_index_layers_are_refused(over):
    cfg = _cfg("GlmMoeDsaForCausalLM", "glm_moe_dsa", **over)
    with pytest.raises(NotImplementedError, match="Megatron-Core 0.16.1's DSA runs an indexer in every layer"):
        get_adapter(cfg).spec_from_hf(cfg)


def test_indexer_shapes_that_do_not_fit_the_weights_are_refused_naming_the_tensor(tmp_path):
    """A config.json whose index_n_heads does not match the checkpoint: the pre-conversion header check names the
    indexer tensors with expected and found shapes (nothing is read or written)."""
    import json

    from megatron_sparse_rl.checkpoint.checks import check_hf_tensors
    from megatron_sparse_rl.formats.hf_io import HFCheckpoint
    from megatron_sparse_rl.models import load_spec
    from megatron_sparse_rl.models.tiny_families import build_tiny_dsa

    hf = build_tiny_dsa(tmp_path / "hf", layers=1, first_k_dense=1, index_heads=16)
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "index_n_heads": 8}))
    adapter, spec = load_spec(hf)
    with pytest.raises(ValueError) as e:
        check_hf_tensors(HFCheckpoint(hf), adapter, spec, hf / "config.json")
    assert "model.layers.0.self_attn.indexer.wq_b.weight (in model.safetensors): expected shape (1024, 32), found " \
           "(2048, 32)" in str(e.value)
    assert "model.layers.0.self_attn.indexer.weights_proj.weight (in model.safetensors): expected shape (8, 64), " \
           "found (16, 64)" in str(e.value)
