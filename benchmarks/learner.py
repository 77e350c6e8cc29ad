"""Learner throughput of the two kernel choices, and the overhead of the off-policy corrections and of
keep-sampling-mask.

    msrl bench learner [--hidden 128 --layers 4 --experts 16 --topk 4 --seq 256 --batch 16 --mbs 4 --pairs 6]
    .venv/bin/python benchmarks/learner.py [same options]
    msrl bench learner --hidden 64 --layers 2 --seq 64 --batch 8 --pairs 2     # a small, quick run

One rank (gloo world of 1, TP1, one torch thread), a random Qwen3-MoE built in a temporary directory, the real
Megatron learner on CPU. A synthetic rollout batch (16-token prompts, responses of random length up to
`--seq`, groups of 4, 0/1 rewards, sampler logprobs = the learner's own + N(0, 0.05) noise, a random top-k
support of 32 ids per response token) goes through the trainer's learner step (`training/update.py`:
`prepare`, the dense old-logprob forward + advantages + corrections, then `update`, one optimizer step).

First the kernel choices (learner.kernels, models/kernels.py): a `fast` and a `local` learner of the same weights;
the max |logprob difference| between them on the batch (equal results), then back-to-back pairs of the plain step
under each, the order alternating: each one's median tokens/s and the median and range of the per-pair speed-up
(local time / fast time).

Then, under `--kernels` (default auto, the choice a run makes here), each as back-to-back pairs against the plain
step (no correction, no mask), the order alternating, median and range of the per-pair time ratios (a shared CPU's
noise shows in the range):
- all corrections on (TIS, MIS, veto, IcePop, OPSM, Sparse-RL; elementwise tensor math, expected ~0 of
  the step; docs/algorithms.md, "Cost");
  also the time of `apply_corrections` alone, timed around its call, as a share of the step;
- keep-sampling-mask on (the support mask built per micro-batch and applied in both forwards);
- every micro-batch at the batch's full width, rows in order (the learner without length grouping/trimming;
  the plain step groups rows by length and runs each micro-batch up to its longest row);
- the plain step's response tokens/s and all tokens/s.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

from megatron_sparse_rl.config.checks import positive

PROMPT, GROUP, SUPPORT = 16, 4, 32



def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden", type=positive(), default=128)
    p.add_argument("--layers", type=positive(), default=4)
    p.add_argument("--experts", type=positive(), default=16)
    p.add_argument("--topk", type=positive(), default=4)
    p.add_argument("--seq", type=positive(), default=256, help="longest prompt + response (tokens)")
    p.add_argument("--batch", type=positive(), default=16, help="sequences per step (a multiple of 4)")
    p.add_argument("--mbs", type=positive(), default=4, help="learner micro-batch size")
    p.add_argument("--pairs", type=positive(), default=6)
    p.add_argument("--kernels", choices=("auto", "local", "fast"), default="auto",
                   help="learner.kernels of the overhead comparisons (fast and local are compared first either way)")
    p.add_argument("--timeout", type=positive(), default=1800, help="seconds before the benchmark rank is killed")


def _check(args) -> None:
    if args.batch % GROUP:
        raise SystemExit(f"error: --batch must be a multiple of {GROUP} (groups of {GROUP}; got {args.batch})")
    if args.seq <= PROMPT + 1:
        raise SystemExit(f"error: --seq must be > {PROMPT + 1} (16-token prompts; got {args.seq})")


def _learner(model_dir, mbs, kernels):
    from megatron_sparse_rl.config.schema import LearnerConfig, ModelConfig, OptimizerConfig, ParallelConfig
    from megatron_sparse_rl.learner.learner import Learner
    from megatron_sparse_rl.models import load_spec
    from megatron_sparse_rl.parallel import ParallelLayout
    from megatron_sparse_rl.patches import megatron_cpu

    megatron_cpu.apply()
    adapter, spec = load_spec(model_dir)
    layout = ParallelLayout.from_config(ParallelConfig(), 1)
    learner = Learner(adapter, spec, layout, layout.initialize(), model_cfg=ModelConfig(path=str(model_dir)),
                      cfg=LearnerConfig(micro_batch_size=mbs, optimizer=OptimizerConfig(lr=1e-6), kernels=kernels),
                      total_steps=1000)
    learner.load_hf(model_dir)
    return learner


def _batch(learner, args, vocab: int):
    """A synthetic scored rollout batch whose sampler logprobs are the learner's own plus noise."""
    import torch

    from megatron_sparse_rl.rollout.batch import RolloutBatch
    from megatron_sparse_rl.rollout.sampling_mask import SamplingSupport
    from megatron_sparse_rl.training.learner_batch import LearnerBatch

    g = torch.Generator().manual_seed(0)
    b, resp = args.batch, args.seq - PROMPT
    lens = torch.randint(resp // 2, resp + 1, (b,), generator=g)
    response = torch.randint(3, vocab, (b, resp), generator=g)
    mask = torch.arange(resp)[None] < lens[:, None]
    batch = RolloutBatch(prompt_ids=torch.randint(3, vocab, (b, PROMPT), generator=g),
                         prompt_lens=torch.full((b,), PROMPT), response_ids=torch.where(mask, response, 0),
                         response_mask=mask, rollout_logprobs=torch.zeros(b, resp), finish_reasons=("stop",) * b,
                         group_ids=torch.arange(b) // GROUP, reward=torch.randint(0, 2, (b,), generator=g).float())
    view = LearnerBatch.from_rollout(batch, 0)
    tokens, cols = view.tokens, view.loss_mask
    own = learner.forward_logprobs(tokens)["logprobs"]
    rollout = torch.zeros(b, resp)
    for i in range(b):
        n = int(lens[i])
        rollout[i, :n] = own[i, PROMPT - 1:PROMPT - 1 + n] + 0.05 * torch.randn(n, generator=g)
    counts, ids = [], []
    for i in range(b):
        n = int(lens[i])
        kept = torch.stack([torch.randperm(vocab, generator=g)[:SUPPORT] for _ in range(n)])
        kept[:, 0] = response[i, :n]  # the sampled token is always in its support
        counts.append(torch.full((n,), SUPPORT, dtype=torch.int32))
        ids.append(kept.sort(dim=1).values.reshape(-1).to(torch.int32))
    support = SamplingSupport(prompt_lens=batch.prompt_lens, counts=tuple(counts), ids=tuple(ids))
    batch = dataclasses.replace(batch, rollout_logprobs=rollout).with_features(sampling_mask=support)
    return batch, int(mask.sum()), int(mask.sum()) + b * PROMPT


def _configs():
    from megatron_sparse_rl.config.algorithm import (
        AlgorithmConfig, CorrectionsConfig, IcePopConfig, MISConfig, OPSMConfig, SparseRLConfig, TISConfig, VetoConfig,
    )

    corrections = CorrectionsConfig(tis=TISConfig(enabled=True), mis=MISConfig(enabled=True),
                                    veto=VetoConfig(enabled=True), icepop=IcePopConfig(enabled=True),
                                    opsm=OPSMConfig(enabled=True), sparse_rl=SparseRLConfig(enabled=True))
    return {"plain": AlgorithmConfig(), "corrections": AlgorithmConfig(corrections=corrections),
            "keep_mask": AlgorithmConfig(keep_sampling_mask=True)}


def bench_worker(rank, world_size, model_dir, args):
    import torch

    import megatron_sparse_rl.training.update as U

    from megatron_sparse_rl.models.kernels import resolve
    from megatron_sparse_rl.training.learner_batch import LearnerBatch

    chosen = resolve(args.kernels, "cpu")
    learners = {k: _learner(model_dir, args.mbs, k) for k in ("fast", "local")}
    learner = learners[chosen]
    batch, response_tokens, all_tokens = _batch(learner, args, learner.spec.vocab_size)
    tokens = LearnerBatch.from_rollout(batch, 0).tokens
    logprobs = {k: lrn.forward_logprobs(tokens)["logprobs"] for k, lrn in learners.items()}
    diff = float((logprobs["fast"] - logprobs["local"]).abs().max())
    configs = _configs()
    correction_s = [0.0]
    inner = U.apply_corrections

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            correction_s[0] += time.perf_counter() - t

    U.apply_corrections = timed

    def step(name: str, learner=learner) -> float:
        algo = configs.get(name, configs["plain"])
        if name == "full_width":  # what the learner did before micro-batches were grouped and trimmed
            learner._width = lambda tokens, lengths, index: tokens.shape[1]
            learner._micro_batches = lambda tokens, lengths, forward_only=False: [
                (index, len(index)) for index in torch.arange(len(tokens)).split(args.mbs)]
        start = time.perf_counter()
        try:
            prep = U.prepare(learner, batch, algo, pad_id=0, dp_group=None)
            U.update(learner, prep, algo, updates=1, dp_group=None)
        finally:
            learner.__dict__.pop("_width", None)
            learner.__dict__.pop("_micro_batches", None)
        return time.perf_counter() - start

    for lrn in learners.values():
        step("plain", lrn)  # warm-up
    kernel_s = _kernel_times(step, learners, args.pairs)
    ratios, plain = _ratios(step, args.pairs, correction_s)
    ratios["speedup"] = [loc / fast for loc, fast in zip(kernel_s["local"], kernel_s["fast"])]
    return {"ratios": ratios, "plain": plain, "response_tokens": response_tokens, "all_tokens": all_tokens,
            "kernel_s": kernel_s, "logprob_diff": diff, "chosen": chosen}


def _kernel_times(step, learners, pairs: int) -> dict[str, list[float]]:
    """Seconds of a plain step with each kernel set, `pairs` times, alternating which goes first."""
    kernel_s = {"fast": [], "local": []}
    for i in range(pairs):
        for k in (("fast", "local") if i % 2 == 0 else ("local", "fast")):
            kernel_s[k].append(step("plain", learners[k]))
    return kernel_s


def _ratios(step, pairs: int, correction_s: list[float]) -> tuple[dict[str, list[float]], list[float]]:
    """Each variant's step time over the plain step's, in pairs (alternating which goes first); the share of the
    corrections step spent in `apply_corrections`; and the plain steps' seconds."""
    ratios = {"corrections": [], "keep_mask": [], "full_width": [], "corrections_math": []}
    plain = []
    for i in range(pairs):
        for other in ("corrections", "keep_mask", "full_width"):
            correction_s[0] = 0.0
            t = {}
            for name in (("plain", other) if i % 2 == 0 else (other, "plain")):
                t[name] = step(name)
            ratios[other].append(t[other] / t["plain"])
            plain.append(t["plain"])
            if other == "corrections":
                ratios["corrections_math"].append(correction_s[0] / t["corrections"])
    return ratios, plain


def _summary(values) -> tuple[float, float, float]:
    s = sorted(values)
    return s[len(s) // 2], s[0], s[-1]


def run(args: argparse.Namespace) -> int:
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model
    from megatron_sparse_rl.parallel.spawn import run_ranks

    _check(args)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_hf_model(f"{tmp}/m", hidden=args.hidden, layers=args.layers, experts=args.experts,
                                        topk=args.topk, moe_ffn=args.hidden, max_position=max(2048, args.seq), seed=0)
        print(f"model: Qwen3-MoE hidden {args.hidden}, {args.layers} layers, {args.experts} experts (top-{args.topk}); "
              f"batch {args.batch} x up to {args.seq} tokens, micro-batch {args.mbs}; {args.pairs} pairs; "
              f"1 rank, 1 torch thread", flush=True)
        (out,) = run_ranks(bench_worker, 1, args=(str(model_dir), args), timeout=args.timeout,
                           rank_init=getattr(args, "rank_logging", None))
    tokens_s = {k: out["all_tokens"] / _summary(v)[0] for k, v in out["kernel_s"].items()}
    med, lo, hi = _summary(out["ratios"]["speedup"])
    print(f"learner.kernels fast: {tokens_s['fast']:.0f} tokens/s, local: {tokens_s['local']:.0f} tokens/s (medians); "
          f"fast / local speed-up per pair: median {med:.2f}x (range {lo:.2f}x .. {hi:.2f}x); "
          f"max |logprob fast - local| {out['logprob_diff']:.2e}")
    print(f"the comparisons below run learner.kernels {args.kernels} = {out['chosen']}")
    step, _, _ = _summary(out["plain"])
    print(f"plain learner step (old-logprob forward + advantages + 1 update): median {step * 1e3:.0f} ms; "
          f"{out['response_tokens'] / step:.0f} response tokens/s, {out['all_tokens'] / step:.0f} tokens/s")
    for name, label in (("corrections", "all corrections on (TIS, MIS, veto, IcePop, OPSM, Sparse-RL)"),
                        ("keep_mask", "keep-sampling-mask on (32-id support per token)"),
                        ("full_width", "every micro-batch at the batch's full width (no length grouping)")):
        med, lo, hi = _summary(out["ratios"][name])
        print(f"{label} / plain: median {med:.4f} (overhead {100 * (med - 1):+.2f}%, range {100 * (lo - 1):+.2f}% .. "
              f"{100 * (hi - 1):+.2f}%)")
    med, lo, hi = _summary(out["ratios"]["corrections_math"])
    print(f"apply_corrections alone: {100 * med:.2f}% of the corrected step (range {100 * lo:.2f}% .. {100 * hi:.2f}%)")
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    sys.exit(run(p.parse_args()))


if __name__ == "__main__":
    # run as benchmarks.learner, so that the rank function pickles under an importable name
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.learner import main as _main

    _main()
