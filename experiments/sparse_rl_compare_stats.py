"""Statistics of experiments/sparse_rl_compare.py: per-run numbers from a run's metrics records, the collapse
rule, mean and standard error over seeds, paired differences, reward bands, summary.md and atomic writes.
Pure Python (no torch, no vLLM); tested in tests/unit/test_sparse_rl_compare_stats.py.

Collapse (per run, `collapse_reasons`): a run collapsed when any of
  - reward: the trailing mean of `rollout/reward` over `window` steps (full windows only) falls more than `drop`
    below its best earlier value (its maximum drawdown exceeds `drop`, in reward units);
  - grad norm: some step's `train/grad_norm` exceeds `blowup` times the run's median `train/grad_norm`;
  - non-finite: a step logged NaN or inf for `rollout/reward`, `train/grad_norm` or `loss/value`.
"""
from __future__ import annotations

import math
import os
import statistics
from pathlib import Path

from megatron_sparse_rl.observability import metrics as M
from megatron_sparse_rl.observability.plot import series

GRAD_NORM, LOSS = "train/grad_norm", "loss/value"
REJECTED_SEQ, REJECTED_TOKEN = "sparse_rl/rejected_seq_frac", "sparse_rl/rejected_token_frac"
K1_BEFORE, K1_AFTER, COMPRESSED = "kv/k1_before_compression", "kv/k1_after_compression", "kv/compressed_frac"
EVAL_MODES = ("dense", "sparse", "tight")
"""Held-out evaluation of every final model: dense engine, sparse engine at the training budget, at the tight one."""

# (key, what it is): the per-run numbers, in the order of the summary tables
METRICS: tuple[tuple[str, str], ...] = (
    ("eval_dense", "held-out acc., dense engine"),
    ("eval_sparse", "held-out acc., sparse engine, training budget"),
    ("eval_tight", "held-out acc., sparse engine, tight budget"),
    ("drop_sparse", "dense - sparse held-out acc. (training budget)"),
    ("drop_tight", "dense - sparse held-out acc. (tight budget)"),
    ("eval_own_warm_start", "held-out acc. before RL, own engine (in-run)"),
    ("eval_own_final", "held-out acc. after RL, own engine (in-run)"),
    ("reward_first", "rollout reward, mean of the first W steps"),
    ("reward_last", "rollout reward, mean of the last W steps"),
    ("reward_max_drawdown", "largest fall of the W-step reward mean below its best"),
    ("rejected_seq_frac", "Sparse-RL rejected sequences (mean over steps)"),
    ("rejected_token_frac", "Sparse-RL rejected tokens (mean over steps)"),
    ("k1_before_compression", "kv/k1_before_compression (mean over steps)"),
    ("k1_after_compression", "kv/k1_after_compression (mean over steps)"),
    ("mismatch_k1", "mismatch/k1 (mean over steps)"),
    ("compressed_frac", "kv/compressed_frac (mean over steps)"),
    ("grad_norm_median", "train/grad_norm, median over steps"),
    ("grad_norm_max_over_median", "train/grad_norm, max / median"),
    ("collapsed", "collapsed (1) or not (0)"),
    ("train_seconds", "wall time of the training run, s"),
)


def mean_se(values) -> dict:
    """{"mean", "se", "n"} of the non-None values: the sample mean and its standard error stdev / sqrt(n)
    (stdev with n - 1); se is None below two values, mean is None without any."""
    vals = [float(v) for v in values if v is not None]
    n = len(vals)
    if not n:
        return {"mean": None, "se": None, "n": 0}
    return {"mean": math.fsum(vals) / n, "se": statistics.stdev(vals) / math.sqrt(n) if n > 1 else None, "n": n}


