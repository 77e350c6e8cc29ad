"""Statistics of experiments/sparse_rl_fixed_memory.py: per-run numbers from a run's metrics records, the training
wall-clock to reach dense's final accuracy, per-arm means and summary.md. The generic pieces (mean and standard
error, the collapse rule, paired differences, markdown tables) are experiments/study_stats.py's. Pure Python (no
torch, no vLLM); tested in tests/unit/test_sparse_rl_fixed_memory_stats.py.

Definitions (per run, from its metrics.jsonl):
- training wall-clock at RL step k: the sum over steps 1..k of time/rollout_s + time/train_s + time/sync_s (the
  in-run evaluations excluded, since the arms evaluate with different engines);
- the accuracy curve: eval/accuracy at every evaluated RL step (the run's own engine: dense for the dense arm, the
  sparse engine at the step's budget for the others), with its wall-clock;
- time to target: the wall-clock of the first evaluated step whose accuracy reaches the target, dense's final
  accuracy = the mean over seeds of the dense runs' last eval/accuracy; None when the run never reaches it;
  `time_to_target_vs_dense` = that over the same seed's dense run's own time to target (paired);
- KV saved: kv/saved_frac per step (1 - kv/retention; 0 for the dense arm, which logs none), its peak (max over
  steps) and mean; the budget kv/budget per step (mean and last);
- rejection rate: sparse_rl/rejected_seq_frac, mean over steps (0 when the arm does not correct).
"""
from __future__ import annotations

import study_stats as T
from megatron_sparse_rl.observability import metrics as M
from megatron_sparse_rl.observability.plot import series

SAVED, BUDGET, RHO_P5 = "kv/saved_frac", "kv/budget", "mismatch/rho_p5"
REJECTED_SEQ = "sparse_rl/rejected_seq_frac"
STEP_SECONDS = ("time/rollout_s", "time/train_s", "time/sync_s")
RUNNING, PREEMPTIONS = "rollout/running_mean", "rollout/preemptions"
EVAL_MODES = ("dense", "sparse")
"""Held-out evaluation of every final model: dense engine, sparse engine at the config's (starting) budget."""

# (key, what it is): the per-run numbers, in the order of the summary tables
METRICS: tuple[tuple[str, str], ...] = (
    ("eval_dense", "held-out acc., dense engine"),
    ("eval_sparse", "held-out acc., sparse engine (config's budget)"),
    ("eval_own_final", "held-out acc. after RL, own engine (in-run)"),
    ("time_to_target", "training wall-clock to dense's final acc., s"),
    ("time_to_target_vs_dense", "time to target / same seed's dense"),
    ("rl_seconds", "training wall-clock of all steps, s"),
    ("kv_saved_peak", "KV saved, peak over steps"),
    ("kv_saved_mean", "KV saved, mean over steps"),
    ("kv_budget_mean", "KV budget, mean over steps"),
    ("kv_budget_last", "KV budget, last step"),
    ("rho_p5_mean", "mismatch/rho_p5, mean over steps"),
    ("rejected_seq_frac", "Sparse-RL rejected sequences (mean over steps)"),
    ("running_mean", "sequences running per engine step (mean)"),
    ("preemptions_mean", "preemptions per step (mean)"),
    ("reward_last", "rollout reward, mean of the last W steps"),
    ("collapsed", "collapsed (1) or not (0)"),
)


def _rl(records: list[dict], key: str) -> list[float]:
    return series(records, (key,))[1]


def wall_clock(records: list[dict]) -> dict[int, float]:
    """{RL step: training wall-clock through it} (module docstring)."""
    total, out = 0.0, {}
    for r in records:
        if r.get("phase", "rl") != "rl":
            continue
        total += sum(float(r.get(k, 0.0)) for k in STEP_SECONDS)
        out[int(r["step"])] = total
    return out


def eval_curve(records: list[dict]) -> list[list[float]]:
    """[[step, wall-clock s, accuracy], ...] of the run's in-run evaluations after RL steps, in step order."""
    clock = wall_clock(records)
    xs, ys = series(records, (M.EVAL_ACCURACY,))
    return [[x, clock.get(x, 0.0), y] for x, y in zip(xs, ys)]


