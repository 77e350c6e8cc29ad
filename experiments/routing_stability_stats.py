"""Statistics of experiments/routing_stability.py: the collapse rule, each run's numbers and per-step curves from its
metrics records, per-arm mean ± standard error over seeds, paired per-seed differences and summary.md. The generic
pieces are experiments/study_stats.py's. Pure Python (no torch, no vLLM); tested in
tests/unit/test_routing_stability_stats.py.

The collapse rule is COLLAPSE_RULE below, word for word the one in docs/routing_stability.md ("Collapse").
"""
from __future__ import annotations

import study_stats as T
from megatron_sparse_rl.observability import metrics as M
from megatron_sparse_rl.observability.plot import series

WINDOW, DROP = 10, 0.15
"""The collapse rule's window (RL steps) and reward drop: one setting for every run of the study."""
COLLAPSE_RULE = (
    f"A run collapsed when the mean of rollout/reward over {WINDOW} consecutive RL steps falls more than {DROP} "
    "below its best earlier value, or a step logs NaN or inf for rollout/reward, train/grad_norm or loss/value. Its "
    "collapse step is the first RL step at which one of these holds. A single grad-norm spike is not a collapse: "
    "gradients are clipped (learner.optimizer.clip_grad), and train/grad_norm's max / median is reported per run "
    "beside the verdict.")
# study_stats.py's grad-norm criterion (blow-up B) is left out: in a 40-step calibration run MiniRL on policy had one
# step at 865x its median grad norm, the next step was back at the median and the reward stayed level.

ENTROPY, FLIP_RATE, FLIPPED = "loss/entropy", "routing/flip_rate_mean", "routing/flipped_token_fraction"
ROUTING_SHARE, DRIFT_PREFIX, DRIFT = "mismatch/routing_share", "routing/drift", "routing/drift_mean"
HELDOUT = "heldout"
"""The held-out accuracy curve: the warm start's `eval/accuracy` at step 0, then every in-run evaluation."""
# curve name -> the metrics.jsonl keys summed into it (DRIFT: whatever `drift_keys` finds)
CURVES: dict[str, tuple[str, ...]] = {
    HELDOUT: (M.EVAL_ACCURACY,), "reward": (M.REWARD,), "k1": (M.MISMATCH_K1,), "k3": (M.MISMATCH_K3,),
    "flip_rate": (FLIP_RATE,), "flipped_tokens": (FLIPPED,), "routing_share": (ROUTING_SHARE,),
    "drift": (DRIFT,), "entropy": (ENTROPY,), "clip_frac": M.CLIP_FRACTION, "grad_norm": (T.GRAD_NORM,),
}

# (key, what it is): the per-run numbers, in the order of the summary tables
METRICS: tuple[tuple[str, str], ...] = (
    ("eval_final", "held-out accuracy after the last RL step"),
    ("eval_peak", "best held-out accuracy over the RL evaluations"),
    ("eval_warm_start", "held-out accuracy of the warm start"),
    ("collapsed", "collapsed (1) or not (0)"),
    ("collapse_step", "collapse step (collapsed runs)"),
    ("reward_first", f"rollout reward, mean of the first {WINDOW} steps"),
    ("reward_last", f"rollout reward, mean of the last {WINDOW} steps"),
    ("reward_max_drawdown", f"largest fall of the {WINDOW}-step reward mean below its best"),
    ("k1_mean", "mismatch/k1, mean over steps"),
    ("k3_mean", "mismatch/k3, mean over steps"),
    ("routing_share_mean", "mismatch/routing_share, mean over steps"),
    ("flip_rate_mean", "routing/flip_rate_mean, mean over steps"),
    ("flipped_tokens_mean", "routing/flipped_token_fraction, mean over steps"),
    ("drift_mean", "expert drift pi_old -> pi_theta (routing/drift...), mean over steps"),
    ("entropy_mean", "loss/entropy, mean over steps"),
    ("entropy_last", "loss/entropy, last step"),
    ("clip_frac_mean", "clipped token fraction (loss/clip_frac*), mean over steps"),
    ("grad_norm_median", "train/grad_norm, median over steps"),
    ("grad_norm_max_over_median", "train/grad_norm, max / median"),
    ("train_seconds", "wall time of the run, s"),
)
PAIRED_KEYS = ["eval_final", "eval_peak", "collapsed", "reward_last", "k3_mean", "flip_rate_mean", "drift_mean"]
TABLE_KEYS = ["eval_final", "eval_peak", "collapsed", "collapse_step", "reward_last", "k3_mean", "flip_rate_mean",
              "drift_mean", "entropy_last", "clip_frac_mean"]
