"""The engines' weight format (weight_sync/engine_weights.py) and its config checks: what a sync sends and what an
engine holds for rollout.dtype / rollout.quantization, the probe tolerance, and the refusals at validate."""
import importlib

import pytest
import torch

from megatron_sparse_rl.validation import validate
from megatron_sparse_rl.config.loader import ConfigError
from megatron_sparse_rl.config.rollout import RolloutConfig, engine_precision
from megatron_sparse_rl.training.steps import sync_tolerance
from megatron_sparse_rl.weight_sync.engine_weights import EngineWeights
from tests.unit.test_config_validate import run_of

validate_module = importlib.import_module("megatron_sparse_rl.validation.validate")  # `validation.validate` is the function
QUANTISED = "model.layers.0.self_attn.q_proj.weight"
EXPERT = "model.layers.1.mlp.experts.3.down_proj.weight"
KEPT = ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.gate.weight",
        "model.layers.0.input_layernorm.weight")


def _tensor(shape, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.02


def test_fp32_engine_sends_and_holds_the_learners_weights():
    weights = EngineWeights.of(RolloutConfig())
    assert weights == EngineWeights() and weights.convert is None
    t = _tensor((64, 64))
    assert weights.held(QUANTISED, t) is t or torch.equal(weights.held(QUANTISED, t), t)


def test_bf16_engine_holds_the_weights_rounded_to_bf16():
    weights = EngineWeights.of(RolloutConfig(dtype="bfloat16"))
    t = _tensor((64, 96))
    assert weights.convert(QUANTISED, t).dtype == torch.bfloat16  # sent as the engine holds it: half the bytes
    held = weights.held(QUANTISED, t)
    assert held.dtype == torch.float32 and torch.equal(held, t.to(torch.bfloat16).to(torch.float32))
    assert not torch.equal(held, t)


def test_fp8_quantises_attention_and_expert_weights_only():
    weights = EngineWeights.of(RolloutConfig(quantization="fp8"))
    assert weights.convert is not None
    for name in (QUANTISED, EXPERT):
        t = _tensor((192, 160), seed=len(name))
        sent = weights.sent(name, t)
        assert sent.dtype == torch.float32 and sent.shape == t.shape and not torch.equal(sent, t)
        # every value is an e4m3 number times its block's scale: at most 8 distinct magnitudes per power of two
        assert torch.equal(weights.sent(name, sent), sent)  # the round trip is idempotent
    for name in KEPT:
        t = _tensor((64,) if "norm" in name else (96, 64))
        assert torch.equal(weights.sent(name, t), t)


def test_probe_tolerance_follows_the_engine_and_learner_precision():
    class Learner:
        def __init__(self, dtype):
            self.model = torch.nn.Linear(2, 2).to(dtype)

    assert sync_tolerance(None, Learner(torch.float32)) == 1e-3
    assert sync_tolerance(None, Learner(torch.float32), torch.bfloat16) == 0.3  # a bound of the mean there
    assert sync_tolerance(None, Learner(torch.bfloat16), torch.float32) == 1e-1
    assert sync_tolerance(5e-4, Learner(torch.float32), torch.bfloat16) == 5e-4  # configured wins


def test_the_summary_says_what_the_engine_computes_with():
    assert engine_precision(RolloutConfig()) == "engine dtype float32"
    line = engine_precision(RolloutConfig(quantization="fp8", dtype="bfloat16"))
    assert "128x128 block scales" in line and "dequantised values in bfloat16" in line


def test_bf16_on_a_cpu_vllm_cannot_run_it_is_refused_before_anything_starts(monkeypatch):
    monkeypatch.setattr(validate_module, "cpu_engine_runs_bf16", lambda: False)
    with pytest.raises(ConfigError, match=r"rollout.dtype = 'bfloat16': vLLM's CPU engine cannot compute in "
                                          r"bfloat16 on this CPU"):
        validate(run_of("rollout.dtype=bfloat16"), 1, cuda=False)
    validate(run_of("rollout.dtype=bfloat16"), 1, cuda=True)  # a GPU runs bf16


def test_fp8_with_engine_shards_that_cut_blocks_is_refused_naming_the_tensor(tmp_path):
    """At validate: `msrl validate` and `msrl train` run training/preflight.py `check_files` after the config."""
    from megatron_sparse_rl.training.preflight import check_files

    # the tiny model's projections are 64-128 wide: a 2-way engine shard cannot hold whole 128-wide blocks
    run = run_of("rollout.quantization=fp8", "rollout.tensor_parallel_size=2", "launch.nproc_per_node=2",
                 f"logging.dir={tmp_path / 'run'}")
    with pytest.raises(ConfigError, match=r"rollout.quantization = 'fp8' with rollout.tensor_parallel_size = 2: "
                                          r"model\.layers\.0\.self_attn\.q_proj\.weight: its 128 rows in 2 "
                                          r"shards of 64"):
        check_files(run, validate(run, 2, cuda=False), cuda=False)
    run = run_of("rollout.quantization=fp8", f"logging.dir={tmp_path / 'run'}")
    check_files(run, validate(run, 1, cuda=False), cuda=False)  # one engine rank holds every tensor whole
