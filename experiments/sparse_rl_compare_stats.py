"""Statistics of experiments/sparse_rl_compare.py: per-run numbers from a run's metrics records, the engine-only
evaluations, per-arm means and summary.md. The generic pieces (mean and standard error, the collapse rule, paired
differences, bands, markdown tables, atomic writes) are experiments/study_stats.py's. Pure Python (no torch, no
vLLM); tested in tests/unit/test_sparse_rl_compare_stats.py.

Collapse (per run): study_stats.py's rule with this study's --window, --collapse-drop and --grad-blowup: the
trailing mean of `rollout/reward` over `window` steps (full windows only) falls more than `drop` below its best
earlier value, or some step's `train/grad_norm` exceeds `blowup` times the run's median, or a step logged NaN or
inf for `rollout/reward`, `train/grad_norm` or `loss/value`.
"""
from __future__ import annotations

import study_stats as T
from megatron_sparse_rl.observability import metrics as M
from megatron_sparse_rl.observability.plot import series

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


def run_metrics(records: list[dict], *, window: int, drop: float, blowup: float) -> dict:
    """The per-run numbers of one training run's metrics records (read_metrics), except the engine-only
    evaluations, which the caller adds (eval_dense, eval_sparse, eval_tight, drop_*)."""
    own = series(records, (M.EVAL_ACCURACY,))[1]
    warm = series(records, (M.EVAL_ACCURACY,), "warm_start")[1]
    return {
        "eval_own_warm_start": warm[-1] if warm else None,
        "eval_own_final": own[-1] if own else None,
        "rejected_seq_frac": T.mean(series(records, (REJECTED_SEQ,))[1]),
        "rejected_token_frac": T.mean(series(records, (REJECTED_TOKEN,))[1]),
        "k1_before_compression": T.mean(series(records, (K1_BEFORE,))[1]),
        "k1_after_compression": T.mean(series(records, (K1_AFTER,))[1]),
        "mismatch_k1": T.mean(series(records, (M.MISMATCH_K1,))[1]),
        "compressed_frac": T.mean(series(records, (COMPRESSED,))[1]),
        **T.run_basics(records, window=window, drop=drop, blowup=blowup),
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
    return T.aggregate(rows, arms, [k for k, _ in METRICS])


def render_markdown(summary: dict) -> str:
    """summary.md: setup, runtime, per-arm mean ± s.e., paired differences, per-run rows, collapse rule."""
    out = ["# Dense vs naive sparse vs Sparse-RL", "", summary["setup"], "",
           f"Runtime {summary['seconds']:.0f} s in all ({summary['runtime']}).", "",
           *T.summary_sections(summary, METRICS)]
    return "\n".join(out)
