"""experiments/sparse_rl_compare.py without running anything: mean and standard error against hand-computed values,
the smoothing, drawdown and collapse rule on hand-built series, per-run numbers from synthetic metrics records,
paired differences and bands, summary.md, the tight evaluation budget against the config's KV rules, the
per-seed overrides, and bad command lines refused before any run starts.

    .venv/bin/python -m pytest -q tests/unit/test_sparse_rl_compare_stats.py
"""
from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "experiments"))

import sparse_rl_compare as C  # noqa: E402
import sparse_rl_compare_stats as S  # noqa: E402
import study_stats as T  # noqa: E402  (the statistics shared with experiments/routing_stability.py)

from megatron_sparse_rl.config import load_config  # noqa: E402
from megatron_sparse_rl.config.rollout import KVConfig  # noqa: E402


def test_mean_se_is_the_sample_mean_and_stdev_over_sqrt_n():
    got = T.mean_se([1.0, 2.0, 4.0, None])  # None: a run without the metric, skipped
    mean = 7 / 3
    se = math.sqrt(((1 - mean) ** 2 + (2 - mean) ** 2 + (4 - mean) ** 2) / 2) / math.sqrt(3)
    assert got["n"] == 3 and got["mean"] == pytest.approx(mean, rel=1e-15) and got["se"] == pytest.approx(se, rel=1e-15)
    assert T.mean_se([0.25]) == {"mean": 0.25, "se": None, "n": 1}
    assert T.mean_se([None]) == {"mean": None, "se": None, "n": 0}