"""The columns of summary.md's per-arm tables (summary.json holds every metric)."""


def drift_keys(records: list[dict]) -> tuple[str, ...]:
    """The key of the expert-drift metric these records log: routing/drift_mean, else the first other name starting
    with routing/drift that is not per layer; () when the run logged none (the column stays empty)."""
    names = sorted({k for r in records for k in r if k.startswith(DRIFT_PREFIX) and "/layer" not in k})
    return (DRIFT,) if DRIFT in names else tuple(names[:1])


def curve(records: list[dict], name: str) -> T.Curve:
    """(steps, values) of one CURVES entry in one run's records."""
    if name == HELDOUT:
        warm = series(records, (M.EVAL_ACCURACY,), "warm_start")
        rl = series(records, (M.EVAL_ACCURACY,))
        return warm[0][-1:] + rl[0], warm[1][-1:] + rl[1]
    return series(records, drift_keys(records) if name == "drift" else CURVES[name])


def run_metrics(records: list[dict]) -> dict:
    """One run's numbers (METRICS, less train_seconds) and its collapse verdict from its metrics records."""
    def step_mean(name: str) -> float | None:
        return T.mean(curve(records, name)[1])

    entropy = curve(records, "entropy")[1]
    warm = series(records, (M.EVAL_ACCURACY,), "warm_start")[1]
    evals = series(records, (M.EVAL_ACCURACY,))[1]
    return {
        "eval_warm_start": warm[-1] if warm else None,
        "eval_final": evals[-1] if evals else None,
        "eval_peak": max(evals) if evals else None,
        "k1_mean": step_mean("k1"),
        "k3_mean": step_mean("k3"),
        "routing_share_mean": step_mean("routing_share"),
        "flip_rate_mean": step_mean("flip_rate"),
        "flipped_tokens_mean": step_mean("flipped_tokens"),
        "drift_mean": step_mean("drift"),
        "drift_key": (drift_keys(records) or (None,))[0],
        "entropy_mean": T.mean(entropy),
        "entropy_last": entropy[-1] if entropy else None,
        "clip_frac_mean": step_mean("clip_frac"),
        **T.run_basics(records, window=WINDOW, drop=DROP, blowup=None),
    }


def arm_curves(records: list[list[dict]]) -> dict[str, dict]:
    """{curve name: {"steps", "mean", "se"}} over one arm's runs (one records list per seed); names no run logged
    are left out."""
    out = {name: T.mean_curve([curve(recs, name) for recs in records]) for name in CURVES}
    return {name: c for name, c in out.items() if c is not None}


def per_arm(rows: list[dict], arms: list[str]) -> dict[str, dict[str, dict]]:
    """{arm: {metric: mean_se over seeds}}; collapse_step over the runs that collapsed only."""
    return T.aggregate(rows, arms, [k for k, _ in METRICS])


def render_markdown(summary: dict) -> str:
    """summary.md: setup, per group the arms' mean ± s.e. over seeds, the paired differences, the per-run rows and
    the collapse rule with the runs it flagged."""
    labels, stats, n = summary["labels"], summary["per_arm"], summary["seeds"]
    what = dict(METRICS)
    out = ["# MoE routing stability: MiniRL arms, R2/R3 routing replay, GRPO vs GSPO", "", summary["setup"], "",
           f"Runtime {summary['seconds']:.0f} s in all ({summary['runtime']}).", ""]
    for group, arms in summary["groups"].items():
        out += [f"## {group}: mean ± standard error over {n} seed(s)", ""]
        out += T.table(["arm", *TABLE_KEYS], [[f"{a} ({labels[a]})", *(T.arm_cell(stats[a][k], k) for k in TABLE_KEYS)]
                                              for a in arms])
        out += [""]
    out += ["Columns: " + "; ".join(f"{k}: {what[k]}" for k in TABLE_KEYS) + ".", "",
            "## Paired by seed: mean ± s.e. of the per-seed differences a - b", ""]
    out += T.table(["a - b", *PAIRED_KEYS], [[p, *(T.fmt(d[k]) for k in PAIRED_KEYS)]
                                             for p, d in summary["paired"].items()])
    cols = [k for k, _ in METRICS]
    out += ["", "## Per run", ""]
    out += T.table(["seed", "arm", *cols], [[str(r["seed"]), r["arm"], *(T.fmt(r.get(k)) for k in cols)]
                                            for r in summary["runs"]])
    out += ["", "## Collapse", "", *T.collapse_lines(summary["collapse_rule"], summary["runs"]), ""]
    out += ["Plots: " + ", ".join(summary["plots"].values()), ""]
    return "\n".join(out)
