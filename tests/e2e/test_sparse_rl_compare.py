"""experiments/sparse_rl_compare.py --quick end to end: 2 seeds x 3 real `msrl train` arms (dense, naive sparse,
Sparse-RL) of 2 steps from each seed's tiny random model, then every final model evaluated by a dense engine and
sparse engines at the training and the tight budget. Checks the files, one row per (seed, arm), the per-arm means
and standard errors against a recomputation here from each run's metrics.jsonl and the evaluation records (json
+ statistics, not the script's helpers), the three evaluation modes (the sparse ones compacted), the in-run final
evaluation equal to the engine-only one of the run's own engine, and that seeds vary the warm start while a
seed's sparse arms share it.

    .venv/bin/python -m pytest -q tests/e2e/test_sparse_rl_compare.py      (about 1.5 min: one process for all)
"""
import json
import statistics
from pathlib import Path

import pytest

from tests.study_checks import mean_se, rl, run_quick, run_records

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ARMS = ("dense", "naive_sparse", "sparse_rl")
MODES = ("dense", "sparse", "tight")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return run_quick("sparse_rl_compare.py", tmp_path_factory.mktemp("compare") / "out", timeout=900)


def test_files_rows_and_progress_lines(run):
    out, summary, stdout = run
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "runs.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # msrl compare's picture of every run
    md = (out / "summary.md").read_text()
    assert "| metric | dense | naive_sparse | sparse_rl |" in md and "## Per run" in md and "Runtime" in md
    assert not list(out.glob("*.tmp"))
    assert summary["seeds"] == 2 and summary["seconds"] > 0
    assert sorted((r["seed"], r["arm"]) for r in summary["runs"]) == sorted((s, a) for s in (0, 1) for a in ARMS)
    for r in summary["runs"]:
        assert r["steps"] == 2 and r["collapsed"] in (0, 1), r
        assert f"| {r['seed']} | {r['arm']} |" in md
        assert (out / "logs" / f"seed{r['seed']}_{r['arm']}.log").is_file()
        assert f"seed{r['seed']}/{r['arm']}: 2 RL steps" in stdout  # one progress line per run, with its time
    assert (out / "logs" / "eval.log").is_file() and stdout.count("    done in ") == 6


def test_per_arm_mean_and_se_equal_a_recomputation_from_the_runs(run):
    out, summary, _ = run
    by_arm = {a: [r for r in summary["runs"] if r["arm"] == a] for a in ARMS}
    for arm, rows in by_arm.items():
        records = [run_records(Path(r["run_dir"])) for r in rows]
        recomputed = {
            "mismatch_k1": [statistics.fmean(rl(recs, "mismatch/k1")) for recs in records],
            "reward_last": [statistics.fmean(rl(recs, "rollout/reward")) for recs in records],  # 2 steps < window
            "eval_own_final": [rl(recs, "eval/accuracy")[-1] for recs in records],
        }
        if arm != "dense":
            recomputed["k1_after_compression"] = [statistics.fmean(rl(recs, "kv/k1_after_compression"))
                                                  for recs in records]
            recomputed["k1_before_compression"] = [statistics.fmean(rl(recs, "kv/k1_before_compression"))
                                                   for recs in records]
        if arm == "sparse_rl":
            recomputed["rejected_seq_frac"] = [statistics.fmean(rl(recs, "sparse_rl/rejected_seq_frac"))
                                               for recs in records]
        for mode in MODES:  # from the evaluation records, one per (seed, arm, mode)
            recomputed[f"eval_{mode}"] = [e["accuracy"] for e in summary["evals"] if e["arm"] == arm
                                          and e["mode"] == mode]
        for key, values in recomputed.items():
            assert len(values) == 2, (arm, key)
            mean, se = mean_se(values)
            got = summary["per_arm"][arm][key]
            assert got["n"] == 2 and got["mean"] == pytest.approx(mean, abs=1e-12), (arm, key)
            assert got["se"] == pytest.approx(se, abs=1e-12), (arm, key)


def test_three_eval_modes_and_the_split_of_the_mismatch(run):
    _, summary, _ = run
    evals = summary["evals"]
    assert len(evals) == 2 * 3 * 3 and {e["mode"] for e in evals} == set(MODES)
    assert summary["kv"]["tight_budget"] < summary["kv"]["budget"]
    for e in evals:
        assert e["samples"] > 0 and 0.0 <= e["accuracy"] <= 1.0, e
        assert (e["compactions"] > 0) == (e["mode"] != "dense"), e  # the sparse engines really compressed
    for r in summary["runs"]:
        assert all(r[f"eval_{m}"] is not None for m in MODES), r
        assert r["drop_tight"] == pytest.approx(r["eval_dense"] - r["eval_tight"])
        sparse = r["arm"] != "dense"
        assert (r["k1_after_compression"] is not None) == sparse and (r["compressed_frac"] is not None) == sparse
        assert (r["rejected_seq_frac"] is not None) == (r["arm"] == "sparse_rl")
    # the in-run final evaluation (trainer, synced weights) = the engine-only one of the same engine from hf_final
    assert summary["checks"]["own_engine_final_vs_engine_only_max_abs_diff"] == 0.0


def test_seeds_vary_the_warm_start_and_a_seed_shares_it(run):
    out, summary, _ = run
    w0, w1 = ((out / f"seed{s}" / "model" / "model.safetensors").read_bytes() for s in (0, 1))
    assert w0 != w1  # model.tiny.seed follows the seed
    rows = {(r["seed"], r["arm"]): r for r in summary["runs"]}
    for s in (0, 1):
        for arm in ARMS:
            assert json.loads((Path(rows[(s, arm)]["run_dir"]) / "run.json").read_text())["model"] == str(
                out / f"seed{s}" / "model")
        # same weights, engine and evaluation seed: the two sparse arms' warm-start evaluations agree
        assert rows[(s, "naive_sparse")]["eval_own_warm_start"] == rows[(s, "sparse_rl")]["eval_own_warm_start"]
    assert rows[(0, "sparse_rl")]["mismatch_k1"] != rows[(1, "sparse_rl")]["mismatch_k1"]