def run_metrics(records: list[dict], *, window: int, drop: float, blowup: float) -> dict:
    """The per-run numbers of one training run's metrics records, except the engine-only evaluations (eval_dense,
    eval_sparse: `add_eval`) and the time to target (`add_time_to_target`, which needs every dense run)."""
    own = _rl(records, M.EVAL_ACCURACY)
    warm = series(records, (M.EVAL_ACCURACY,), "warm_start")[1]
    saved, budget = _rl(records, SAVED), _rl(records, BUDGET)
    clock = wall_clock(records)
    return {
        "eval_own_warm_start": warm[-1] if warm else None,
        "eval_own_final": own[-1] if own else None,
        "eval_curve": eval_curve(records),
        "rl_seconds": max(clock.values()) if clock else 0.0,
        "kv_saved_peak": max(saved) if saved else 0.0,
        "kv_saved_mean": T.mean(saved) if saved else 0.0,
        "kv_budget_mean": T.mean(budget),
        "kv_budget_last": budget[-1] if budget else None,
        "rho_p5_mean": T.mean(_rl(records, RHO_P5)),
        "rejected_seq_frac": T.mean(_rl(records, REJECTED_SEQ)) or 0.0,
        "running_mean": T.mean(_rl(records, RUNNING)),
        "preemptions_mean": T.mean(_rl(records, PREEMPTIONS)),
        **T.run_basics(records, window=window, drop=drop, blowup=blowup),
    }


def add_eval(row: dict, accuracy: dict[str, float]) -> dict:
    """`row` with the engine-only accuracies of EVAL_MODES."""
    return dict(row, **{f"eval_{m}": accuracy.get(m) for m in EVAL_MODES})


def first_time_at(curve: list[list[float]], target: float) -> float | None:
    """The wall-clock of the first point of `curve` ([step, s, accuracy] each) whose accuracy reaches `target`."""
    return next((s for _, s, acc in curve if acc >= target), None)


def dense_target(rows: list[dict], dense: str = "dense") -> float | None:
    """Dense's final accuracy: the mean over seeds of the dense runs' last in-run evaluation."""
    return T.mean([r["eval_own_final"] for r in rows if r["arm"] == dense and r["eval_own_final"] is not None])


def add_time_to_target(rows: list[dict], dense: str = "dense") -> tuple[list[dict], float | None]:
    """(rows with time_to_target and time_to_target_vs_dense, the target); the target is `dense_target`."""
    target = dense_target(rows, dense)
    times = {}
    out = []
    for r in rows:
        t = None if target is None else first_time_at(r["eval_curve"], target)
        times[(r["seed"], r["arm"])] = t
        out.append(dict(r, time_to_target=t))
    for r in out:
        base = times.get((r["seed"], dense))
        r["time_to_target_vs_dense"] = (r["time_to_target"] / base if r["time_to_target"] is not None and base
                                        else None)
    return out, target


def aggregate(rows: list[dict], arms: list[str]) -> dict[str, dict[str, dict]]:
    """{arm: {metric: mean_se over that arm's runs}} for every metric of METRICS; time_to_target also counts the
    runs that reached the target (`reached`: n of mean_se)."""
    return T.aggregate(rows, arms, [k for k, _ in METRICS])


def render_markdown(summary: dict) -> str:
    """summary.md: setup, target, runtime, per-arm mean ± s.e., paired differences, per-run rows, collapse rule."""
    arms, per_arm, n = summary["arms"], summary["per_arm"], summary["seeds"]
    target = summary["target_accuracy"]
    reached = {a: f"{per_arm[a]['time_to_target']['n']}/{n}" for a in arms}
    out = ["# Sparse-RL at a fixed KV memory", "", summary["setup"], "",
           f"Target: dense's final held-out accuracy (own engine, mean over seeds) = {T.fmt(target)}; runs that "
           "reached it: " + ", ".join(f"{a} {reached[a]}" for a in arms) + ".", "",
           f"Runtime {summary['seconds']:.0f} s in all ({summary['runtime']}).", "",
           *T.summary_sections(summary, METRICS)]
    return "\n".join(out)
