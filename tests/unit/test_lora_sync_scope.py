"""weight_sync/scope.py without a model: what a LoRA sync sends once the engines hold a full set (the adapted HF
modules' tensors, biases and vLLM's MLA fused_qkv_a_proj partner included, listed by hand here), and when it sends
everything (the first sync, after a failed one, a learner without adapters).

    .venv/bin/python -m pytest -q tests/unit/test_lora_sync_scope.py
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_sparse_rl.models import get_adapter
from megatron_sparse_rl.models.tiny_families import deepseek_config_kwargs
from megatron_sparse_rl.weight_sync import SyncStats, WeightSyncError
from megatron_sparse_rl.weight_sync.scope import EngineWeightState, adapted_hf_names

QWEN = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 2, "intermediate_size": 8, "vocab_size": 16, "attention_bias": True}


def _maps(cfg):
    adapter = get_adapter(cfg)
    spec = adapter.spec_from_hf(cfg)
    return adapter, spec, adapter.tensor_maps(spec)


def test_qkv_biases_travel_with_their_adapted_weights():
    """An adapter on q_proj of layer 1 alone: vLLM's qkv_proj holds q/k/v weights and biases in one layer, which
    reloads whole, so all six tensors travel; nothing of layer 0 or the MLP."""
    _, _, maps = _maps(QWEN)
    names = adapted_hf_names(maps, {"decoder.layers.1.self_attention.linear_qkv.weight"})
    att = "model.layers.1.self_attn"
    assert names == {f"{att}.{m}.{kind}" for m in ("q_proj", "k_proj", "v_proj") for kind in ("weight", "bias")}
    assert adapted_hf_names(maps, set()) == frozenset()


def test_mla_down_projections_travel_together():
    """DeepSeek-V3 with q_lora_rank: an adapter on kv_a_proj_with_mqa alone sends q_a_proj too (vLLM's
    fused_qkv_a_proj); an adapter on kv_b_proj sends kv_b_proj alone."""
    cfg = {"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 32,
           **deepseek_config_kwargs(layers=2, q_lora_rank=16)}
    _, _, maps = _maps(cfg)
    down = next(tm.mcore for tm in maps if tm.hf == ("model.layers.1.self_attn.kv_a_proj_with_mqa.weight",))
    assert adapted_hf_names(maps, {down}) == {"model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
                                              "model.layers.1.self_attn.q_a_proj.weight"}
    up = next(tm.mcore for tm in maps if tm.hf == ("model.layers.0.self_attn.kv_b_proj.weight",))
    assert adapted_hf_names(maps, {up}) == {"model.layers.0.self_attn.kv_b_proj.weight"}


def _learner(adapted):
    adapter, spec, _ = _maps(QWEN)
    return SimpleNamespace(adapter=adapter, spec=spec, lora_weights=adapted)


def _stats(nbytes):
    return SyncStats(nbytes, 0.1, 1, 1)


def test_the_first_sync_sends_everything_then_the_adapted_tensors_alone():
    learner = _learner({"decoder.layers.0.self_attention.linear_proj.weight": object()})
    state, asked = EngineWeightState(), []

    def send(only):
        asked.append(only)
        return _stats(1000 if only is None else 10)

    first, second, third = (state.sync(learner, send) for _ in range(3))
    assert asked == [None, {"model.layers.0.self_attn.o_proj.weight"}, {"model.layers.0.self_attn.o_proj.weight"}]
    assert (first.bytes, first.full_bytes) == (1000, 1000)
    assert (second.bytes, second.full_bytes) == (third.bytes, third.full_bytes) == (10, 1000)


def test_a_failed_sync_sends_everything_next():
    learner = _learner({"decoder.layers.0.self_attention.linear_proj.weight": object()})
    state, asked = EngineWeightState(), []

    def fails(only):
        asked.append(only)
        raise WeightSyncError("bucket 0: checksum mismatch")

    state.sync(learner, lambda only: _stats(1000))
    with pytest.raises(WeightSyncError):
        state.sync(learner, fails)
    assert asked[0] is not None  # a partial sync failed part-way: the engines' set is no longer known to be whole
    assert state.sync(learner, lambda only: asked.append(only) or _stats(1000)).full_bytes == 1000
    assert asked[1] is None


def test_a_learner_without_adapters_sends_everything_every_time():
    for learner in (_learner({}), SimpleNamespace()):
        state, asked = EngineWeightState(), []
        for _ in range(3):
            assert state.sync(learner, lambda only: asked.append(only) or _stats(7)).full_bytes == 7
        assert asked == [None, None, None]
