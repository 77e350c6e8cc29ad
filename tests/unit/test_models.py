"""Model adapters, tensor maps and the parallel layout's checks, against hand-built references."""
import json

import pytest
import torch

from megatron_sparse_rl.config.schema import ParallelConfig
from megatron_sparse_rl.models import ADAPTERS, get_adapter, load_spec
from megatron_sparse_rl.models.spec import ModelSpec
from megatron_sparse_rl.models.tensor_map import TensorMap, to_hf, to_mcore
from megatron_sparse_rl.models.tiny import build_tiny_hf_model
from megatron_sparse_rl.parallel import ParallelLayout


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_tiny_hf_model(tmp_path_factory.mktemp("m"), experts=4, topk=2)


def test_unknown_architecture_lists_supported():
    with pytest.raises(ValueError, match="unsupported architecture 'LlamaForCausalLM'; supported: .*Qwen3MoeForCausalLM"):
        get_adapter({"architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ValueError, match="exactly one architecture"):
        get_adapter({})


def test_adapter_lookup_is_exact():
    assert set(ADAPTERS) == {"Qwen3MoeForCausalLM", "Qwen3ForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM",
                             "DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"}
    with pytest.raises(ValueError):
        get_adapter({"architectures": ["Qwen3MoeForCausalLMX"]})


def test_tensor_map_covers_every_hf_tensor_once(moe_dir):
    from safetensors import safe_open

    adapter, spec = load_spec(moe_dir)
    with safe_open(str(moe_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    mapped = [n for tm in adapter.tensor_maps(spec) for n in tm.hf]
    assert sorted(mapped) == sorted(names)


def test_spec_parameter_count_matches_checkpoint(moe_dir):
    from safetensors import safe_open

    _, spec = load_spec(moe_dir)
    with safe_open(str(moe_dir / "model.safetensors"), "pt") as f:
        total = sum(f.get_tensor(k).numel() for k in f.keys())
    assert spec.parameter_count() == total


def test_qkv_fusion_matches_grouped_layout():
    spec = ModelSpec(architecture="x", vocab_size=8, hidden_size=6, num_layers=1, num_heads=4, num_kv_heads=2,
                     head_dim=3, ffn_hidden_size=4)
    q, k, v = torch.randn(12, 6), torch.randn(6, 6), torch.randn(6, 6)
    tm = TensorMap("qkv", ("q", "k", "v"), "qkv")
    fused = to_mcore(tm, [q, k, v], spec)
    # hand-written reference: for each KV group g, its 2 query heads, then its key head, then its value head
    rows = []
    for g in range(2):
        rows += [q[(2 * g + j) * 3:(2 * g + j + 1) * 3] for j in range(2)]
        rows += [k[g * 3:(g + 1) * 3], v[g * 3:(g + 1) * 3]]
    assert torch.equal(fused, torch.cat(rows))
    assert all(torch.equal(a, b) for a, b in zip(to_hf(tm, fused, spec), [q, k, v]))


def test_glu_fusion_stacks_gate_then_up():
    spec = ModelSpec(architecture="x", vocab_size=8, hidden_size=6, num_layers=1, num_heads=2, num_kv_heads=2,
                     head_dim=3, ffn_hidden_size=4)
    gate, up = torch.randn(4, 6), torch.randn(4, 6)
    tm = TensorMap("fc1", ("g", "u"), "glu")
    fused = to_mcore(tm, [gate, up], spec)
    assert torch.equal(fused[:4], gate) and torch.equal(fused[4:], up)
    assert all(torch.equal(a, b) for a, b in zip(to_hf(tm, fused, spec), [gate, up]))


def _spec(moe_dir):
    return load_spec(moe_dir)[1]


@pytest.mark.parametrize("cfg,world,message", [
    (dict(tp=3), 3, "parallel.tp=3 must divide the attention heads"),
    (dict(ep=3), 3, "parallel.ep=3 must divide the expert count"),
    (dict(tp=2), 2, "parallel.sequence_parallel must be true"),
])
def test_layout_rejects_model_it_cannot_shard(moe_dir, cfg, world, message):
    layout = ParallelLayout.from_config(ParallelConfig(**cfg), world)
    with pytest.raises(ValueError, match=message):
        layout.check_model(_spec(moe_dir))


def test_layout_rejects_world_size():
    with pytest.raises(ValueError, match="world size 3 is not divisible by parallel.tp \\* parallel.pp = 2 \\* 1"):
        ParallelLayout.from_config(ParallelConfig(tp=2), 3)
    with pytest.raises(ValueError, match="not divisible by parallel.ep \\* parallel.etp"):
        ParallelLayout.from_config(ParallelConfig(ep=4), 2)


def test_layout_data_parallel_is_the_rest():
    layout = ParallelLayout.from_config(ParallelConfig(tp=2, ep=2, sequence_parallel=True), 8)
    assert (layout.tp, layout.ep, layout.dp) == (2, 2, 4)


def test_hf_checkpoint_errors(tmp_path, moe_dir):
    from megatron_sparse_rl.formats.hf_io import HFCheckpoint

    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        HFCheckpoint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        HFCheckpoint(tmp_path)
    index = {"weight_map": {"a.weight": "model-00001.safetensors"}}
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="shard 'model-00001.safetensors' named in .* is missing"):
        HFCheckpoint(tmp_path).get("a.weight")
    with pytest.raises(KeyError, match="'b.weight' is not in the checkpoint"):
        HFCheckpoint(tmp_path).get("b.weight")
