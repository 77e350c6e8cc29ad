"""Dense RL vs naive sparse RL vs Sparse-RL over several seeds, with every final model evaluated under a dense and
two sparse engines ("Sparse-RL evidence that holds up", item 2). Small scale, CPU.

Per seed s (0 .. --seeds - 1) every run is a real `msrl train` (the trainer's `train(load_config(...))`, Megatron-Core
learner, vLLM engine) of --config (default configs/sparse_rl_compare.yaml):
  0. warm start: model.tiny built with seed s (or the config's model.path), then --sft-steps SFT steps (dense
     engine; with --sft-target A it stops once held-out accuracy reaches A), exported to
     OUT/seed<s>/warm_start/hf_final (--sft-steps 0: the model itself); shared by the seed's
     three arms;
  1. dense:        rollout.kv.policy=none (full KV cache), no correction;
  2. naive_sparse: the config's sparse rollout.kv engine, no correction (samples from the sparse sampler mu, ratio
                   pi_theta / pi_old with pi_old the learner's dense recompute; nothing corrects mu != pi_old);
  3. sparse_rl:    the same engine + algorithm.corrections.sparse_rl (rejection + reweighting).
Seed s adds s to model.tiny.seed, learner.seed, rollout.seed (sampling, evaluation) and data.seed (prompt order)
of the config; data.arithmetic.seed (data.chain.seed) stays, so the held-out problems are the same for every seed.
Then each final model is evaluated on the held-out prompts, in this process, by three vLLM engines, each started
once and given every model's weights in turn (`RolloutEngine.load_weights` from its hf_final): "dense"
(rollout.kv.policy=none: the dense arm's engine), "sparse" (the config's rollout.kv: the sparse arms' engine),
"tight" (the same at --tight-budget, default half the budget, raised to the config's minimum). Each evaluation
calls placement/rollout.py `accuracy` with the arguments `msrl train`'s evaluation uses; the run's own in-run final
evaluation must match the engine-only one of its own engine exactly (summary "checks").
Collapse (per run): the trailing mean of rollout/reward over --window steps falls more than --collapse-drop
below its best, or a step's train/grad_norm exceeds --grad-blowup x the run's median, or a reward, grad norm or
loss is NaN/inf (experiments/study_stats.py).

The runs share this process (experiments/study_runs.py: one Python, vLLM and Megatron start-up for all of them: a later run starts in
seconds instead of ~40 s; a run's metrics are identical to a fresh `msrl train` of the same config). Each run's
console goes to OUT/logs/seed<s>_<arm>.log, its full log to its run directory. Writes OUT/compare.png,
OUT/runs.png (`msrl compare`'s picture of every run: study_plot.py `runs_png`), OUT/summary.json and OUT/summary.md (mean ± standard error over seeds per arm, paired per-seed differences,
per-run rows, collapse flags, runtime), atomically.

    .venv/bin/python experiments/sparse_rl_compare.py --seeds 3 --out runs/sparse_rl_compare     (documented run)
    .venv/bin/python experiments/sparse_rl_compare.py --quick --out /tmp/x          (smoke: 2 seeds x 3 arms x 2 steps)
    .venv/bin/python experiments/sparse_rl_compare.py --config configs/sparse_rl_scratchpad.yaml --seeds 3 ...
Extra `--set a.b=v ...` overrides go to every run (the arms' own settings win over them).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import sparse_rl_compare_stats as S  # noqa: E402  (this directory is on sys.path: script or tests)
import study_plot as P  # noqa: E402
import study_runs as R  # noqa: E402
import study_stats as T  # noqa: E402

CONFIG = REPO / "configs" / "sparse_rl_compare.yaml"
OFF = "algorithm.corrections.sparse_rl.enabled=false"
# (name, label, overrides); the sparse arms keep the config's rollout.kv section
ARMS = (
    ("dense", "dense RL (full KV)", ("rollout.kv.policy=none", OFF)),
    ("naive_sparse", "naive sparse RL (no correction)", (OFF,)),
    ("sparse_rl", "Sparse-RL (rejection + reweighting)", ("algorithm.corrections.sparse_rl.enabled=true",)),
)
LABELS = {name: label for name, label, _ in ARMS}
PAIRS = [("sparse_rl", "naive_sparse"), ("sparse_rl", "dense"), ("naive_sparse", "dense")]
PAIRED_KEYS = ["eval_dense", "eval_sparse", "eval_tight", "drop_sparse", "drop_tight", "reward_last"]
# defaults of the documented run and of --quick (explicit flags win over both)
FULL = {"seeds": 3, "steps": 100, "sft_steps": 300, "sft_target": 0.0, "prompts_per_step": None,
        "eval_prompts": None}
QUICK = {"seeds": 2, "steps": 2, "sft_steps": 0, "sft_target": 0.0, "prompts_per_step": 4, "eval_prompts": 4}
QUICK_SETS = ("rollout.sampling.n=4",)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=CONFIG, help="base config (default configs/sparse_rl_compare.yaml)")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "sparse_rl_compare", help="output directory")
    R.add_run_args(p, FULL, QUICK)
    p.add_argument("--tight-budget", type=int, help="KV budget of the tight sparse evaluation (default: half the "
                   "config's rollout.kv.budget, at least what the config's rules allow)")
    p.add_argument("--window", type=int, default=10, help="steps of the reward means and the collapse rule")
    p.add_argument("--collapse-drop", type=float, default=0.15, help="reward fall below the best that flags collapse")
    p.add_argument("--grad-blowup", type=float, default=10.0, help="grad norm / its median that flags collapse")
    p.add_argument("--quick", action="store_true", help="smoke: 2 seeds x 3 arms x 2 steps, no SFT, 4 eval prompts")
    args = p.parse_args(argv)
    R.finish_args(p, args, FULL, QUICK)
    if args.window < 1:
        p.error(f"--window must be >= 1 (got {args.window})")
    return args


def tight_budget(kv, requested: int | None) -> int:
    """The tight evaluation budget: `requested`, or half of kv.budget raised to the least the config's rules allow
    (budget >= window; >= sinks + window for streamingllm). ValueError when it is not below kv.budget or breaks those
    rules."""
    if requested is None:
        least = kv.window + (kv.sinks if kv.policy == "streamingllm" else 0)
        requested = max(kv.budget // 2, least)
        if requested >= kv.budget:
            raise ValueError(f"no budget below rollout.kv.budget={kv.budget} is valid for {kv.policy} with window "
                             f"{kv.window}: pass --tight-budget or lower rollout.kv.window")
    if requested >= kv.budget:
        raise ValueError(f"--tight-budget {requested} must be below the training budget rollout.kv.budget={kv.budget}")
    try:
        dataclasses.replace(kv, budget=requested)  # KVConfig.__post_init__: the config's own rules
    except ValueError as e:
        raise ValueError(f"--tight-budget {requested}: {e}") from None
    return requested


def plan(args, base) -> dict[int, list[R.Job]]:
    """Per seed: [warm start (when --sft-steps > 0), dense, naive_sparse, sparse_rl]."""
    common = ["trainer.eval_every=0", *R.common_sets(args, QUICK_SETS)]  # in-run: only before and after RL
    return R.plan(args, base, [(name, sets) for name, _, sets in ARMS], common, ("rollout.kv.policy=none", OFF))


def _describe(row: dict) -> str:
    return (f"reward last {T.fmt(row['reward_last'])}, k1 {T.fmt(row['mismatch_k1'])}, rejected "
            f"{T.fmt(row['rejected_seq_frac'])}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from megatron_sparse_rl.config import load_config

    t_start = time.perf_counter()
    args.out, args.config = args.out.resolve(), args.config.resolve()
    try:  # every config error before anything runs
        base = load_config(args.config, args.overrides)
        if base.rollout.kv.policy == "none":
            raise ValueError("the sparse arms need a sparse rollout.kv.policy (the config has none)")
        tight = tight_budget(base.rollout.kv, args.tight_budget)
        jobs = plan(args, base)
        configs = {j.name: load_config(args.config, j.sets) for js in jobs.values() for j in js}
        rollouts = {"dense": configs["seed0/dense"].rollout, "sparse": configs["seed0/sparse_rl"].rollout,
                    "tight": load_config(args.config, [*jobs[0][-1].sets, f"rollout.kv.budget={tight}"]).rollout}
    except (ValueError, OSError) as e:  # ConfigError is a ValueError
        args.error(str(e))
    args.out.mkdir(parents=True, exist_ok=True)
    kv, say = base.rollout.kv, R.Console()
    say(f"{args.seeds} seed(s) x {len(ARMS)} arms x {args.steps} RL steps ({args.sft_steps} SFT steps per seed) of "
        f"{args.config}; sparse engine {kv.policy} budget {kv.budget}, tight budget {tight}; out {args.out}")
    done = R.train_and_evaluate(args, jobs, configs, rollouts, say, S.run_metrics, _describe)
    if done is None:
        return 1
    rows, records, evals, starts, timing = done
    write_outputs(args, base, tight, rows, records, evals, starts, timing, t_start)
    return 0


def write_outputs(args, base, tight, rows, records, evals, starts, timing, t_start) -> None:
    """compare.png, summary.json and summary.md (atomically); summary.md also to the console."""
    import json

    from sparse_rl_compare_plot import plot

    accuracy = {}
    for e in evals:
        accuracy.setdefault((e["seed"], e["arm"]), {})[e["mode"]] = e["accuracy"]
    rows = [S.add_eval(r, accuracy.get((r["seed"], r["arm"]), {})) for r in rows]
    summary = summarize(args, base, tight, rows, evals, starts, timing)
    summary["plot"] = str(plot(summary, records, LABELS, args.window, args.out / "compare.png"))
    summary["runs_plot"] = str(P.runs_png(rows, args.out / "runs.png"))  # msrl compare's picture of every run
    summary["seconds"] = round(time.perf_counter() - t_start, 1)
    diff = summary["checks"]["own_engine_final_vs_engine_only_max_abs_diff"]
    if diff:
        print(f"warning: an in-run final evaluation differs from the engine-only one of its engine by {diff:.4f} "
              "(summary.json checks)", file=sys.stderr)
    T.write_atomic(args.out / "summary.json", json.dumps(summary, indent=2))
    T.write_atomic(args.out / "summary.md", S.render_markdown(summary))
    print(S.render_markdown(summary), flush=True)


def _avg(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def summarize(args, base, tight: int, rows: list[dict], evals: list[dict], starts: dict, timing: dict) -> dict:
    """summary.json (without the plot path and the total time)."""
    kv, arms = base.rollout.kv, list(LABELS)
    own = {"dense": "eval_dense", "naive_sparse": "eval_sparse", "sparse_rl": "eval_sparse"}
    diffs = [abs(r["eval_own_final"] - r[own[r["arm"]]]) for r in rows
             if r["eval_own_final"] is not None and r[own[r["arm"]]] is not None]
    per_eval = [e["seconds"] for e in evals]
    setup = (f"{args.config.name}: {args.seeds} seed(s) per arm, {args.steps} RL steps per run after a "
             f"{args.sft_steps}-step SFT warm start per seed"
             + (f" (stopped once held-out accuracy reached {args.sft_target})" if args.sft_target else "")
             + f" (shared by its three arms); sparse arms: rollout.kv "
             f"policy={kv.policy} budget={kv.budget} window={kv.window} interval={kv.interval}; evaluation engines: "
             f"dense, sparse at budget {kv.budget}, tight at budget {tight}; "
             f"extra overrides: {' '.join(args.overrides) or 'none'}")
    return {
        "title": f"dense vs naive sparse vs Sparse-RL ({args.config.name}, {kv.policy} budget {kv.budget}, "
                 f"{args.seeds} seed(s))",
        "setup": setup, "config": str(args.config), "seeds": args.seeds, "steps": args.steps,
        "sft_steps": args.sft_steps, "sft_target": args.sft_target, "window": args.window, "overrides": args.overrides,
        "kv": {"policy": kv.policy, "budget": kv.budget, "tight_budget": tight, "window": kv.window,
               "interval": kv.interval},
        "arms": arms, "labels": LABELS, "eval_modes": list(S.EVAL_MODES),
        "eval_mode_labels": {"dense": "dense engine", "sparse": f"{kv.policy} budget {kv.budget}",
                             "tight": f"{kv.policy} budget {tight}"},
        "collapse_rule": (f"A run collapsed when the mean of rollout/reward over {args.window} steps fell more than "
                          f"{args.collapse_drop} below its best earlier value, a step's train/grad_norm exceeded "
                          f"{args.grad_blowup}x the run's median, or a reward, grad norm or loss was NaN/inf."),
        "per_arm": S.aggregate(rows, arms),
        "paired": T.paired(rows, PAIRS, PAIRED_KEYS),
        "runs": rows,
        "evals": evals,
        "checks": {"own_engine_final_vs_engine_only_max_abs_diff": max(diffs) if diffs else None,
                   "note": "in-run final evaluation (own engine, synced weights) vs the engine-only evaluation of "
                           "the same engine kind from hf_final: equal when the evaluation is reproduced exactly"},
        "timing": {"warm_start_s": round(timing["warm_start"], 1), "rl_s": round(timing["rl"], 1),
                   "eval_s": round(timing["eval"], 1), "eval_engine_start_s": starts,
                   "eval_mean_s": round(_avg(per_eval), 2)},
        "runtime": (f"warm starts {timing['warm_start']:.0f} s, RL runs {timing['rl']:.0f} s, evaluation "
                    f"{timing['eval']:.0f} s: {len(evals)} evaluations of {_avg(per_eval):.1f} s on average after "
                    f"{len(starts)} engine starts of {_avg(list(starts.values())):.1f} s"),
    }


if __name__ == "__main__":
    sys.exit(main())
