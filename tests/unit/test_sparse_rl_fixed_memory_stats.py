"""experiments/sparse_rl_fixed_memory.py without running anything: its per-run numbers from synthetic metrics
records (training wall-clock, the accuracy curve, KV saved, budget, rejection) and the wall-clock to reach dense's
final accuracy, each against values worked out by hand here; the per-arm means; the arms' overrides; the shared pool
refused when dense would not queue; summary.md.

    .venv/bin/python -m pytest -q tests/unit/test_sparse_rl_fixed_memory_stats.py
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "experiments"))

import sparse_rl_fixed_memory as F  # noqa: E402
import sparse_rl_fixed_memory_stats as S  # noqa: E402

from megatron_sparse_rl.config import load_config  # noqa: E402


def _records(accs, saved=None, budgets=None, rejected=None, seconds=(1.0, 2.0, 0.5)) -> list[dict]:
    """A run of len(accs) RL steps, each evaluated; every step takes rollout + train + sync = `seconds`."""
    recs = [{"step": 0, "phase": "sync", "time/sync_s": 9.0},            # not an RL step: not on the clock
            {"step": 0, "phase": "warm_start", "eval/accuracy": 0.1}]
    for i, acc in enumerate(accs):
        r = {"step": i + 1, "phase": "rl", "rollout/reward": 0.5, "train/grad_norm": 1.0, "eval/accuracy": acc,
             "time/rollout_s": seconds[0], "time/train_s": seconds[1], "time/sync_s": seconds[2],
             "mismatch/rho_p5": 0.8 + 0.01 * i, "rollout/running_mean": 10.0 + i, "rollout/preemptions": float(i)}
        for key, values in (("kv/saved_frac", saved), ("kv/budget", budgets), ("sparse_rl/rejected_seq_frac", rejected)):
            if values is not None:
                r[key] = values[i]
        recs.append(r)
    return recs


KW = {"window": 2, "drop": 0.5, "blowup": 100.0}


def test_run_metrics_against_a_hand_computation():
    recs = _records([0.2, 0.5, 0.4], saved=[0.3, 0.5, 0.1], budgets=[40.0, 50.0, 45.0], rejected=[0.1, 0.2, 0.3])
    m = S.run_metrics(recs, **KW)
    assert m["eval_curve"] == [[1, 3.5, 0.2], [2, 7.0, 0.5], [3, 10.5, 0.4]]  # 1 + 2 + 0.5 = 3.5 s per step
    assert m["rl_seconds"] == 10.5
    assert m["eval_own_final"] == 0.4 and m["eval_own_warm_start"] == 0.1
    assert m["kv_saved_peak"] == 0.5 and m["kv_saved_mean"] == pytest.approx(0.3)
    assert m["kv_budget_mean"] == pytest.approx(45.0) and m["kv_budget_last"] == 45.0
    assert m["rejected_seq_frac"] == pytest.approx(0.2)
    assert m["rho_p5_mean"] == pytest.approx(0.81)
    assert m["running_mean"] == pytest.approx(11.0) and m["preemptions_mean"] == pytest.approx(1.0)
    dense = S.run_metrics(_records([0.3, 0.6]), **KW)  # logs no KV, budget or rejection: 0, None, 0
    assert (dense["kv_saved_peak"], dense["kv_saved_mean"], dense["kv_budget_last"], dense["rejected_seq_frac"]) == \
        (0.0, 0.0, None, 0.0)


def test_time_to_dense_final_accuracy_against_a_hand_computation():
    rows = []
    for seed, arm, accs, secs in [(0, "dense", [0.3, 0.6], (1.0, 1.0, 0.0)),         # 2 s per step
                                  (1, "dense", [0.5, 0.4], (1.0, 2.0, 1.0)),         # 4 s per step
                                  (0, "sparse_rl", [0.55, 0.45], (0.5, 0.5, 0.0)),    # 1 s per step
                                  (1, "sparse_rl", [0.1, 0.2], (0.5, 0.5, 0.0))]:
        rows.append({"seed": seed, "arm": arm, **S.run_metrics(_records(accs, seconds=secs), **KW)})
    out, target = S.add_time_to_target(rows)
    assert target == pytest.approx(0.5)  # dense's final accuracies 0.6 and 0.4
    got = {(r["seed"], r["arm"]): (r["time_to_target"], r["time_to_target_vs_dense"]) for r in out}
    assert got[(0, "dense")] == (4.0, 1.0)     # 0.6 at step 2
    assert got[(1, "dense")] == (4.0, 1.0)     # 0.5 at step 1 already
    assert got[(0, "sparse_rl")] == (1.0, 0.25)  # 0.55 at step 1: 1 s, vs seed 0 dense's 4 s
    assert got[(1, "sparse_rl")] == (None, None)  # never reaches 0.5
    per_arm = S.aggregate(out, ["dense", "sparse_rl"])
    assert per_arm["sparse_rl"]["time_to_target"] == {"mean": 1.0, "se": None, "n": 1}  # 1 of 2 seeds reached it
    assert per_arm["dense"]["eval_own_final"]["mean"] == pytest.approx(0.5)
    assert S.first_time_at([[1, 2.0, 0.1], [2, 4.0, 0.5]], 0.5) == 4.0   # reaching it counts (>=)


def test_arms_and_their_overrides():
    assert [a for a, _, _ in F.ARMS] == ["dense", "naive_sparse", "sparse_rl", "sparse_rl_sched"]
    runs = {a: load_config(F.CONFIG, list(sets)) for a, _, sets in F.ARMS}
    assert runs["dense"].rollout.kv.policy == "none"
    assert {a: r.algorithm.corrections.sparse_rl.enabled for a, r in runs.items()} == \
        {"dense": False, "naive_sparse": False, "sparse_rl": True, "sparse_rl_sched": True}
    assert {a: r.rollout.kv.budget_schedule.enabled for a, r in runs.items()} == \
        {"dense": False, "naive_sparse": False, "sparse_rl": False, "sparse_rl_sched": True}
    assert len({r.rollout.kv.pool_blocks for r in runs.values()}) == 1  # one shared pool
    assert F.parse_args([]).seeds >= 5


def test_the_pool_must_make_dense_queue():
    run = load_config(F.CONFIG)
    # 16 prompts x 8 samples x cdiv(16 + 88 -> max_model_len 96, 32) = 3 blocks = 384 > 32 usable
    assert F.dense_queues(run) == (384, run.rollout.kv.pool_blocks - 1)
    with pytest.raises(ValueError, match=r"rollout\.kv\.pool_blocks = 400 holds a whole step of dense sequences"):
        F.dense_queues(load_config(F.CONFIG, ["rollout.kv.pool_blocks=400"]))
    with pytest.raises(ValueError, match="fixed rollout.kv.pool_blocks"):
        F.dense_queues(load_config(F.CONFIG, ["rollout.kv.pool_blocks=null"]))


def test_summary_markdown_has_the_target_and_every_arm():
    rows = [{"seed": 0, "arm": a, "steps": 2, **S.run_metrics(_records([0.3, 0.6]), **KW)} for a, _, _ in F.ARMS]
    rows = [S.add_eval(r, {"dense": 0.7, "sparse": 0.2}) for r in rows]
    rows, target = S.add_time_to_target(rows)
    args = argparse.Namespace(config=F.CONFIG, seeds=1, steps=2, sft_steps=0, sft_target=0.0, window=2, overrides=[],
                              collapse_drop=0.15, grad_blowup=10.0)
    summary = F.summarize(args, load_config(F.CONFIG), (384, 32), rows, target, [], {},
                          {"warm_start": 0.0, "rl": 1.0, "eval": 0.0})
    summary.update(plot="x.png", seconds=1.0)
    md = S.render_markdown(summary)
    assert "| metric | dense | naive_sparse | sparse_rl | sparse_rl_sched |" in md
    assert "= 0.600; runs that reached it: dense 1/1" in md and "| held-out acc., dense engine | 0.700 |" in md
