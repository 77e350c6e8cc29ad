"""Slice rules of the sliced disaggregated sync (weight_sync/engine_shards.py, from the adapters' tensor maps).

References: vLLM's own vocab partition (`VocabParallelEmbedding._get_indices`), and for the linear layers the
property every split must have: the ranks' slices, joined in rank order, are the whole tensor (KV heads:
each head on t / kv_heads consecutive ranks, as vLLM's QKVParallelLinear replicates them). The loaders
themselves are checked against these slices in tests/distributed/test_weight_sync_disagg.py (a live TP2 engine).
"""
import pytest
import torch

from megatron_sparse_rl.models.spec import ModelSpec
from megatron_sparse_rl.weight_sync.engine_shards import Cut, EngineShards, expand


def _spec(kv_heads=2, vocab=300, architecture="Qwen3MoeForCausalLM"):
    """Layer 0 MoE, layer 1 dense, q/k/v biases: the model has every tensor named below (its adapter's names)."""
    return ModelSpec(architecture=architecture, vocab_size=vocab, hidden_size=64, num_layers=2, num_heads=4,
                     num_kv_heads=kv_heads, head_dim=16, ffn_hidden_size=96, num_experts=4, moe_topk=2,
                     moe_ffn_hidden_size=32, moe_layers=(True, False), qk_norm=True, qkv_bias=True)


ROWS = {"Qwen3MoeForCausalLM": ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.bias",
                                "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight",
                                "model.layers.0.mlp.experts.3.gate_proj.weight",
                                "model.layers.0.mlp.experts.3.up_proj.weight"],
        "MixtralForCausalLM": ["model.layers.0.block_sparse_moe.experts.1.w1.weight",
                               "model.layers.0.block_sparse_moe.experts.1.w3.weight"]}
COLS = {"Qwen3MoeForCausalLM": ["model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight",
                                "model.layers.0.mlp.experts.3.down_proj.weight"],
        "MixtralForCausalLM": ["model.layers.0.block_sparse_moe.experts.1.w2.weight"]}
WHOLE = ["model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
         "model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight",
         "model.layers.0.mlp.gate.weight", "model.layers.0.block_sparse_moe.gate.weight", "model.norm.weight"]


def _joined(shards, name, full):
    pieces = []
    for r in range(shards.tp):
        piece, where = shards.cut(name, full, r)
        assert where is not None, name
        assert torch.equal(piece, full.narrow(where.dim, where.start, where.length))
        pieces.append((where.start, piece, where.dim))
    return torch.cat([p for _, p, _ in sorted(pieces, key=lambda x: x[0])], dim=pieces[0][2])


@pytest.mark.parametrize("architecture", sorted(ROWS))
@pytest.mark.parametrize("tp", [2, 4])
def test_row_and_column_splits_partition_the_tensor(tp, architecture):
    shards = EngineShards(_spec(architecture=architecture), tp)
    full2d = torch.randn(64, 32)
    for name in ROWS[architecture] + COLS[architecture]:
        full = full2d[:, 0].clone() if name.endswith(".bias") else full2d
        assert torch.equal(_joined(shards, name, full), full), name
    for name in ROWS[architecture]:
        if name.endswith(".weight"):
            assert shards.slice_of(name, (64, 32), 1) == Cut((64, 32), 0, 64 // tp, 64 // tp)
    for name in COLS[architecture]:
        assert shards.slice_of(name, (64, 32), tp - 1) == Cut((64, 32), 1, 32 - 32 // tp, 32 // tp)


@pytest.mark.parametrize("kv_heads,tp", [(4, 2), (2, 2), (2, 4), (1, 4)])
def test_kv_heads_split_or_replicate(kv_heads, tp):
    shards = EngineShards(_spec(kv_heads=kv_heads), tp)
    full = torch.arange(kv_heads * 16 * 8, dtype=torch.float32).reshape(kv_heads * 16, 8)
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.bias"):
        x = full if name.endswith("weight") else full[:, 0].contiguous()
        rows = x.shape[0] // tp if kv_heads >= tp else 16
        for r in range(tp):
            piece, where = shards.cut(name, x, r)
            head = r * kv_heads // tp  # the KV head rank r serves: heads in order, each on tp/kv_heads ranks
            first = r * rows if kv_heads >= tp else head * 16
            assert (where.dim, where.start, where.length) == (0, first, rows)
            assert torch.equal(piece, x[first:first + rows])


@pytest.mark.parametrize("vocab,tp", [(300, 2), (300, 4), (256, 2), (70, 4), (151_936, 8)])
def test_vocab_rows_match_vllm_partition(vocab, tp):
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding, pad_vocab_size

    shards = EngineShards(_spec(vocab=vocab), tp)
    padded = pad_vocab_size(vocab)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        for r in range(tp):
            ref = VocabParallelEmbedding._get_indices(padded, padded, vocab, vocab, r, tp)
            where = shards.slice_of(name, (vocab, 64), r)
            assert (where.dim, where.start, where.length) == (
                0, ref.org_vocab_start_index, ref.org_vocab_end_index - ref.org_vocab_start_index), (name, r)


def test_whole_tensors_and_fallbacks():
    shards = EngineShards(_spec(), 2)
    for name in WHOLE:
        assert shards.slice_of(name, (64, 64), 1) is None, name
    # a split dimension that does not divide goes whole (vLLM narrows it itself)
    assert shards.slice_of("model.layers.0.self_attn.q_proj.weight", (63, 64), 0) is None
    assert shards.slice_of("model.layers.1.mlp.down_proj.weight", (64, 33), 1) is None
    # the slices are the adapter's: a name the model does not have (a Mixtral expert in a Qwen3-MoE) goes whole
    assert shards.slice_of("model.layers.0.block_sparse_moe.experts.1.w1.weight", (64, 64), 0) is None
    assert EngineShards(_spec(), 1).slice_of("model.layers.0.self_attn.q_proj.weight", (64, 64), 0) is None
    piece, where = shards.cut("model.layers.0.self_attn.q_proj.weight", torch.ones(4, 4, dtype=torch.int64), 0)
    assert where is None and piece.shape == (4, 4), "integer tensors travel whole"
    with pytest.raises(ValueError, match=r"engine rank must be in \[0, 2\) \(got 2\)"):
        shards.slice_of("model.norm.weight", (64,), 2)
    with pytest.raises(ValueError, match="must be >= 1"):
        EngineShards(_spec(), 0)


def test_expand_pads_with_nan_around_the_slice():
    full = torch.randn(8, 6)
    where = Cut((8, 6), 1, 2, 3)
    whole = expand(full[:, 2:5].clone(), where)
    assert torch.equal(whole[:, 2:5], full[:, 2:5])
    assert torch.isnan(whole[:, :2]).all() and torch.isnan(whole[:, 5:]).all()
    with pytest.raises(ValueError, match=r"a slice of shape \(8, 2\) does not fit"):
        expand(full[:, :2], where)
    with pytest.raises(ValueError, match="only floating-point"):
        expand(torch.ones(8, 3, dtype=torch.int32), where)
