"""What a run prints about itself when it starts (and `msrl validate` prints): the summary lines of
validation/summary.py against hand-written text, and Megatron's per-parameter gradient-bucket listing kept out of the
logs unless verbose.

    .venv/bin/python -m pytest -q tests/unit/test_run_summary.py
"""
from __future__ import annotations

import logging

import pytest

from megatron_sparse_rl.config import RunConfig
from megatron_sparse_rl.validation import validate
from megatron_sparse_rl.config.loader import from_dict, merge_overrides
from megatron_sparse_rl.validation.summary import run_summary

# The default tiny Qwen3-MoE, counted by hand (as in tests/unit/test_cli.py): embeddings + lm head 2 * 64 * 64; per
# layer q,o 2 * 64 * 4 * 32, k,v 2 * 64 * 2 * 32, q/k norms 2 * 32, 2 layer norms 2 * 64, 4 experts * 3 * 64 * 64 +
# router 4 * 64; final norm 64.
TINY_MOE_PARAMS = 2 * 64 * 64 + 2 * (2 * 64 * 128 + 2 * 64 * 64 + 64 + 128 + 4 * 3 * 64 * 64 + 256) + 64


def run_of(*overrides: str) -> RunConfig:
    base = {"model": {"path": "models/tiny", "tiny": {}}, "logging": {"dir": "runs/x"}}
    return from_dict(RunConfig, merge_overrides(base, list(overrides)))


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def test_colocated_tiny_moe(tmp_path):
    run = run_of("parallel.ep=2")
    assert run_summary(run, validate(run, 2, cuda=False), 2) == [
        "model: Qwen3MoeForCausalLM (tiny qwen3_moe, built at model.path on first use): 2 layers, hidden 64, "
        "4 heads (2 KV) x 32, vocab 64, 4 experts top-2 (ffn 64)",
        f"  parameters: {TINY_MOE_PARAMS:,}; learner dtype float32, engine dtype float32, max_model_len 2048 "
        "(the model's max_position_embeddings)",
        "layout: world 2 = tp 1 x pp 1 x dp 2; ep 2, etp 1, sequence_parallel False, backend gloo",
        "placement: colocated, every rank a learner and an engine rank (2 engines of tp 1)",
        "rollout: n 4, temperature 1.0, max_tokens 128, kv policy none",
        "algorithm: advantage grpo, loss grpo (token_mean), corrections none, kl coef 0.0",
        f"paths (relative ones resolve against the working directory {tmp_path}):",
        f"  model.path: {tmp_path}/models/tiny",
        f"  logging.dir: {tmp_path}/runs/x",
        f"  checkpoint.dir: {tmp_path}/runs/x/checkpoints (default <logging.dir>/checkpoints)",
    ]


def test_disaggregated_engines_of_tp2_and_set_values(tmp_path):
    run = run_of("launch.nproc_per_node=4", "launch.rollout_ranks=2", "rollout.tensor_parallel_size=2",
                 "parallel.tp=2", "parallel.sequence_parallel=true", "rollout.max_model_len=512",
                 "rollout.dtype=bfloat16", "rollout.kv.policy=snapkv", "rollout.kv.budget=256",
                 "checkpoint.dir=/abs/ckpt", "data.source=jsonl", "data.path=../data/train.jsonl")
    lines = run_summary(run, validate(run, 4, cuda=False), 4)
    assert lines[1].endswith("learner dtype float32, engine dtype bfloat16, max_model_len 512 (set)")
    assert lines[2:5] == [
        "layout: learner ranks 2 = tp 2 x pp 1 x dp 1; ep 1, etp 1, sequence_parallel True, backend gloo",
        "placement: disaggregated, learner ranks 0-1, rollout ranks 2-3 (1 engine of tp 2)",
        "rollout: n 4, temperature 1.0, max_tokens 128, kv policy snapkv (budget 256, window 8)",
    ]
    assert lines[-4:] == [f"  model.path: {tmp_path}/models/tiny", f"  data.path: {tmp_path.parent}/data/train.jsonl",
                          f"  logging.dir: {tmp_path}/runs/x", "  checkpoint.dir: /abs/ckpt"]


