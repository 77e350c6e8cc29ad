"""Low-precision rollouts end to end: a bf16 vLLM engine and FP8 block-quantised weights on CPU.

- the bf16 engine's prompt logprobs are within 3x transformers' own bf16-vs-fp32 error of transformers' bf16 forward
  on the dense tiny model (the numerics). On the tiny MoE they are not: the bf16 engine's routers pick other experts
  than its fp32 self on about one token-layer in six, and each flip moves the later logprobs by up to ~0.5 (measured:
  docs/routing_stability.md), which is the mismatch the routing study needs, not a numerics error;
- an fp32 engine synced with FP8 weights computes with exactly their dequantised values: it matches transformers
  holding those values to the fp32 tolerance, and not the unquantised model;
- a 2-step disaggregated run (1 learner + 1 rollout rank) with FP8 weights on a bf16 engine, an fp32 learner and
  R3: the sync probe passes against the learner holding the engine's weights, the quantisation's own logprob effect
  is measured and not zero, the train-inference mismatch is not zero, and every update replays the routes. (An
  fp32 engine with FP8 weights agrees with the learner holding them to ~1e-6: the second test, and
  docs/weight_sync.md.)
Run: .venv/bin/python -m pytest -q tests/e2e/test_low_precision.py -s
"""
import json
import subprocess
from pathlib import Path

import pytest
import torch

from megatron_sparse_rl.config.rollout import RolloutConfig
from megatron_sparse_rl.models.tiny import build_tiny_hf_model
from tests.e2e.test_rollout_engine import ATOL as FP32_TOL  # fp32 vLLM vs transformers
from tests.e2e.test_rollout_engine import SEQS, hf_logprobs, max_diff
from tests.msrl import MSRL

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_hf_model(tmp_path_factory.mktemp("lowp") / "tiny", seed=0)


def _engine(model_dir, dtype: str):
    from megatron_sparse_rl.patches import vllm_cpu
    from megatron_sparse_rl.rollout import RolloutEngine

    vllm_cpu.apply()
    return RolloutEngine(model_dir, RolloutConfig(dtype=dtype, max_model_len=256, max_num_seqs=8, kv_cache_gb=1))


def test_bf16_engine_is_as_close_to_transformers_bf16_as_bf16_is_to_fp32(tmp_path):
    model_dir = build_tiny_hf_model(tmp_path / "dense", arch="qwen3", seed=0)
    engine = _engine(model_dir, "bfloat16")
    try:
        ours = engine.prompt_logprobs(SEQS)
    finally:
        engine.shutdown()
    hf32, hf16 = hf_logprobs(model_dir, SEQS), hf_logprobs(model_dir, SEQS, torch.bfloat16)
    own_error, engine_error = max_diff(hf16, hf32), max_diff(ours, hf16)
    print(f"max |logprob|: transformers bf16 - fp32 {own_error:.3e}, vLLM bf16 - transformers bf16 "
          f"{engine_error:.3e}, vLLM bf16 - transformers fp32 {max_diff(ours, hf32):.3e}")
    assert own_error > 1e-3  # bf16 is visibly not fp32 here, so the bound below means something
    assert engine_error <= 3 * own_error


def test_fp8_synced_engine_computes_with_the_dequantised_fp8_weights(model_dir, tmp_path):
    """The engine is loaded through the sync's conversion (`EngineWeights.sent`) and compared with transformers
    holding the FP8 round trip of its weights computed by the test from the quantised tensors it reads back."""
    import shutil

    from safetensors.torch import load_file, save_file

    from megatron_sparse_rl.config.rollout import RolloutConfig as RC
    from megatron_sparse_rl.weight_sync.engine_weights import EngineWeights

    weights = EngineWeights.of(RC(quantization="fp8"))
    state = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        state.update(load_file(f))
    sent = {name: weights.sent(name, t.float()) for name, t in state.items()}
    changed = [n for n in state if not torch.equal(sent[n], state[n].float())]
    assert changed and all(n.endswith("proj.weight") for n in changed), changed
    engine = _engine(model_dir, "float32")
    try:
        engine.load_weights(iter(sent.items()))
        ours = engine.prompt_logprobs(SEQS)
    finally:
        engine.shutdown()
    plain = hf_logprobs(model_dir, SEQS)
    fp8_dir = tmp_path / "fp8_values"  # the same model holding the FP8 values, read by transformers' own loader
    shutil.copytree(model_dir, fp8_dir, ignore=shutil.ignore_patterns("*.safetensors*"))
    save_file({n: t.contiguous() for n, t in sent.items()}, str(fp8_dir / "model.safetensors"))
    quantised = hf_logprobs(fp8_dir, SEQS)
    print(f"FP8 weights: max |engine - transformers(fp8 weights)| {max_diff(ours, quantised):.2e}, "
          f"max |transformers(fp8 weights) - transformers| {max_diff(quantised, plain):.2e}")
    assert max_diff(ours, quantised) < FP32_TOL
    assert max_diff(quantised, plain) > 100 * FP32_TOL


def _train(run_dir: Path, model_dir: Path, *extra: str, rollout_ranks: int = 0) -> list[dict]:
    sets = [f"logging.dir={run_dir}", f"model.path={model_dir}", "trainer.steps=2", "trainer.prompts_per_step=4",
            "trainer.eval_prompts=4", "trainer.eval_every=0", "trainer.sft.max_steps=0", "rollout.sampling.n=4",
            "rollout.sampling.max_tokens=6", "rollout.max_model_len=64", "checkpoint.save_every=0",
            "logging.tensorboard=false", "trainer.verify_sync_every=1", *extra]
    if rollout_ranks:
        cmd = [*MSRL, "launch", "local", str(REPO / "configs/tiny_moe.yaml"), "--nproc", "2", "--set",
               "launch.rollout_ranks=1", *sets]
    else:
        cmd = [*MSRL, "train", str(REPO / "configs/tiny_moe.yaml"), "--set", *sets]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["phase"] == "rl"]


def test_bf16_engine_with_fp8_weights_fp32_learner_r3_disaggregated_run(tmp_path):
    """One run covers the low-precision path end to end (one trainer start is the expensive part): FP8 weights on a
    bf16 engine on a rollout rank, an fp32 learner, R3 replaying the engine's routes."""
    records = _train(tmp_path / "run", tmp_path / "model", "rollout.dtype=bfloat16", "rollout.quantization=fp8",
                     "routing.mode=R3", rollout_ranks=1)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        print({k: v for k, v in r.items() if k.startswith(("mismatch/k", "sync/", "routing/replay"))})
        assert r["mismatch/k3"] > 0 and r["mismatch/k1"] != 0  # a bf16 engine on FP8 weights is not the fp32 learner
        assert r["routing/replay_applied_fraction"] == 1.0
        assert 0 < r["sync/probe_mean_abs_diff"] <= 0.3  # the bf16 engine's bound, against the learner in its weights
        assert r["sync/weight_format_mean_abs_diff"] > 1e-3  # the FP8 rounding itself moves the logprobs
