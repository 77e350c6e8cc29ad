"""experiments/sparse_rl_fixed_memory.py --quick end to end: 2 seeds x 4 real `msrl train` arms (dense, naive sparse,
Sparse-RL, Sparse-RL + budget schedule) of 2 steps from each seed's tiny random model on one fixed KV pool, then
every final model evaluated by a dense and a sparse engine. Checks the files, one row per (seed, arm), the per-arm
statistics recomputed here from each run's metrics.jsonl (json + arithmetic, not the script's helpers): mean and
standard error of the held-out accuracies, KV saved (peak and mean), rejection rate and training wall-clock, and the
time to reach dense's final accuracy; that every arm ran on the shared pool with the dense arm queueing, and that
the schedule arm logged its budgets by the rule.

    .venv/bin/python -m pytest -q tests/e2e/test_sparse_rl_fixed_memory.py      (about 3-4 min on a busy 2-core machine)
"""
import math
import statistics
from pathlib import Path

import pytest

from tests.study_checks import mean_se, rl, run_quick, run_records

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ARMS = ("dense", "naive_sparse", "sparse_rl", "sparse_rl_sched")


def _clock(records: list[dict]) -> list[float]:
    """Cumulative rollout + train + sync seconds after each RL step."""
    out, total = [], 0.0
    for r in records:
        if r["phase"] == "rl":
            total += r["time/rollout_s"] + r["time/train_s"] + r["time/sync_s"]
            out.append(total)
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return run_quick("sparse_rl_fixed_memory.py", tmp_path_factory.mktemp("fixed_memory") / "out", timeout=1200)


def test_files_rows_and_statistics(run):
    out, summary, stdout = run
    assert (out / "fixed_memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "runs.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # msrl compare's picture of every run
    md = (out / "summary.md").read_text()
    assert "| metric | dense | naive_sparse | sparse_rl | sparse_rl_sched |" in md and "## Per run" in md
    assert sorted((r["seed"], r["arm"]) for r in summary["runs"]) == sorted((s, a) for s in (0, 1) for a in ARMS)
    assert stdout.count("    done in ") == 8
    records = {(r["seed"], r["arm"]): run_records(Path(r["run_dir"])) for r in summary["runs"]}
    finals = {k: rl(recs, "eval/accuracy")[-1] for k, recs in records.items()}
    target = statistics.fmean(finals[(s, "dense")] for s in (0, 1))
    assert summary["target_accuracy"] == pytest.approx(target, abs=1e-12)
    for arm in ARMS:
        recs = [records[(s, arm)] for s in (0, 1)]
        saved = [rl(r, "kv/saved_frac") or [0.0] for r in recs]
        recomputed = {
            "eval_dense": [e["accuracy"] for e in summary["evals"] if e["arm"] == arm and e["mode"] == "dense"],
            "eval_sparse": [e["accuracy"] for e in summary["evals"] if e["arm"] == arm and e["mode"] == "sparse"],
            "eval_own_final": [finals[(s, arm)] for s in (0, 1)],
            "kv_saved_peak": [max(x) for x in saved],
            "kv_saved_mean": [statistics.fmean(x) for x in saved],
            "rejected_seq_frac": [statistics.fmean(rl(r, "sparse_rl/rejected_seq_frac") or [0.0]) for r in recs],
            "rl_seconds": [_clock(r)[-1] for r in recs],
        }
        for key, values in recomputed.items():
            mean, se = mean_se(values)
            got = summary["per_arm"][arm][key]
            assert got["n"] == 2 and got["mean"] == pytest.approx(mean, abs=1e-9), (arm, key)
            assert got["se"] == pytest.approx(se, abs=1e-9), (arm, key)
        for s, r in zip((0, 1), recs):
            row = next(x for x in summary["runs"] if (x["seed"], x["arm"]) == (s, arm))
            accs, clock = rl(r, "eval/accuracy"), _clock(r)
            want = next((t for a, t in zip(accs, clock) if a >= target), None)
            assert row["time_to_target"] == (None if want is None else pytest.approx(want, abs=1e-9)), (s, arm)
        if arm == "dense":
            assert all(x == [0.0] for x in saved)
        else:
            assert all(0.0 < v <= 1.0 for x in saved for v in x), arm  # the sparse engines compressed


def test_shared_pool_dense_queues_and_the_schedule_moves_by_its_rule(run):
    _, summary, _ = run
    pool = summary["pool"]
    assert pool["usable"] < pool["dense_step_need"]
    sched = summary["kv"]["schedule"]
    for r in summary["runs"]:
        recs = run_records(Path(r["run_dir"]))
        assert {x["rollout/kv_pool_blocks"] for x in recs if x["phase"] == "rl"} == {pool["usable"]}, r["arm"]
        if r["arm"] != "sparse_rl_sched":
            assert set(rl(recs, "kv/budget")) <= {float(summary["kv"]["budget"])}
            continue
        budgets, p5s = rl(recs, "kv/budget"), rl(recs, "mismatch/rho_p5")
        assert budgets[0] == summary["kv"]["budget"]
        for b, p5, nxt in zip(budgets, p5s, budgets[1:]):  # the rule, recomputed
            want = math.ceil(b * sched["step_up"]) if p5 < sched["target_p5"] else (
                math.floor(b * sched["step_down"]) if p5 > sched["target_p5"] + sched["margin"] else b)
            assert nxt == min(max(want, sched["min_budget"]), sched["max_budget"])
