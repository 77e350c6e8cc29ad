"""Statistics shared by the experiments that train arms x seeds in one process (experiments/sparse_rl_compare.py,
experiments/routing_stability.py): mean and standard error over seeds, trailing means and drawdowns, the collapse
rule's pieces, paired per-seed differences, per-step mean curves with bands, the markdown tables of a summary and
atomic writes. Pure Python (no torch, no vLLM); each study's own numbers live in its *_stats.py.

Collapse (per run, `collapse_events`), with the study's window W, drop D and blow-up B: a run collapsed when any of
  - reward: the trailing mean of `rollout/reward` over W steps (full windows only) falls more than D below its best
    earlier value (its maximum drawdown exceeds D, in reward units);
  - grad norm (unless B is None): some step's `train/grad_norm` exceeds B times the run's median `train/grad_norm`;
  - non-finite: a step logged NaN or inf for `rollout/reward`, `train/grad_norm` or `loss/value`.
Its step is the first step at which one of them holds.
"""
from __future__ import annotations

import math
import os
import statistics
from pathlib import Path

from megatron_sparse_rl.observability import metrics as M
from megatron_sparse_rl.observability.plot import series

GRAD_NORM, LOSS = "train/grad_norm", "loss/value"
Curve = tuple[list[int], list[float]]
"""(steps, values) of one metric of one run, as observability.plot.series returns them."""


def mean_se(values) -> dict:
    """{"mean", "se", "n"} of the non-None values: the sample mean and its standard error stdev / sqrt(n)
    (stdev with n - 1); se is None below two values, mean is None without any."""
    vals = [float(v) for v in values if v is not None]
    n = len(vals)
    if not n:
        return {"mean": None, "se": None, "n": 0}
    return {"mean": math.fsum(vals) / n, "se": statistics.stdev(vals) / math.sqrt(n) if n > 1 else None, "n": n}


def mean(values: list[float]) -> float | None:
    """The mean of `values`; None for an empty list."""
    return math.fsum(values) / len(values) if values else None


def trailing_mean(ys: list[float], window: int, *, full: bool = False) -> list[float]:
    """Mean of the last `window` values at every index; `full`: only indices with a whole window behind them."""
    w = max(1, min(window, len(ys))) if full else max(1, window)
    start = w - 1 if full else 0
    return [mean(ys[max(0, i - w + 1):i + 1]) for i in range(start, len(ys))]


def max_drawdown(ys: list[float]) -> float:
    """Largest ys[peak] - ys[later] over peak <= later (0 for an empty or never-falling series)."""
    best, worst = -math.inf, 0.0
    for y in ys:
        best = max(best, y)
        worst = max(worst, best - y)
    return worst


def _first_fall(xs: list[int], ys: list[float], drop: float) -> int | None:
    """The first x at which y is more than `drop` below the best earlier y."""
    best = -math.inf
    for x, y in zip(xs, ys):
        best = max(best, y)
        if best - y > drop:
            return x
    return None


def collapse_events(reward: Curve, grad_norm: Curve, nonfinite: list[int], *, window: int, drop: float,
                    blowup: float | None) -> list[tuple[int, str]]:
    """(first step, why) of every collapse criterion that holds (module docstring); [] when the run did not collapse.
    `nonfinite`: the steps that logged a non-finite reward, grad norm or loss."""
    events = []
    xs, ys = reward
    means = trailing_mean(ys, window, full=True)
    fall = max_drawdown(means)
    if fall > drop:
        step = _first_fall(xs[len(xs) - len(means):], means, drop)
        events.append((step, f"reward mean of {min(window, len(ys))} steps fell {fall:.3f} below its best (> {drop})"))
    gx, gy = grad_norm
    if gy and blowup is not None:
        median = statistics.median(gy)
        if median > 0 and max(gy) > blowup * median:
            step = next(x for x, g in zip(gx, gy) if g > blowup * median)
            events.append((step, f"train/grad_norm reached {max(gy):.3g} = {max(gy) / median:.1f}x its median "
                                 f"(> {blowup}x)"))
    if nonfinite:
        events.append((min(nonfinite), f"{len(nonfinite)} non-finite value(s) of {M.REWARD}, {GRAD_NORM} or {LOSS}"))
    return events


def collapse_reasons(reward: list[float], grad_norm: list[float], nonfinite: int, *, window: int, drop: float,
                     blowup: float) -> list[str]:
    """Why a run with these per-step series and this many non-finite values counts as collapsed; [] when it did not."""
    def indexed(ys):
        return list(range(len(ys))), ys

    return [why for _, why in collapse_events(indexed(reward), indexed(grad_norm), list(range(nonfinite)),
                                              window=window, drop=drop, blowup=blowup)]


