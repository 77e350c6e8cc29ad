"""Sparse-KV rollout benchmark: vLLM's own count of KV blocks in use, sparse vs dense, on long generations;
sequences running concurrently at a fixed KV pool; tokens/s. Prints ratios measured in one run.

    .venv/bin/python benchmarks/kv.py [--prompts 8 --max-tokens 1024 --budget 128 --interval 128
                                       --policy streamingllm --block-size 32 --pool-prompts 16
                                       --pool-max-tokens 512 --pool-seqs 2]
    msrl bench kv ...   (the same)

Real vLLM on CPU, a tiny random Qwen3-MoE (fp32), or with `--arch deepseek_v3` a tiny DeepSeek-V3 (multi-head
latent attention: vLLM's MLA cache holds one latent row of 512 + 64 values per token and layer, 16-row blocks on
CPU, and the sparse engine keeps one set of rows per layer), or `--model DIR`; fixed-length generations (ignore_eos).
The block size defaults to 32, or 16 for an MLA model (the only one vLLM's CPU MLA backend runs).
Part 1: `--prompts` x `--max-tokens` with an ample pool: peak blocks in use (read from vLLM's BlockPool
after every schedule) and tokens/s, dense vs sparse. Part 2: a fixed pool of `--pool-seqs` dense
worst-case sequences; `--pool-prompts` x `--pool-max-tokens`: peak sequences running at once,
preemptions, requests waiting for admission and the pool's mean use per step, tokens/s, time to finish the batch
(the long-generation shape: `--pool-max-tokens 2048
--pool-seqs 4 --budget 128 --interval 128`). Dense uses vLLM's default scheduler; sparse uses the compaction scheduler with
admission control. Each part also prints where the sparse engine's extra time went (`sparse overhead`:
compactions split into scoring, K/V copy and records + block table, the per-step query capture of the score
policies, and the per-step shift of attention lengths and slots, as shares of the sparse run's wall time).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from megatron_sparse_rl.config.checks import positive


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF model dir (default: a tiny model of --arch built in a temp dir)")
    parser.add_argument("--arch", default="qwen3_moe", choices=["qwen3_moe", "deepseek_v3"],
                        help="the tiny model built without --model: Qwen3-MoE (per-head KV) or DeepSeek-V3 (MLA latent KV)")
    parser.add_argument("--policy", default="streamingllm", choices=["rkv", "snapkv", "h2o", "streamingllm"])
    parser.add_argument("--budget", type=positive(), default=128)
    parser.add_argument("--interval", type=positive(), default=128)
    parser.add_argument("--block-size", type=positive(), default=None,
                        help="KV block size (default 32; 16 for an MLA model)")
    parser.add_argument("--prompts", type=positive(), default=8, help="part 1: sequences")
    parser.add_argument("--max-tokens", type=positive(), default=1024, help="part 1: tokens generated per sequence")
    parser.add_argument("--pool-prompts", type=positive(), default=16, help="part 2: sequences")
    parser.add_argument("--pool-max-tokens", type=positive(), default=512, help="part 2: tokens per sequence")
    parser.add_argument("--pool-seqs", type=positive(), default=2,
                        help="part 2: the pool holds this many dense worst-case sequences")
    parser.add_argument("--prompt-len", type=positive(), default=32)


def _prompts(n: int, length: int) -> list[list[int]]:
    return [[1] + [5 + (7 * i + 3 * j) % 30 for j in range(length - 1)] for i in range(n)]


def _measure(model_dir, kv, prompts, max_tokens, max_model_len, max_num_seqs):
    """(peak blocks, peak running, preemptions, generated tokens / s, wall s, mean running, the sparse worker's
    time: `kv.engine_extension.sparse_kv_timing`, None for a dense engine; mean waiting, mean pool use) of one run."""
    from megatron_sparse_rl.config.rollout import RolloutConfig, SamplingConfig
    from megatron_sparse_rl.kv.engine_extension import sparse_kv_extensions, sparse_kv_timing
    from megatron_sparse_rl.patches import vllm_cpu
    from megatron_sparse_rl.rollout import RolloutEngine
    from megatron_sparse_rl.rollout.block_usage import BlockUsageProbe

    sampling = SamplingConfig(n=1, temperature=1.0, max_tokens=max_tokens, seed=0)
    vllm_cpu.apply()
    engine = RolloutEngine(model_dir, RolloutConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs, kv=kv,
                                                    sampling=sampling), extensions=sparse_kv_extensions(kv))
    # fixed-length generations: vLLM's ignore_eos (a random model samples EOS at random times)
    engine._sampling_params = lambda s, i, **extra: RolloutEngine._sampling_params(engine, s, i, ignore_eos=True,
                                                                                   **extra)
    try:
        engine.generate(prompts[:1], SamplingConfig(n=1, max_tokens=4, seed=0))  # warm-up
        sparse = kv.policy != "none"
        if sparse:
            sparse_kv_timing(engine)  # drop the warm-up's
        with BlockUsageProbe(engine) as probe:
            start = time.perf_counter()
            batch = engine.generate(prompts, sampling)
            wall = time.perf_counter() - start
        tokens = int(batch.response_lens.sum())
        timing = sparse_kv_timing(engine) if sparse else None
        return (probe.peak_blocks, probe.peak_running, probe.preemptions, tokens / wall, wall, probe.mean_running,
                timing, probe.mean_waiting, probe.mean_blocks / max(probe.pool_blocks, 1))
    finally:
        engine.shutdown()


def _cost_line(t: dict, wall: float) -> str:
    """Where the sparse engine's extra time went: compactions (scoring, K/V copy, the rest: records and the block
    table), the per-step query capture and the per-step shift of lengths and slots, as shares of the sparse run's
    wall time."""
    n, compact = int(t["compactions"]), t["compact_s"]
    other = compact - t["score_s"] - t["copy_s"]
    each = 1e3 * compact / max(n, 1)
    return (f"  sparse overhead: {n} compactions, {each:.2f} ms each (score {t['score_s']:.2f} s, copy "
            f"{t['copy_s']:.2f} s, records + block table {other:.2f} s) = {compact / wall:.1%} of the sparse wall "
            f"time; query capture {t['capture_s']:.2f} s = {t['capture_s'] / wall:.1%}; lengths and slots "
            f"{t['prepare_s']:.2f} s = {t['prepare_s'] / wall:.1%}")


def run(args: argparse.Namespace) -> int:
    from megatron_sparse_rl.config.rollout import KVConfig
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model
    from megatron_sparse_rl.models.tiny_families import build_tiny_deepseek
    from megatron_sparse_rl.rollout.engine_setup import latent_kv_rank

    tmp = None
    model_dir = args.model
    if model_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="msrl_bench_kv_")
        longest = args.prompt_len + max(args.max_tokens, args.pool_max_tokens) + 1
        if args.arch == "deepseek_v3":
            model_dir = build_tiny_deepseek(Path(tmp.name) / "tiny_deepseek_v3", seed=0)
        else:  # RoPE positions for the longest sequence (vLLM refuses a max_model_len above the model's)
            model_dir = build_tiny_hf_model(Path(tmp.name) / "tiny_qwen3_moe", seed=0, max_position=max(2048, longest))
    mla = latent_kv_rank(model_dir) is not None
    bs, p_len = args.block_size or (16 if mla else 32), args.prompt_len
    print(f"model {model_dir}: " + ("multi-head latent attention (KV blocks hold latent rows, one per token and "
                                    "layer; one keep set per layer)" if mla else "per-head KV cache"))
    sparse_kw = dict(policy=args.policy, budget=args.budget, interval=args.interval, block_size=bs)

    # part 1: peak blocks in use and tokens/s with an ample pool
    prompts, mml = _prompts(args.prompts, p_len), p_len + args.max_tokens + 1
    d = _measure(model_dir, KVConfig(block_size=bs), prompts, args.max_tokens, mml, args.prompts)
    s = _measure(model_dir, KVConfig(**sparse_kw), prompts, args.max_tokens, mml, args.prompts)
    print(f"part 1: {args.prompts} x {args.max_tokens} tokens, prompt {p_len}, block {bs}, {args.policy} budget "
          f"{args.budget} interval {args.interval}")
    print(f"  peak KV blocks in use (vLLM BlockPool): dense {d[0]}, sparse {s[0]}; sparse/dense = {s[0] / d[0]:.3f}")
    print(f"  tokens/s: dense {d[3]:.1f}, sparse {s[3]:.1f}; sparse/dense = {s[3] / d[3]:.3f}")
    print(_cost_line(s[6], s[4]))

    # part 2: a fixed pool of `pool_seqs` dense worst-case sequences
    prompts, mml = _prompts(args.pool_prompts, p_len), p_len + args.pool_max_tokens + 1
    pool = args.pool_seqs * -(-mml // bs) + 1
    d = _measure(model_dir, KVConfig(block_size=bs, pool_blocks=pool), prompts, args.pool_max_tokens, mml,
                 args.pool_prompts)
    s = _measure(model_dir, KVConfig(**sparse_kw, pool_blocks=pool), prompts, args.pool_max_tokens, mml,
                 args.pool_prompts)
    print(f"part 2: fixed pool of {pool} blocks ({args.pool_seqs} dense sequences), {args.pool_prompts} x "
          f"{args.pool_max_tokens} tokens")
    fit_d, fit_s = (pool - 1) // -(-mml // bs), (pool - 1) // -(-min(mml, args.budget + args.interval) // bs)
    print(f"  sequences that fit at their worst case: dense {fit_d}, sparse {fit_s}; sparse/dense = "
          f"{fit_s / max(fit_d, 1):.2f}")
    print(f"  sequences running per step (mean, peak): dense {d[5]:.2f}, {d[1]} ({d[2]} preemptions: vLLM admits "
          f"optimistically, then recomputes); sparse {s[5]:.2f}, {s[1]} ({s[2]} preemptions); "
          f"sparse/dense mean = {s[5] / max(d[5], 1e-9):.2f}")
    print(f"  waiting for admission per step (mean requests): dense {d[7]:.2f}, sparse {s[7]:.2f}; pool in use "
          f"(mean blocks / pool): dense {d[8]:.2f}, sparse {s[8]:.2f}")
    print(f"  tokens/s: dense {d[3]:.1f}, sparse {s[3]:.1f}; sparse/dense = {s[3] / d[3]:.3f}")
    print(f"  time to finish the batch: dense {d[4]:.1f} s, sparse {s[4]:.1f} s; dense/sparse = {d[4] / s[4]:.2f}")
    print(_cost_line(s[6], s[4]))
    if tmp is not None:
        tmp.cleanup()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