def test_trailing_mean_and_max_drawdown():
    assert T.trailing_mean([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert T.trailing_mean([1.0, 2.0, 3.0, 4.0], 2, full=True) == [1.5, 2.5, 3.5]
    assert T.trailing_mean([1.0, 3.0], 10, full=True) == [2.0]  # shorter than the window: one mean of all
    assert T.max_drawdown([0.1, 0.5, 0.3, 0.6, 0.2]) == pytest.approx(0.4)
    assert T.max_drawdown([0.1, 0.2, 0.3]) == 0.0 and T.max_drawdown([]) == 0.0


def test_collapse_rule():
    kw = {"window": 2, "drop": 0.15, "blowup": 10.0}
    fell = T.collapse_reasons([0.5] * 5 + [0.1] * 5, [1.0] * 10, 0, **kw)
    assert len(fell) == 1 and fell[0].startswith("reward mean of 2 steps fell 0.400")
    assert T.collapse_reasons([0.5, 0.5, 0.3, 0.5, 0.5], [1.0] * 5, 0, **kw) == []  # one-step dip: mean falls 0.1
    assert "20.0x its median" in T.collapse_reasons([0.5] * 5, [1.0, 1.0, 1.0, 1.0, 20.0], 0, **kw)[0]
    assert T.collapse_reasons([0.5] * 5, [1.0, 1.0, 1.0, 1.0, 9.0], 0, **kw) == []
    assert T.collapse_reasons([0.5] * 5, [0.0] * 5, 0, **kw) == []  # zero gradients (all-equal rewards): no ratio
    assert "1 non-finite" in T.collapse_reasons([0.5] * 5, [1.0] * 5, 1, **kw)[0]


def _records() -> list[dict]:
    recs = [{"step": 0, "phase": "sync", "time/sync_s": 0.1},
            {"step": 0, "phase": "warm_start", "eval/accuracy": 0.2}]
    for step, (reward, grad, rej) in enumerate([(0.4, 1.0, 0.1), (0.6, 2.0, 0.3), (0.2, float("nan"), 0.2)], 1):
        recs.append({"step": step, "phase": "rl", "rollout/reward": reward, "train/grad_norm": grad,
                     "sparse_rl/rejected_seq_frac": rej, "mismatch/k1": 0.1 * step,
                     "kv/k1_before_compression": 0.0, "kv/k1_after_compression": 0.5})
    recs[-1]["eval/accuracy"] = 0.3
    return recs


def test_run_metrics_from_records():
    row = S.run_metrics(_records(), window=2, drop=0.15, blowup=10.0)
    assert row["steps"] == 3 and row["eval_own_warm_start"] == 0.2 and row["eval_own_final"] == 0.3
    assert row["reward_first"] == pytest.approx(0.5) and row["reward_last"] == pytest.approx(0.4)
    assert row["reward_max_drawdown"] == pytest.approx(0.1)  # 2-step means 0.5, 0.4
    assert row["rejected_seq_frac"] == pytest.approx(0.2) and row["mismatch_k1"] == pytest.approx(0.2)
    assert row["k1_after_compression"] == 0.5 and row["compressed_frac"] is None and row["rejected_token_frac"] is None
    assert row["grad_norm_median"] == 1.5 and row["grad_norm_max_over_median"] == pytest.approx(2 / 1.5)
    assert row["collapsed"] == 1 and "non-finite" in row["collapse_reasons"][0]  # the NaN grad norm


def _rows() -> list[dict]:
    acc = {("dense", 0): (0.5, 0.4, 0.3), ("dense", 1): (0.6, 0.5, 0.2),
           ("sparse_rl", 0): (0.4, 0.4, 0.35), ("sparse_rl", 1): (0.45, 0.45, 0.4)}
    rows = []
    for (arm, seed), (d, s, t) in acc.items():
        row = {"seed": seed, "arm": arm, "collapsed": int(arm == "dense" and seed == 1), "collapse_reasons": []}
        rows.append(S.add_eval(row, {"dense": d, "sparse": s, "tight": t}))
    return rows


def test_add_eval_aggregate_and_paired_differences():
    rows = _rows()
    assert rows[0]["drop_sparse"] == pytest.approx(0.1) and rows[0]["drop_tight"] == pytest.approx(0.2)
    agg = S.aggregate(rows, ["dense", "sparse_rl"])
    assert agg["dense"]["eval_tight"]["mean"] == pytest.approx(0.25)
    assert agg["dense"]["eval_tight"]["se"] == pytest.approx(0.05)  # |0.3 - 0.2| / 2
    assert agg["dense"]["collapsed"]["mean"] == 0.5
    pair = T.paired(rows, [("sparse_rl", "dense")], ["eval_tight", "drop_tight"])["sparse_rl - dense"]
    # per-seed differences: tight 0.05 and 0.2; drop (dense - tight): 0.05 - 0.2 = -0.15 and 0.05 - 0.4 = -0.35
    assert pair["eval_tight"]["mean"] == pytest.approx(0.125) and pair["eval_tight"]["se"] == pytest.approx(0.075)
    assert pair["drop_tight"]["mean"] == pytest.approx(-0.25) and pair["drop_tight"]["se"] == pytest.approx(0.1)


def test_band_over_the_shared_steps():
    mean, se = T.band([[1.0, 2.0, 3.0], [3.0, 4.0]])
    assert mean == [2.0, 3.0] and se == [pytest.approx(1.0), pytest.approx(1.0)]
    assert T.band([[1.0, 2.0]]) == ([1.0, 2.0], [None, None])


def test_summary_markdown_and_atomic_write(tmp_path):
    rows = _rows()
    summary = {"arms": ["dense", "sparse_rl"], "seeds": 2, "window": 7, "setup": "setup line", "seconds": 12.0,
               "runtime": "RL runs 10 s", "per_arm": S.aggregate(rows, ["dense", "sparse_rl"]),
               "paired": T.paired(rows, [("sparse_rl", "dense")], ["eval_tight"]), "runs": rows,
               "collapse_rule": "rule", "plot": "compare.png"}
    rows[3]["collapse_reasons"] = ["reward fell"]
    md = S.render_markdown(summary)
    assert "| held-out acc., sparse engine, tight budget | 0.250 ± 0.050 | 0.375 ± 0.025 |" in md
    assert "| collapsed (1) or not (0) | 1/2 | 0/2 |" in md and "mean of the first 7 steps" in md
    assert "| 1 | sparse_rl | 0.450 |" in md and "- seed 1 sparse_rl: reward fell" in md
    path = T.write_atomic(tmp_path / "summary.md", md)
    assert path.read_text() == md and [p.name for p in tmp_path.iterdir()] == ["summary.md"]


@pytest.mark.parametrize("kv, want", [
    (dict(policy="rkv", budget=4, window=2, interval=2), 2),  # configs/sparse_rl_compare.yaml
    (dict(policy="rkv", budget=32, window=8, interval=8), 16),  # configs/sparse_rl_scratchpad.yaml
    (dict(policy="snapkv", budget=8, window=6), 6),  # half is below the window: raised to it
    (dict(policy="streamingllm", budget=8, window=2, sinks=4), 6),  # streamingllm: the sinks and the window
])
def test_default_tight_budget_is_half_raised_to_the_config_rules(kv, want):
    assert C.tight_budget(KVConfig(**kv), None) == want


def test_tight_budget_errors():
    kv = KVConfig(policy="rkv", budget=4, window=2, interval=2)
    with pytest.raises(ValueError, match="must be below the training budget rollout.kv.budget=4"):
        C.tight_budget(kv, 4)
    with pytest.raises(ValueError, match=r"--tight-budget 1: rollout.kv.budget must be >= window \(got 1 < 2\)"):
        C.tight_budget(kv, 1)
    with pytest.raises(ValueError, match="no budget below rollout.kv.budget=4 is valid"):
        C.tight_budget(dataclasses.replace(kv, window=4), None)


def test_plan_seeds_and_arm_overrides(tmp_path):
    args = C.parse_args(["--seeds", "2", "--sft-steps", "5", "--out", str(tmp_path),
                         "--set", "rollout.kv.policy=snapkv", "rollout.seed=7"])
    base = load_config(C.CONFIG, args.overrides)
    jobs = C.plan(args, base)
    assert [j.name for j in jobs[1]] == ["seed1/warm_start", "seed1/dense", "seed1/naive_sparse", "seed1/sparse_rl"]
    runs = {j.arm: load_config(C.CONFIG, j.sets) for j in jobs[1]}
    for run in runs.values():  # seed 1: every seed field moved by one from the config (rollout.seed from --set)
        assert (run.rollout.seed, run.data.seed, run.learner.seed, run.model.tiny.seed) == (8, 1, 1235, 1)
        assert run.data.arithmetic.seed == base.data.arithmetic.seed  # the same held-out problems
    assert runs["warm_start"].model.path == str(tmp_path / "seed1" / "model")
    assert runs["warm_start"].trainer.sft.max_steps == 5 and runs["warm_start"].rollout.kv.policy == "none"
    assert runs["warm_start"].trainer.sft.target_accuracy == 0.0  # all --sft-steps unless --sft-target
    args = C.parse_args(["--seeds", "2", "--sft-steps", "5", "--sft-target", "0.6", "--out", str(tmp_path)])
    warm = load_config(C.CONFIG, C.plan(args, load_config(C.CONFIG))[0][0].sets)
    assert (warm.trainer.sft.max_steps, warm.trainer.sft.target_accuracy) == (5, 0.6)
    # --sft-kv-keep: the warm start keeps the config's sparse engine and trains under its keep sets; the arms as before
    args = C.parse_args(["--seeds", "1", "--sft-steps", "5", "--sft-kv-keep", "--out", str(tmp_path)])
    kv_jobs = C.plan(args, load_config(C.CONFIG))[0]
    warm = load_config(C.CONFIG, kv_jobs[0].sets)
    assert warm.trainer.sft.kv_keep.enabled and warm.rollout.kv.policy == load_config(C.CONFIG).rollout.kv.policy != "none"
    assert [load_config(C.CONFIG, j.sets).rollout.kv.policy for j in kv_jobs[1:2]] == ["none"]  # dense stays dense
    for arm in ("dense", "naive_sparse", "sparse_rl"):
        assert runs[arm].model.path == str(tmp_path / "seed1" / "warm_start" / "hf_final")
        assert runs[arm].trainer.sft.max_steps == 0 and runs[arm].trainer.steps == 100
    # the arms' own settings win over --set: dense stays dense, the sparse arms take the user's policy
    assert runs["dense"].rollout.kv.policy == "none" and runs["sparse_rl"].rollout.kv.policy == "snapkv"
    assert not runs["naive_sparse"].algorithm.corrections.sparse_rl.enabled
    assert runs["sparse_rl"].algorithm.corrections.sparse_rl.enabled


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "0"], "--seeds must be >= 1 (got 0)"),
    (["--steps", "0"], "--steps must be >= 1 (got 0)"),
    (["--sft-target", "1.5"], "--sft-target must be in [0, 1] (got 1.5)"),
    (["--tight-budget", "4"], "--tight-budget 4 must be below the training budget"),
    (["--tight-budget", "1"], "rollout.kv.budget must be >= window (got 1 < 2)"),
    (["--set", "rollout.kv.policy=none"], "the sparse arms need a sparse rollout.kv.policy"),
    (["--set", "trainer.stepz=3"], "trainer.stepz"),
])
def test_bad_command_lines_fail_before_any_run(tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        C.main(["--out", str(out), *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not out.exists()