def _mean(values: list[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def trailing_mean(ys: list[float], window: int, *, full: bool = False) -> list[float]:
    """Mean of the last `window` values at every index; `full`: only indices with a whole window behind them."""
    w = max(1, min(window, len(ys))) if full else max(1, window)
    start = w - 1 if full else 0
    return [_mean(ys[max(0, i - w + 1):i + 1]) for i in range(start, len(ys))]


def max_drawdown(ys: list[float]) -> float:
    """Largest ys[peak] - ys[later] over peak <= later (0 for an empty or never-falling series)."""
    best, worst = -math.inf, 0.0
    for y in ys:
        best = max(best, y)
        worst = max(worst, best - y)
    return worst


def collapse_reasons(reward: list[float], grad_norm: list[float], nonfinite: int, *, window: int, drop: float,
                     blowup: float) -> list[str]:
    """Why a run counts as collapsed (module docstring); [] when it did not."""
    reasons = []
    fall = max_drawdown(trailing_mean(reward, window, full=True))
    if fall > drop:
        reasons.append(f"reward mean of {min(window, len(reward))} steps fell {fall:.3f} below its best (> {drop})")
    if grad_norm:
        median = statistics.median(grad_norm)
        if median > 0 and max(grad_norm) > blowup * median:
            reasons.append(f"train/grad_norm reached {max(grad_norm):.3g} = {max(grad_norm) / median:.1f}x its median "
                           f"(> {blowup}x)")
    if nonfinite:
        reasons.append(f"{nonfinite} non-finite value(s) of {M.REWARD}, {GRAD_NORM} or {LOSS}")
    return reasons


def _nonfinite(records: list[dict]) -> int:
    return sum(1 for r in records if r.get("phase", "rl") == "rl" for k in (M.REWARD, GRAD_NORM, LOSS)
               if isinstance(r.get(k), float) and not math.isfinite(r[k]))


def run_metrics(records: list[dict], *, window: int, drop: float, blowup: float) -> dict:
    """The per-run numbers of one training run's metrics records (read_metrics), except the engine-only
    evaluations, which the caller adds (eval_dense, eval_sparse, eval_tight, drop_*)."""
    reward = series(records, (M.REWARD,))[1]
    grad = series(records, (GRAD_NORM,))[1]
    own = series(records, (M.EVAL_ACCURACY,))[1]
    warm = series(records, (M.EVAL_ACCURACY,), "warm_start")[1]
    w = max(1, min(window, len(reward)))
    reasons = collapse_reasons(reward, grad, _nonfinite(records), window=window, drop=drop, blowup=blowup)
    median = statistics.median(grad) if grad else None
    return {
        "steps": len(reward),
        "eval_own_warm_start": warm[-1] if warm else None,
        "eval_own_final": own[-1] if own else None,
        "reward_first": _mean(reward[:w]),
        "reward_last": _mean(reward[-w:]),
        "reward_max_drawdown": max_drawdown(trailing_mean(reward, window, full=True)) if reward else None,
        "rejected_seq_frac": _mean(series(records, (REJECTED_SEQ,))[1]),
        "rejected_token_frac": _mean(series(records, (REJECTED_TOKEN,))[1]),
        "k1_before_compression": _mean(series(records, (K1_BEFORE,))[1]),
        "k1_after_compression": _mean(series(records, (K1_AFTER,))[1]),
        "mismatch_k1": _mean(series(records, (M.MISMATCH_K1,))[1]),
        "compressed_frac": _mean(series(records, (COMPRESSED,))[1]),
        "grad_norm_median": median,
        "grad_norm_max_over_median": max(grad) / median if grad and median else None,
        "collapsed": int(bool(reasons)),
        "collapse_reasons": reasons,
    }


def add_eval(row: dict, accuracy: dict[str, float]) -> dict:
    """`row` with the three engine-only accuracies and the falls under sparse inference (dense - sparse)."""
    row = dict(row, **{f"eval_{m}": accuracy.get(m) for m in EVAL_MODES})
    for m in ("sparse", "tight"):
        a, b = row["eval_dense"], row[f"eval_{m}"]
        row[f"drop_{m}"] = None if a is None or b is None else a - b
    return row


def aggregate(rows: list[dict], arms: list[str]) -> dict[str, dict[str, dict]]:
    """{arm: {metric: mean_se over that arm's runs}} for every metric of METRICS."""
    return {arm: {k: mean_se(r.get(k) for r in rows if r["arm"] == arm) for k, _ in METRICS} for arm in arms}


def paired(rows: list[dict], pairs: list[tuple[str, str]], keys: list[str]) -> dict[str, dict[str, dict]]:
    """{"a - b": {metric: mean_se over seeds of (a's value - b's value)}}: seeds share warm start, prompts and
    sampling seeds across arms, so per-seed differences cancel what the seed varies."""
    by = {(r["seed"], r["arm"]): r for r in rows}
    seeds = sorted({r["seed"] for r in rows})
    out = {}
    for a, b in pairs:
        diffs = {}
        for k in keys:
            pairs_k = [(by.get((s, a), {}).get(k), by.get((s, b), {}).get(k)) for s in seeds]
            diffs[k] = mean_se(x - y for x, y in pairs_k if x is not None and y is not None)
        out[f"{a} - {b}"] = diffs
    return out


def band(curves: list[list[float]]) -> tuple[list[float], list[float | None]]:
    """(mean, standard error) at every index the curves share (the shortest curve's length)."""
    n = min((len(c) for c in curves), default=0)
    stats = [mean_se(c[i] for c in curves) for i in range(n)]
    return [s["mean"] for s in stats], [s["se"] for s in stats]


def fmt(stat: dict | float | int | None, digits: int = 3) -> str:
    """"m ± se" of a mean_se dict ("m" alone below two values), a bare number, or "-"."""
    if isinstance(stat, dict):
        if stat["mean"] is None:
            return "-"
        m = f"{stat['mean']:.{digits}f}"
        return m if stat["se"] is None else f"{m} ± {stat['se']:.{digits}f}"
    if stat is None:
        return "-"
    return f"{stat:.{digits}f}" if isinstance(stat, float) else str(stat)


def _arm_cell(stat: dict, key: str) -> str:
    if key == "collapsed" and stat["mean"] is not None:  # a count, not a mean
        return f"{round(stat['mean'] * stat['n'])}/{stat['n']}"
    return fmt(stat)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def render_markdown(summary: dict) -> str:
    """summary.md: setup, runtime, per-arm mean ± s.e., paired differences, per-run rows, collapse rule."""
    arms, per_arm, n = summary["arms"], summary["per_arm"], summary["seeds"]
    out = ["# Dense vs naive sparse vs Sparse-RL", "", summary["setup"], "",
           f"Runtime {summary['seconds']:.0f} s in all ({summary['runtime']}).", "",
           f"## Per arm: mean ± standard error over {n} seed(s)", ""]
    out += _table(["metric", *arms], [[desc.replace("W steps", f"{summary['window']} steps"),
                                       *(_arm_cell(per_arm[a][k], k) for a in arms)] for k, desc in METRICS])
    out += ["", "## Paired by seed: mean ± s.e. of per-seed differences", ""]
    pair_names = list(summary["paired"])
    keys = list(next(iter(summary["paired"].values()))) if pair_names else []
    out += _table(["metric", *pair_names], [[k, *(fmt(summary["paired"][p][k]) for p in pair_names)] for k in keys])
    out += ["", "## Per run", ""]
    cols = [k for k, _ in METRICS]
    out += _table(["seed", "arm", *cols], [[str(r["seed"]), r["arm"], *(fmt(r.get(k)) for k in cols)]
                                           for r in summary["runs"]])
    flagged = [f"- seed {r['seed']} {r['arm']}: " + "; ".join(r["collapse_reasons"]) for r in summary["runs"]
               if r["collapse_reasons"]]
    out += ["", "## Collapse", "", summary["collapse_rule"], "", *(flagged or ["No run collapsed."])]
    out += ["", f"Plot: {summary['plot']}", ""]
    return "\n".join(out)


def write_atomic(path: Path, data: str | bytes) -> Path:
    """Write `path` through a temporary file in the same directory and os.replace (readers never see half)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)
    return path
