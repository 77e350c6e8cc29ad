"""Greedy generation after a weight sync equals greedy generation of a fresh engine loaded from an HF
checkpoint converted from the same learner weights (CPU, fp32, tiny Qwen3-MoE).

Process 1: a Megatron learner takes SFT steps (its weights move away from the initial model), a running
`RolloutEngine` (started from the initial model) is synced with `sync_to_engine` and greedy-generates the
prompts; the learner is saved as a training torch_dist checkpoint (`save_learner`).
Process 2: the project's converter (`checkpoint.convert.mcore_to_hf`, what `msrl convert mcore-to-hf` runs)
writes HF safetensors from that checkpoint, a fresh engine loads them through vLLM's own HF loader and
greedy-generates the same prompts. The token ids must be equal, and differ from the initial model's
greedy output (otherwise a sync that moved nothing would pass).
Run: .venv/bin/python -m pytest -q tests/e2e/test_weight_sync_greedy.py
"""
import pytest
import torch

from tests.spawn import run_distributed

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

PROMPTS = [[1, 5, 6, 14, 11], [1, 43, 21, 19], [1, 7, 7, 30, 22, 9, 12], [1, 18]]
# SFT data unrelated to the prompts: a few small steps move the weights (and the greedy outputs) without
# collapsing every generation onto memorised text, so the comparison stays sensitive to wrong weights
TARGETS = [[1, 5, 6, 14, 11, 18, 22, 20, 27, 21, 19, 5, 13], [1, 43, 21, 19, 9, 7, 15, 4, 4, 18, 22, 30, 31]]
MAX_TOKENS = 12


def _greedy(engine) -> tuple[list[list[int]], tuple[str, ...]]:
    from megatron_sparse_rl.config.rollout import SamplingConfig

    batch = engine.generate(PROMPTS, SamplingConfig(n=1, temperature=0.0, max_tokens=MAX_TOKENS))
    ids = [row[mask].tolist() for row, mask in zip(batch.response_ids, batch.response_mask)]
    return ids, batch.finish_reasons


def _engine(model_dir):
    from megatron_sparse_rl.config.rollout import RolloutConfig
    from megatron_sparse_rl.patches import vllm_cpu
    from megatron_sparse_rl.rollout import RolloutEngine

    vllm_cpu.apply()
    return RolloutEngine(model_dir, RolloutConfig(max_model_len=256, max_num_seqs=4, kv_cache_gb=1))


def train_sync_save_worker(rank, world_size, model_dir, ckpt):
    from megatron_sparse_rl.learner.checkpoint import save_learner
    from megatron_sparse_rl.learner.sft import make_sft_loss
    from megatron_sparse_rl.weight_sync import sync_to_engine
    from tests.learner_workers import make_learner

    learner = make_learner(world_size, model_dir, lr=1e-2, mbs=4)
    engine = _engine(model_dir)
    initial = _greedy(engine)
    width = max(len(t) for t in TARGETS)
    tokens = torch.tensor([t + [t[-1]] * (width - len(t)) for t in TARGETS])
    mask = torch.tensor([[1.0] * (len(t) - 1) + [0.0] * (width - len(t)) for t in TARGETS])
    for _ in range(2):
        learner.train_step(tokens, make_sft_loss(mask, mask.sum().item()))
    stats = sync_to_engine(learner, engine, bucket_mb=0.1)
    synced = _greedy(engine)
    probe = engine.prompt_logprobs(TARGETS)
    engine.shutdown()
    save_learner(learner, ckpt)
    return {"initial": initial, "synced": synced, "probe": probe, "stats": stats}


def convert_generate_worker(rank, world_size, model_dir, ckpt, hf_out):
    from megatron_sparse_rl.checkpoint.convert import mcore_to_hf

    # a training checkpoint has no conversion manifest: the HF config/tokenizer come from the initial model
    mcore_to_hf(ckpt, hf_out, hf_config_dir=model_dir, max_shard_size="200KB")
    engine = _engine(hf_out)
    out = {"fresh": _greedy(engine), "probe": engine.prompt_logprobs(TARGETS)}
    engine.shutdown()
    return out


def test_greedy_after_sync_equals_engine_from_converted_checkpoint(tmp_path):
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    model_dir = str(build_tiny_hf_model(tmp_path / "moe", seed=0))
    ckpt, hf_out = str(tmp_path / "ckpt"), str(tmp_path / "hf_converted")
    synced = run_distributed(train_sync_save_worker, 1, args=(model_dir, ckpt), timeout=300)[0]
    fresh = run_distributed(convert_generate_worker, 1, args=(model_dir, ckpt, hf_out), timeout=300)[0]
    probe_diff = max((a - b).abs().max().item() for a, b in zip(synced["probe"], fresh["probe"]))
    print(f"initial {synced['initial'][0]}\nsynced  {synced['synced'][0]}\nfresh   {fresh['fresh'][0]}\n"
          f"|prompt logprobs synced - fresh| = {probe_diff:.2e}; {synced['stats']}")
    assert synced["synced"][0] != synced["initial"][0], "the train steps must change the greedy generations"
    assert synced["synced"] == fresh["fresh"], "greedy ids (and finish reasons) must match the converted model's"
    assert all(len(ids) > 0 for ids in fresh["fresh"][0])
    # same fp32 weights in both engines: the forward is the same computation
    assert probe_diff < 1e-5
