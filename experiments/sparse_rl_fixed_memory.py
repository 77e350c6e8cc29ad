"""Sparse-RL at a fixed KV memory (issue 48, item 5): dense RL vs naive sparse RL vs Sparse-RL vs Sparse-RL with the
KV budget schedule, every arm's engine on the same fixed KV pool (`rollout.kv.pool_blocks`), small enough that the
dense arm must queue (or preempt) its step's sequences while the sparse arms fit more of them at once.

Per seed s (0 .. --seeds - 1; 5 by default) every run is a real `msrl train` of --config (default
configs/sparse_rl_fixed_memory.yaml), in this process (experiments/study_runs.py, as experiments/sparse_rl_compare.py):
  0. warm start: model.tiny built with seed s, then --sft-steps SFT steps with a dense engine (--sft-target A: stop
     once held-out accuracy reaches A), shared by the seed's four arms;
  1. dense:           rollout.kv.policy=none (full KV cache, the same pool), no correction;
  2. naive_sparse:    the config's sparse rollout.kv engine, no correction;
  3. sparse_rl:       the same engine + algorithm.corrections.sparse_rl;
  4. sparse_rl_sched: Sparse-RL + rollout.kv.budget_schedule (each step's budget from the last step's rho_t p5).
Every final model is then evaluated on the held-out prompts by a dense and a sparse engine (the config's budget),
each started once in this process (experiments/sparse_rl_compare_eval.py). Measured per arm, at equal steps and on
the training wall-clock (experiments/sparse_rl_fixed_memory_stats.py has the definitions): held-out accuracy under
both engines; the wall-clock to reach dense's final accuracy; peak and mean KV saved; the budget; the rejection
rate; concurrency and preemptions. Writes OUT/fixed_memory.png (bands: ± s.e. over seeds), OUT/runs.png (`msrl
compare`'s picture of every run: study_plot.py `runs_png`), OUT/summary.json and OUT/summary.md, atomically; every statistic is recomputed from each run's metrics.jsonl.

    .venv/bin/python experiments/sparse_rl_fixed_memory.py --out runs/sparse_rl_fixed_memory      (documented run)
    .venv/bin/python experiments/sparse_rl_fixed_memory.py --quick --out /tmp/x     (smoke: 2 seeds x 4 arms x 2 steps)
Extra `--set a.b=v ...` overrides go to every run (the arms' own settings win over them).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import sparse_rl_fixed_memory_stats as S  # noqa: E402  (this directory is on sys.path: script or tests)
import study_plot as P  # noqa: E402
import study_runs as R  # noqa: E402
import study_stats as T  # noqa: E402

CONFIG = REPO / "configs" / "sparse_rl_fixed_memory.yaml"
OFF, ON = "algorithm.corrections.sparse_rl.enabled=false", "algorithm.corrections.sparse_rl.enabled=true"
SCHED_OFF, SCHED_ON = "rollout.kv.budget_schedule.enabled=false", "rollout.kv.budget_schedule.enabled=true"
# (name, label, overrides); the sparse arms keep the config's rollout.kv section and its pool
ARMS = (
    ("dense", "dense RL (full KV)", ("rollout.kv.policy=none", OFF, SCHED_OFF)),
    ("naive_sparse", "naive sparse RL", (OFF, SCHED_OFF)),
    ("sparse_rl", "Sparse-RL", (ON, SCHED_OFF)),
    ("sparse_rl_sched", "Sparse-RL + budget schedule", (ON, SCHED_ON)),
)
LABELS = {name: label for name, label, _ in ARMS}
PAIRS = [("sparse_rl", "dense"), ("sparse_rl_sched", "dense"), ("sparse_rl_sched", "sparse_rl"),
         ("sparse_rl", "naive_sparse")]
PAIRED_KEYS = ["eval_dense", "eval_sparse", "time_to_target", "kv_saved_mean", "rejected_seq_frac"]
FULL = {"seeds": 5, "steps": 40, "sft_steps": 900, "sft_target": 0.5, "prompts_per_step": None, "eval_prompts": None}
QUICK = {"seeds": 2, "steps": 2, "sft_steps": 0, "sft_target": 0.0, "prompts_per_step": 4, "eval_prompts": 4}
QUICK_SETS = ("rollout.sampling.n=4", "trainer.eval_every=1")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=CONFIG, help="base config (default "
                   "configs/sparse_rl_fixed_memory.yaml); its rollout.kv.pool_blocks is the shared pool")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "sparse_rl_fixed_memory", help="output directory")
    R.add_run_args(p, FULL, QUICK)
    p.add_argument("--window", type=int, default=10, help="steps of the reward means and the collapse rule")
    p.add_argument("--collapse-drop", type=float, default=0.15, help="reward fall below the best that flags collapse")
    p.add_argument("--grad-blowup", type=float, default=10.0, help="grad norm / its median that flags collapse")
    p.add_argument("--quick", action="store_true", help="smoke: 2 seeds x 4 arms x 2 steps, no SFT, 4 eval prompts")
    args = p.parse_args(argv)
    R.finish_args(p, args, FULL, QUICK)
    if args.window < 1:
        p.error(f"--window must be >= 1 (got {args.window})")
    return args


def dense_queues(run) -> tuple[int, int]:
    """(blocks one step's dense sequences need at once, usable pool blocks); ValueError unless the pool is fixed and
    smaller (so dense must queue or preempt) and holds one dense sequence."""
    kv = run.rollout.kv
    if kv.policy == "none" or kv.pool_blocks is None or kv.block_size is None:
        raise ValueError("the study needs a sparse rollout.kv.policy, a fixed rollout.kv.pool_blocks and "
                         "rollout.kv.block_size (the shared pool)")
    longest = run.data.max_prompt_tokens + run.rollout.sampling.max_tokens
    if run.rollout.max_model_len is not None:
        longest = min(longest, run.rollout.max_model_len)
    per_seq = -(-longest // kv.block_size)
    need, usable = run.trainer.prompts_per_step * run.rollout.sampling.n * per_seq, kv.pool_blocks - 1
    if usable >= need:
        raise ValueError(f"rollout.kv.pool_blocks = {kv.pool_blocks} holds a whole step of dense sequences "
                         f"({run.trainer.prompts_per_step} x {run.rollout.sampling.n} x {per_seq} blocks = {need}): "
                         f"dense would not queue; set it below {need + 1}")
    if usable < per_seq:
        raise ValueError(f"rollout.kv.pool_blocks = {kv.pool_blocks} cannot hold one dense sequence ({per_seq} blocks "
                         "+ the one vLLM holds back)")
    return need, usable


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from megatron_sparse_rl.config import load_config

    t_start = time.perf_counter()
    args.out, args.config = args.out.resolve(), args.config.resolve()
    try:  # every config error before anything runs
        base = load_config(args.config, args.overrides)
        common = R.common_sets(args, QUICK_SETS)
        jobs = R.plan(args, base, [(name, sets) for name, _, sets in ARMS], common,
                      ("rollout.kv.policy=none", OFF, SCHED_OFF))
        configs = {j.name: load_config(args.config, j.sets) for js in jobs.values() for j in js}
        need, usable = dense_queues(configs["seed0/sparse_rl"])
        rollouts = {"dense": configs["seed0/dense"].rollout, "sparse": configs["seed0/sparse_rl"].rollout}
    except (ValueError, OSError) as e:  # ConfigError is a ValueError
        args.error(str(e))
    args.out.mkdir(parents=True, exist_ok=True)
    kv, say = base.rollout.kv, R.Console()
    say(f"{args.seeds} seed(s) x {len(ARMS)} arms x {args.steps} RL steps ({args.sft_steps} SFT steps per seed) of "
        f"{args.config}; pool {kv.pool_blocks} blocks of {kv.block_size} ({usable} usable, a dense step needs {need}); "
        f"sparse engine {kv.policy} budget {kv.budget}; out {args.out}")
    done = R.train_and_evaluate(args, jobs, configs, rollouts, say, S.run_metrics, _describe)
    if done is None:
        return 1
    rows, records, evals, starts, timing = done
    write_outputs(args, base, (need, usable), rows, records, evals, starts, timing, t_start)
    return 0


def _describe(row: dict) -> str:
    return (f"final acc {T.fmt(row['eval_own_final'])}, KV saved mean {T.fmt(row['kv_saved_mean'])}, budget last "
            f"{T.fmt(row['kv_budget_last'])}, rejected {T.fmt(row['rejected_seq_frac'])}, {row['rl_seconds']:.0f} s")


def write_outputs(args, base, pool, rows, records, evals, starts, timing, t_start) -> None:
    """fixed_memory.png, summary.json and summary.md (atomically); summary.md also to the console."""
    from sparse_rl_fixed_memory_plot import plot

    accuracy = {}
    for e in evals:
        accuracy.setdefault((e["seed"], e["arm"]), {})[e["mode"]] = e["accuracy"]
    rows = [S.add_eval(r, accuracy.get((r["seed"], r["arm"]), {})) for r in rows]
    rows, target = S.add_time_to_target(rows)
    summary = summarize(args, base, pool, rows, target, evals, starts, timing)
    summary["plot"] = str(plot(summary, records, LABELS, args.window, args.out / "fixed_memory.png"))
    summary["runs_plot"] = str(P.runs_png(rows, args.out / "runs.png"))  # msrl compare's picture of every run
    summary["seconds"] = round(time.perf_counter() - t_start, 1)
    T.write_atomic(args.out / "summary.json", json.dumps(summary, indent=2))
    T.write_atomic(args.out / "summary.md", S.render_markdown(summary))
    print(S.render_markdown(summary), flush=True)


def summarize(args, base, pool, rows: list[dict], target, evals: list[dict], starts: dict, timing: dict) -> dict:
    """summary.json (without the plot path and the total time)."""
    kv, arms, (need, usable) = base.rollout.kv, list(LABELS), pool
    sched = kv.budget_schedule
    per_eval = [e["seconds"] for e in evals]
    setup = (f"{args.config.name}: {args.seeds} seed(s) per arm, {args.steps} RL steps per run after a "
             f"{args.sft_steps}-step SFT warm start per seed"
             + (f" (stopped once held-out accuracy reached {args.sft_target})" if args.sft_target else "")
             + f"; every arm's engine on a pool of {kv.pool_blocks} blocks of {kv.block_size} tokens ({usable} usable; "
             f"one step's dense sequences need {need}); sparse arms: rollout.kv policy={kv.policy} budget={kv.budget} "
             f"window={kv.window} interval={kv.interval}; schedule arm: target_p5={sched.target_p5} "
             f"margin={sched.margin} step_up={sched.step_up} step_down={sched.step_down} budgets "
             f"[{sched.min_budget}, {sched.max_budget}]; extra overrides: {' '.join(args.overrides) or 'none'}")
    return {
        "title": f"Sparse-RL at a fixed KV pool of {kv.pool_blocks} x {kv.block_size} ({args.config.name}, "
                 f"{args.seeds} seed(s))",
        "setup": setup, "config": str(args.config), "seeds": args.seeds, "steps": args.steps,
        "sft_steps": args.sft_steps, "sft_target": args.sft_target, "window": args.window, "overrides": args.overrides,
        "pool": {"pool_blocks": kv.pool_blocks, "block_size": kv.block_size, "usable": usable, "dense_step_need": need},
        "kv": {"policy": kv.policy, "budget": kv.budget, "window": kv.window, "interval": kv.interval,
               "schedule": {"target_p5": sched.target_p5, "margin": sched.margin, "step_up": sched.step_up,
                            "step_down": sched.step_down, "min_budget": sched.min_budget,
                            "max_budget": sched.max_budget}},
        "target_accuracy": target,
        "arms": arms, "labels": LABELS, "eval_modes": list(S.EVAL_MODES),
        "collapse_rule": (f"A run collapsed when the mean of rollout/reward over {args.window} steps fell more than "
                          f"{args.collapse_drop} below its best earlier value, a step's train/grad_norm exceeded "
                          f"{args.grad_blowup}x the run's median, or a reward, grad norm or loss was NaN/inf."),
        "per_arm": S.aggregate(rows, arms),
        "paired": T.paired(rows, PAIRS, PAIRED_KEYS),
        "runs": rows,
        "evals": evals,
        "timing": {"warm_start_s": round(timing["warm_start"], 1), "rl_s": round(timing["rl"], 1),
                   "eval_s": round(timing["eval"], 1), "eval_engine_start_s": starts},
        "runtime": (f"warm starts {timing['warm_start']:.0f} s, RL runs {timing['rl']:.0f} s, evaluation "
                    f"{timing['eval']:.0f} s: {len(evals)} evaluations of "
                    f"{(sum(per_eval) / len(per_eval)) if per_eval else 0.0:.1f} s on average"),
    }


if __name__ == "__main__":
    sys.exit(main())
