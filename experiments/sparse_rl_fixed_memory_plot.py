"""The one PNG of experiments/sparse_rl_fixed_memory.py: per arm, mean ± standard error over seeds (bands) of the
in-run held-out accuracy against RL steps and against training wall-clock (the mean wall-clock of each evaluated
step), the final weights' held-out accuracy under the dense and the sparse engine (error bars, seeds as dots), the
KV saved and the budget per step, the rho_t 5th percentile, and the Sparse-RL rejection rate. matplotlib's Agg
canvas directly (no pyplot); written atomically.
"""
from __future__ import annotations

from pathlib import Path

import sparse_rl_fixed_memory_stats as S
import study_plot as P
import study_stats as T
from megatron_sparse_rl.observability import metrics as M

COLORS = {"dense": "tab:blue", "naive_sparse": "tab:red", "sparse_rl": "tab:green", "sparse_rl_sched": "tab:purple"}


def _final_accuracy(ax, summary: dict, labels: dict[str, str]) -> None:
    arms, modes = summary["arms"], list(S.EVAL_MODES)
    for i, arm in enumerate(arms):
        dx = (i - (len(arms) - 1) / 2) * 0.18
        for j, mode in enumerate(modes):
            vals = [r[f"eval_{mode}"] for r in summary["runs"] if r["arm"] == arm and r[f"eval_{mode}"] is not None]
            ax.plot([j + dx] * len(vals), vals, "o", color=COLORS[arm], alpha=0.3, markersize=4)
        stats = [summary["per_arm"][arm][f"eval_{m}"] for m in modes]
        ax.errorbar([j + dx for j in range(len(modes))], [s["mean"] or 0.0 for s in stats],
                    yerr=[s["se"] or 0.0 for s in stats], fmt="s", color=COLORS[arm], capsize=4, label=labels[arm])
    ax.set_xticks(range(len(modes)), ["dense engine", "sparse engine"], fontsize=8)


def _accuracy_vs_clock(ax, summary: dict, arm: str, label: str) -> None:
    """Mean ± s.e. over seeds of the accuracy at each evaluated step, at the mean wall-clock of that step."""
    curves = [r["eval_curve"] for r in summary["runs"] if r["arm"] == arm and r["eval_curve"]]
    if not curves:
        return
    n = min(len(c) for c in curves)
    clock = [T.mean([c[i][1] for c in curves]) for i in range(n)]
    mean, se = T.band([[p[2] for p in c] for c in curves])
    P.draw_band(ax, {"steps": clock, "mean": mean, "se": se}, COLORS[arm], label)


def plot(summary: dict, records: dict[str, list[list[dict]]], labels: dict[str, str], window: int,
         out_png: Path) -> Path:
    """`records[arm]`: the metrics records of that arm's runs, one list per seed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 8.5), dpi=72)
    FigureCanvasAgg(fig)
    (ax_s, ax_c, ax_f), (ax_k, ax_p, ax_j) = fig.subplots(2, 3)
    n, target = summary["seeds"], summary["target_accuracy"]
    for arm in summary["arms"]:
        c, recs = COLORS[arm], records[arm]
        P.band(ax_s, recs, (M.EVAL_ACCURACY,), 1, c, labels[arm])
        _accuracy_vs_clock(ax_c, summary, arm, labels[arm])
        P.band(ax_k, recs, (S.SAVED,), window, c, f"{labels[arm]}: KV saved")
        P.band(ax_p, recs, (S.RHO_P5,), window, c, f"{labels[arm]}: rho p5")
        P.band(ax_j, recs, (S.REJECTED_SEQ,), window, c, f"{labels[arm]}: rejected sequences")
    if target is not None:
        for ax in (ax_s, ax_c):
            ax.axhline(target, color="gray", linestyle=":", linewidth=1)
    _final_accuracy(ax_f, summary, labels)
    titles = ((ax_s, f"held-out accuracy (own engine, in-run); band: ± s.e. over {n} seed(s)", "RL step"),
              (ax_c, "held-out accuracy against training wall-clock (dotted: dense's final)", "seconds"),
              (ax_f, f"final weights' held-out accuracy: mean ± s.e. over {n} seed(s) (dots: seeds)", None),
              (ax_k, f"KV saved (kv/saved_frac), mean of {window} steps", "RL step"),
              (ax_p, f"mismatch/rho_p5, mean of {window} steps", "RL step"),
              (ax_j, f"Sparse-RL rejection rate, mean of {window} steps", "RL step"))
    P.finish_axes(titles)
    fig.suptitle(summary["title"], fontsize=11)
    fig.tight_layout()
    return P.save_png(fig, out_png)
