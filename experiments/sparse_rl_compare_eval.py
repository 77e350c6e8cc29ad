"""Engine-only held-out evaluation of experiments/sparse_rl_compare.py: every final model under several rollout
engines (dense, sparse at the training budget, sparse at a tight budget), each engine started once in this
process and given each model's weights in turn from its hf_final (`RolloutEngine.load_weights`, the path the
trainer's weight sync takes), instead of a 0-step `msrl train` (learner + engine start-up) per model and engine.

An evaluation is placement/rollout.py `accuracy` with the arguments of training/steps.py `evaluate` on one
data-parallel rank: the first trainer.eval_prompts held-out examples, trainer.eval_samples samples each at
trainer.eval_temperature, rollout.sampling.max_tokens, sampling seed rollout.seed, correctness by the run's reward
without shaping. So a run's in-run final evaluation and this one of its own engine kind agree exactly.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Target:
    """One final model to evaluate: its seed, arm, HF directory and the run config it was trained with."""

    seed: int
    arm: str
    model_dir: Path
    run: Any


def _task(run, model_dir: Path) -> tuple:
    """(tokenizer, held-out examples, correctness scorer) as the trainer builds them for `run`."""
    from transformers import AutoTokenizer

    from megatron_sparse_rl.data import build_task
    from megatron_sparse_rl.rewards import make_scorer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    examples = build_task(run.data, tokenizer).eval_examples(run.trainer.eval_prompts)
    return tokenizer, examples, make_scorer(run.reward, shaping=False, answer_marker=run.data.answer_marker)


def _one(engine, target: Target, task: tuple, sparse: bool) -> tuple[float, int, int]:
    """(correct, samples, compactions during it) of `target`'s weights, already loaded in `engine` (`sparse`: the
    engine, not the target's training run, has a sparse KV cache)."""
    from megatron_sparse_rl.kv.engine_extension import sparse_kv_stats
    from megatron_sparse_rl.placement import rollout as R

    tokenizer, examples, correct = task
    run = target.run
    before = sparse_kv_stats(engine)["compactions"] if sparse else 0
    total, count = R.accuracy(engine, tokenizer, examples, max_tokens=run.rollout.sampling.max_tokens, score=correct,
                              temperature=run.trainer.eval_temperature, samples=run.trainer.eval_samples,
                              seed=run.rollout.seed)
    after = sparse_kv_stats(engine)["compactions"] if sparse else 0
    return total, count, after - before


def evaluate(targets: list[Target], rollouts: dict[str, Any], cache_dir: Path,
             say: Callable[[str], None]) -> tuple[list[dict], dict[str, float]]:
    """Every target under every rollout config of `rollouts` ({mode: RolloutConfig}). Returns one record per
    (target, mode): seed, arm, mode, accuracy, samples, compactions, load_s (weights), seconds (load + generate),
    and the start-up seconds of each mode's engine."""
    from megatron_sparse_rl.formats.hf_io import HFCheckpoint
    from megatron_sparse_rl.kv.engine_extension import sparse_kv_extensions
    from megatron_sparse_rl.patches import vllm_cpu
    from megatron_sparse_rl.rollout import RolloutEngine

    tasks: dict[int, tuple] = {}
    evals, starts = [], {}
    for mode, rollout in rollouts.items():
        t0 = time.perf_counter()
        vllm_cpu.apply()
        engine = RolloutEngine(targets[0].model_dir, rollout, cache_dir=cache_dir,
                               extensions=sparse_kv_extensions(rollout.kv))
        starts[mode] = round(time.perf_counter() - t0, 2)
        kv = rollout.kv
        say(f"eval engine {mode} ({kv.policy}" + (f" budget {kv.budget}" if kv.policy != "none" else "") +
            f") started in {starts[mode]:.1f} s")
        try:
            loaded = targets[0].model_dir
            for t in targets:
                t1 = time.perf_counter()
                if t.model_dir != loaded:
                    ckpt = HFCheckpoint(t.model_dir)
                    engine.load_weights((name, ckpt.get(name)) for name in ckpt.names())
                    loaded = t.model_dir
                load_s = time.perf_counter() - t1
                if t.seed not in tasks:
                    tasks[t.seed] = _task(t.run, t.model_dir)
                total, count, compactions = _one(engine, t, tasks[t.seed], kv.policy != "none")
                rec = {"seed": t.seed, "arm": t.arm, "mode": mode, "accuracy": total / count if count else None,
                       "samples": count,
                       "compactions": compactions, "load_s": round(load_s, 3),
                       "seconds": round(time.perf_counter() - t1, 3)}
                evals.append(rec)
                say(f"    seed{t.seed}/{t.arm} {mode}: {total / max(count, 1):.3f} ({count} samples, "
                    f"{compactions} compactions, {rec['seconds']:.1f} s)")
        finally:
            engine.shutdown()
    return evals, starts
