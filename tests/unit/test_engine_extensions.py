"""Engine extensions (rollout/extension.py): a rollout config that asks for sparse KV or the sampling-mask record
is refused before vLLM starts unless an extension provides it, naming the extension to hand in; the run's set-up
builds the ones the config asks for.

    .venv/bin/python -m pytest -q tests/unit/test_engine_extensions.py
"""
from __future__ import annotations

import pytest

from megatron_sparse_rl.config.rollout import KVConfig, RolloutConfig
from megatron_sparse_rl.kv.engine_extension import SparseKV, sparse_kv_extensions
from megatron_sparse_rl.rollout.engine_setup import check_extensions
from megatron_sparse_rl.rollout.routes import EngineRouteCapture
from megatron_sparse_rl.rollout.sampling_mask import SamplingMaskCapture

SPARSE = KVConfig(policy="streamingllm", budget=24, interval=16, window=8, block_size=32)


def test_a_feature_the_config_asks_for_needs_its_extension():
    with pytest.raises(ValueError, match=r"rollout\.kv\.policy asks for sparse_kv.*kv\.engine_extension\.SparseKV"):
        check_extensions(RolloutConfig(kv=SPARSE), [EngineRouteCapture()])
    with pytest.raises(ValueError, match=r"rollout\.record_sampling_mask asks for sampling_mask.*SamplingMaskCapture"):
        check_extensions(RolloutConfig(record_sampling_mask=True), [SparseKV()])
    check_extensions(RolloutConfig(kv=SPARSE, record_sampling_mask=True), [SparseKV(), SamplingMaskCapture()])
    check_extensions(RolloutConfig(), [])  # dense, no record: nothing needed


def test_sparse_kv_extensions_follow_the_policy():
    assert sparse_kv_extensions(KVConfig()) == []
    (ext,) = sparse_kv_extensions(SPARSE)
    assert isinstance(ext, SparseKV) and ext.vllm_features(mla=True) == ("sparse_kv", "sparse_kv_mla")


def test_a_step_capture_fills_its_batch_field():
    class Capture(SamplingMaskCapture):
        def collect(self, outputs, prompts):
            return ("support", outputs, prompts)

    assert Capture().batch_fields(["out"], [[1, 2]], [("0", 0)]) == {"sampling_mask": ("support", ["out"], [[1, 2]])}
    assert EngineRouteCapture.field == "routed_experts" and EngineRouteCapture.provides == "routes"