def nonfinite_steps(records: list[dict]) -> list[int]:
    """The RL step of every non-finite reward, grad norm or loss of a run's metrics records (one per value)."""
    return [r["step"] for r in records if r.get("phase", "rl") == "rl" for k in (M.REWARD, GRAD_NORM, LOSS)
            if isinstance(r.get(k), float) and not math.isfinite(r[k])]


def run_collapse(records: list[dict], *, window: int, drop: float, blowup: float | None) -> dict:
    """{"collapsed": 0 or 1, "collapse_step": first step or None, "collapse_reasons": [...]} of one run."""
    events = collapse_events(series(records, (M.REWARD,)), series(records, (GRAD_NORM,)), nonfinite_steps(records),
                             window=window, drop=drop, blowup=blowup)
    return {"collapsed": int(bool(events)), "collapse_step": min(s for s, _ in events) if events else None,
            "collapse_reasons": [why for _, why in events]}


def run_basics(records: list[dict], *, window: int, drop: float, blowup: float | None) -> dict:
    """The numbers every study reports of one run: RL steps, reward over the first and the last `window` steps and
    the largest fall of its `window`-step mean, the grad norm's median and max / median, and the collapse verdict."""
    reward = series(records, (M.REWARD,))[1]
    grad = series(records, (GRAD_NORM,))[1]
    w = max(1, min(window, len(reward)))
    median = statistics.median(grad) if grad else None
    return {
        "steps": len(reward),
        "reward_first": mean(reward[:w]),
        "reward_last": mean(reward[-w:]),
        "reward_max_drawdown": max_drawdown(trailing_mean(reward, window, full=True)) if reward else None,
        "grad_norm_median": median,
        "grad_norm_max_over_median": max(grad) / median if grad and median else None,
        **run_collapse(records, window=window, drop=drop, blowup=blowup),
    }


def aggregate(rows: list[dict], arms: list[str], keys: list[str]) -> dict[str, dict[str, dict]]:
    """{arm: {key: mean_se over that arm's runs}}."""
    return {arm: {k: mean_se(r.get(k) for r in rows if r["arm"] == arm) for k in keys} for arm in arms}


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


def mean_curve(curves: list[Curve], window: int = 1) -> dict | None:
    """{"steps", "mean", "se"}: the mean ± s.e. over runs (one Curve each) of the `window`-step trailing mean, at
    the steps of the shortest run; None when no run logged the metric."""
    curves = [(xs, trailing_mean(ys, window)) for xs, ys in curves if xs]
    if not curves:
        return None
    xs = min((c[0] for c in curves), key=len)
    m, se = band([ys for _, ys in curves])
    return {"steps": xs[:len(m)], "mean": m, "se": se}


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


def arm_cell(stat: dict, key: str) -> str:
    """A per-arm table cell: "k/n" for the collapse flag (a count, not a mean), else fmt."""
    if key == "collapsed" and stat["mean"] is not None:
        return f"{round(stat['mean'] * stat['n'])}/{stat['n']}"
    return fmt(stat)


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def paired_table(paired_stats: dict[str, dict[str, dict]]) -> list[str]:
    """Metrics as rows, "a - b" pairs as columns."""
    names = list(paired_stats)
    keys = list(next(iter(paired_stats.values()))) if names else []
    return table(["metric", *names], [[k, *(fmt(paired_stats[p][k]) for p in names)] for k in keys])


def collapse_lines(rule: str, runs: list[dict]) -> list[str]:
    """The rule, then one line per collapsed run with its reasons."""
    flagged = [f"- seed {r['seed']} {r['arm']}: " + "; ".join(r["collapse_reasons"]) for r in runs
               if r["collapse_reasons"]]
    return [rule, "", *(flagged or ["No run collapsed."])]


def summary_sections(summary: dict, metrics: list[tuple[str, str]]) -> list[str]:
    """The body of a study's summary.md after its header: per-arm mean ± s.e. of each (key, description) of
    `metrics`, paired differences, per-run rows, the collapse rule and the plot."""
    arms, per_arm = summary["arms"], summary["per_arm"]
    out = [f"## Per arm: mean ± standard error over {summary['seeds']} seed(s)", ""]
    out += table(["metric", *arms], [[desc.replace("W steps", f"{summary['window']} steps"),
                                      *(arm_cell(per_arm[a][k], k) for a in arms)] for k, desc in metrics])
    out += ["", "## Paired by seed: mean ± s.e. of per-seed differences", "", *paired_table(summary["paired"])]
    cols = [k for k, _ in metrics]
    out += ["", "## Per run", ""]
    out += table(["seed", "arm", *cols], [[str(r["seed"]), r["arm"], *(fmt(r.get(k)) for k in cols)]
                                          for r in summary["runs"]])
    out += ["", "## Collapse", "", *collapse_lines(summary["collapse_rule"], summary["runs"])]
    return out + ["", f"Plot: {summary['plot']}", ""]


def write_atomic(path: Path, data: str | bytes) -> Path:
    """Write `path` through a temporary file in the same directory and os.replace (readers never see half)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)
    return path