def test_mla_model_line():
    run = run_of("model.tiny.arch=deepseek_v3")
    lines = run_summary(run, validate(run, 1, cuda=False), 1)
    assert lines[0] == ("model: DeepseekV3ForCausalLM (tiny deepseek_v3, built at model.path on first use): 2 layers, "
                        "hidden 64, 4 heads, MLA latent 576 (kv_lora_rank 512 + qk_rope_head_dim 64), vocab 64, "
                        "4 experts top-2 (ffn 64)")


def test_model_unknown_here():
    run = run_of("model.tiny=null")
    assert validate(run, 1, cuda=False) is None
    assert run_summary(run, None, 1)[:2] == [
        "model: unknown here (no config.json at model.path); model checks skipped",
        "  learner dtype float32, engine dtype float32, max_model_len unknown here (unset: the model's "
        "max_position_embeddings, whose config.json is not here)"]


# ---- Megatron's gradient-bucket listing ------------------------------------------------------------------------
@pytest.mark.parametrize("verbose", [False, True])
def test_megatron_bucket_listing_is_off_unless_verbose(tmp_path, verbose):
    from megatron.core.distributed import param_and_grad_buffer

    from megatron_sparse_rl.observability.logging import QUIET, attach_log_file, init_logging

    assert param_and_grad_buffer.logger.name in QUIET  # the logger Megatron's buffers list their buckets on
    root, quiet = logging.getLogger(), logging.getLogger(param_and_grad_buffer.logger.name)
    saved = root.handlers[:], root.level, quiet.level
    try:
        init_logging(0, "INFO", verbose=verbose)
        assert quiet.level == (logging.NOTSET if verbose else logging.WARNING)
        log_file = attach_log_file(tmp_path / "rank0.log")
        param_and_grad_buffer.logger.info("Number of buckets for gradient all-reduce / reduce-scatter: 1\n"
                                          "Params for bucket 1 (8 elements, 8 padded size):\n\tdecoder.weight")
        param_and_grad_buffer.logger.warning("a real warning of the buffer")
        for h in root.handlers:
            h.flush()
        text = log_file.read_text()
    finally:
        for h in root.handlers:
            h.close()
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        quiet.setLevel(saved[2])
        logging.captureWarnings(False)
    assert ("Params for bucket 1" in text) == verbose
    assert "a real warning of the buffer" in text


def test_lora_lines_count_the_adapters_by_hand():
    # per layer rank 4 x (in + out): q 64 -> 128, k and v 64 -> 64, o 128 -> 64; two layers
    run = run_of("model.lora.rank=4", "model.lora.alpha=8", "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]")
    lines = run_summary(run, validate(run, 1, cuda=False), 1)
    adapters = 2 * 4 * ((64 + 128) + 2 * (64 + 64) + (128 + 64))
    assert lines[2:4] == ["lora: rank 4, alpha 8 (scale 2), dropout 0 on q_proj, k_proj, v_proj, o_proj",
                          f"  trainable: {adapters:,} adapter parameters ({100 * adapters / TINY_MOE_PARAMS:.2f}% of "
                          f"the base's {TINY_MOE_PARAMS:,}, frozen)"]
    assert adapters == 5_120
    assert not any(line.startswith("lora") for line in run_summary(run_of(), validate(run_of(), 1, cuda=False), 1))
    unknown = run_of("model.tiny=null", "model.lora.target_modules=[q_proj]")
    assert run_summary(unknown, None, 1)[2] == ("lora: rank 8, alpha 8 (scale 1), dropout 0 on q_proj; the base frozen "
                                                "(model unknown here: adapter count skipped)")
