"""The one PNG of experiments/sparse_rl_compare.py: rollout reward per arm (mean ± standard error over seeds as a
band), held-out accuracy of every arm's final weights under the three evaluation engines (mean with s.e. error
bars, seeds as faint dots), the k1 mismatch and the Sparse-RL rejection rate (bands). matplotlib's Agg canvas
directly (no pyplot); written atomically.
"""
from __future__ import annotations

from pathlib import Path

import sparse_rl_compare_stats as S
import study_plot as P
from megatron_sparse_rl.observability import metrics as M

COLORS = {"dense": "tab:blue", "naive_sparse": "tab:red", "sparse_rl": "tab:green"}


def _accuracy(ax, summary: dict, labels: dict[str, str]) -> None:
    arms, modes = summary["arms"], summary["eval_modes"]
    for i, arm in enumerate(arms):
        dx = (i - (len(arms) - 1) / 2) * 0.22
        for j, mode in enumerate(modes):
            vals = [r[f"eval_{mode}"] for r in summary["runs"] if r["arm"] == arm and r[f"eval_{mode}"] is not None]
            ax.plot([j + dx] * len(vals), vals, "o", color=COLORS[arm], alpha=0.3, markersize=4)
        stats = [summary["per_arm"][arm][f"eval_{m}"] for m in modes]
        ax.errorbar([j + dx for j in range(len(modes))], [s["mean"] for s in stats],
                    yerr=[s["se"] or 0.0 for s in stats], fmt="s", color=COLORS[arm], capsize=4, label=labels[arm])
    ax.set_xticks(range(len(modes)), [summary["eval_mode_labels"][m] for m in modes], fontsize=8)


def plot(summary: dict, records: dict[str, list[list[dict]]], labels: dict[str, str], window: int,
         out_png: Path) -> Path:
    """`records[arm]`: the metrics records of that arm's runs, one list per seed."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 8.5), dpi=72)
    FigureCanvasAgg(fig)
    ax_r, ax_a, ax_k, ax_j = fig.subplots(2, 2).ravel()
    n = summary["seeds"]
    for arm in summary["arms"]:
        c, recs = COLORS[arm], records[arm]
        collapsed = sum(r["collapsed"] for r in summary["runs"] if r["arm"] == arm)
        P.band(ax_r, recs, (M.REWARD,), window, c, f"{labels[arm]} (collapsed {collapsed}/{n})")
        P.band(ax_k, recs, (M.MISMATCH_K1,), window, c, f"{labels[arm]}: mismatch/k1")
        P.band(ax_k, recs, (S.K1_AFTER,), window, c, f"{labels[arm]}: kv/k1_after_compression", linestyle="--")
        P.band(ax_k, recs, (S.K1_BEFORE,), window, c, f"{labels[arm]}: kv/k1_before_compression", linestyle=":")
        P.band(ax_j, recs, (S.REJECTED_SEQ,), window, c, f"{labels[arm]}: rejected sequences")
        P.band(ax_j, recs, (S.REJECTED_TOKEN,), window, c, f"{labels[arm]}: rejected tokens", linestyle="--")
    _accuracy(ax_a, summary, labels)
    titles = ((ax_r, f"rollout reward (own engine), mean of {window} steps; band: ± s.e. over {n} seed(s)", "RL step"),
              (ax_a, f"held-out accuracy of the final weights: mean ± s.e. over {n} seed(s) (dots: seeds)", None),
              (ax_k, f"k1 = mean(log mu - log pi_old), mean of {window} steps", "RL step"),
              (ax_j, f"Sparse-RL rejection rate, mean of {window} steps", "RL step"))
    P.finish_axes(titles)
    fig.suptitle(summary["title"], fontsize=11)
    fig.tight_layout()
    return P.save_png(fig, out_png)
