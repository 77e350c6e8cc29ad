"""Engine tensor-parallel slices of the MLA attention tensors (DeepSeek-V3 / Kimi-K2) against vLLM's own loaders.

For each HF attention tensor, the layer vLLM 0.32's `DeepseekV2MLAAttention` builds for it (q_proj / q_b_proj /
kv_b_proj: ColumnParallelLinear; o_proj: RowParallelLinear; kv_a_proj_with_mqa: ReplicatedLinear, or with a q
LoRA the fused, TP-disabled q_a + kv_a projection) is built here as rank r of a t-rank engine (vLLM's TP rank
and size stubbed), and the full checkpoint tensor goes through that layer's weight loader: what the layer keeps
must be exactly the slice `EngineShards` cuts for rank r (the adapter's `engine_splits`), or the whole tensor
where it cuts none. tests/e2e/test_rollout_mla.py checks that the live engine builds those layer classes.
    .venv/bin/python -m pytest -q tests/unit/test_engine_shards_mla.py
"""
import pytest
import torch

vllm = pytest.importorskip("vllm")

HEADS = 4


def _spec(q_lora_rank):
    from megatron_sparse_rl.models import adapter_for
    from megatron_sparse_rl.models.deepseek import DeepseekV3Adapter
    from megatron_sparse_rl.models.tiny_families import deepseek_config_kwargs

    cfg = deepseek_config_kwargs(heads=HEADS, q_lora_rank=q_lora_rank)
    cfg.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_act="silu")
    spec = DeepseekV3Adapter().spec_from_hf(cfg)
    assert isinstance(adapter_for(spec), DeepseekV3Adapter)
    return spec


@pytest.fixture
def vllm_rank(monkeypatch):
    """`set(rank, tp)`: vLLM layers built afterwards are rank `rank` of a `tp`-rank engine."""
    import vllm.model_executor.layers.linear as linear
    import vllm.model_executor.parameter as parameter
    from vllm.config import VllmConfig, set_current_vllm_config

    def set_rank(rank, tp):
        for module in (linear, parameter):
            monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda: rank)
            monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: tp)

    with set_current_vllm_config(VllmConfig()):
        yield set_rank


def _vllm_layers(spec):
    """HF attention tensor (layer 0) -> (build the vLLM layer that loads it, loaded shard id), as
    vllm/model_executor/models/deepseek_v2.py:DeepseekV2MLAAttention builds them."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
    from vllm.model_executor.models.deepseek_v2 import DeepSeekV2FusedQkvAProjLinear

    h, qk = spec.hidden_size, spec.qk_nope_head_dim + spec.qk_rope_head_dim
    latent = spec.kv_lora_rank + spec.qk_rope_head_dim
    att = "model.layers.0.self_attn"
    layers = {
        f"{att}.kv_b_proj.weight": (lambda: ColumnParallelLinear(
            spec.kv_lora_rank, HEADS * (spec.qk_nope_head_dim + spec.v_head_dim), bias=False), None),
        f"{att}.o_proj.weight": (lambda: RowParallelLinear(HEADS * spec.v_head_dim, h, bias=False), None),
    }
    if spec.q_lora_rank is None:
        layers[f"{att}.q_proj.weight"] = (lambda: ColumnParallelLinear(h, HEADS * qk, bias=False), None)
        layers[f"{att}.kv_a_proj_with_mqa.weight"] = (lambda: ReplicatedLinear(h, latent, bias=False), None)
    else:
        fused = lambda: DeepSeekV2FusedQkvAProjLinear(h, [spec.q_lora_rank, latent])  # noqa: E731
        layers[f"{att}.q_b_proj.weight"] = (lambda: ColumnParallelLinear(spec.q_lora_rank, HEADS * qk, bias=False),
                                            None)
        layers[f"{att}.q_a_proj.weight"] = (fused, 0)
        layers[f"{att}.kv_a_proj_with_mqa.weight"] = (fused, 1)
    return layers


def _shapes(spec) -> dict:
    from megatron_sparse_rl.models import adapter_for

    return {n: s for tm in adapter_for(spec).tensor_maps(spec) for n, s in zip(tm.hf, tm.shapes)}


def _loaded(layer, full, shard):
    """What `layer` keeps of `full` after its weight loader ran (its rows of a fused layer's shard)."""
    layer.weight.data.fill_(float("nan"))
    if shard is None:
        layer.weight.weight_loader(layer.weight, full)
        return layer.weight.data
    layer.weight.weight_loader(layer.weight, full, shard)
    start = sum(layer.output_partition_sizes[:shard])
    return layer.weight.data[start:start + layer.output_partition_sizes[shard]]


@pytest.mark.parametrize("q_lora_rank", [None, 32])
@pytest.mark.parametrize("tp", [2, 4])
def test_mla_slices_are_what_vllm_loads(vllm_rank, q_lora_rank, tp):
    from megatron_sparse_rl.weight_sync.engine_shards import EngineShards

    spec = _spec(q_lora_rank)
    shards, shapes = EngineShards(spec, tp), _shapes(spec)
    g = torch.Generator().manual_seed(0)
    sliced = set()
    for name, (build, shard) in _vllm_layers(spec).items():
        full = torch.randn(shapes[name], generator=g)
        for rank in range(tp):
            vllm_rank(rank, tp)
            got = _loaded(build(), full, shard)
            piece, where = shards.cut(name, full, rank)
            assert not torch.isnan(got).any(), name
            assert torch.equal(got, piece), f"{name}: engine rank {rank} of {tp} loads another slice than we cut"
            if where is not None:
                sliced.add(name.split(".")[-2])
    want = {"q_proj" if q_lora_rank is None else "q_b_proj", "kv_b_proj", "o_proj"}
    assert sliced == want, "the per-head projections travel as slices, the latent projections whole"


@pytest.mark.parametrize("q_lora_rank", [None, 32])
def test_latent_norms_and_router_travel_whole(q_lora_rank):
    from megatron_sparse_rl.weight_sync.engine_shards import EngineShards

    spec = _spec(q_lora_rank)
    shards, shapes = EngineShards(spec, 2), _shapes(spec)
    whole = ["model.layers.0.self_attn.kv_a_layernorm.weight", "model.layers.1.mlp.gate.weight",
             "model.layers.1.mlp.gate.e_score_correction_bias"]
    if q_lora_rank is not None:
        whole.append("model.layers.0.self_attn.q_a_layernorm.weight")
    for name in whole:
        assert shards.slice_of(name, shapes[name], 1) is None, name
