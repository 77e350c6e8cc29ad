"""experiments/routing_stability.py without running anything: per-run numbers, per-arm mean ± s.e., paired
differences and per-step curves recomputed from metrics.jsonl files written here (expected values by hand), the
collapse rule and its step on hand-made curves, the rule written word for word in docs/routing_stability.md, every
arm's overrides loading and validating with the meaning the docs give them, the arm selection, the plan of runs and
bad command lines refused before any run starts.

    .venv/bin/python -m pytest -q tests/unit/test_routing_stability_stats.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "experiments"))

import routing_stability as RS  # noqa: E402
import routing_stability_stats as S  # noqa: E402
import study_stats as T  # noqa: E402

from megatron_sparse_rl.config import load_config  # noqa: E402
from megatron_sparse_rl.validation import validate  # noqa: E402
from megatron_sparse_rl.observability.metrics import read_metrics  # noqa: E402


def _write(path: Path, records: list[dict]) -> list[dict]:
    """A metrics.jsonl as the trainer writes it (a non-finite value: null, named under "nonfinite"), read back."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"time": 0.0, **r}) + "\n" for r in records))
    return read_metrics(path)


def _rl(step: int, **metrics) -> dict:
    return {"step": step, "phase": "rl", **metrics}


def test_run_metrics_from_a_metrics_file(tmp_path):
    recs = _write(tmp_path / "metrics.jsonl", [
        {"step": 0, "phase": "sync", "sync/probe_max_abs_diff": 0.3},
        {"step": 0, "phase": "warm_start", "eval/accuracy": 0.1},
        _rl(1, **{"rollout/reward": 0.2, "train/grad_norm": 1.0, "mismatch/k1": 0.01, "mismatch/k3": 0.002,
                  "routing/flip_rate_mean": 0.1, "routing/flipped_token_fraction": 0.3, "mismatch/routing_share": 0.5,
                  "loss/entropy": 1.5, "loss/clip_frac_low": 0.01, "loss/clip_frac_high": 0.02,
                  "routing/drift_mean": 0.0, "routing/drift/layer0": 0.9}),
        _rl(2, **{"rollout/reward": 0.4, "train/grad_norm": 2.0, "mismatch/k1": 0.03, "mismatch/k3": 0.004,
                  "routing/flip_rate_mean": 0.2, "routing/flipped_token_fraction": 0.5, "mismatch/routing_share": 0.7,
                  "loss/entropy": 1.3, "loss/clip_frac_low": 0.03, "loss/clip_frac_high": 0.0,
                  "routing/drift_mean": 0.1, "routing/drift/layer0": 0.9, "eval/accuracy": 0.30}),
        _rl(3, **{"rollout/reward": 0.3, "train/grad_norm": 4.0, "mismatch/k1": 0.02, "mismatch/k3": 0.006,
                  "routing/flip_rate_mean": 0.3, "routing/flipped_token_fraction": 0.4, "mismatch/routing_share": 0.6,
                  "loss/entropy": 1.1, "loss/clip_frac_low": 0.0, "loss/clip_frac_high": 0.04,
                  "routing/drift_mean": 0.2, "routing/drift/layer0": 0.9, "eval/accuracy": 0.25}),
    ])
    row = S.run_metrics(recs)
    want = {"steps": 3, "eval_warm_start": 0.1, "eval_final": 0.25, "eval_peak": 0.30,
            "reward_first": 0.3, "reward_last": 0.3,  # 3 steps < the 10-step window: the mean of all three
            "reward_max_drawdown": 0.0, "k1_mean": 0.02, "k3_mean": 0.004, "routing_share_mean": 0.6,
            "flip_rate_mean": 0.2, "flipped_tokens_mean": 0.4, "drift_mean": 0.1,  # not the per-layer 0.9
            "entropy_mean": 1.3, "entropy_last": 1.1, "clip_frac_mean": 0.1 / 3,  # low + high per step
            "grad_norm_median": 2.0, "grad_norm_max_over_median": 2.0}
    for key, value in want.items():
        assert row[key] == pytest.approx(value, abs=1e-12), key
    assert row["drift_key"] == "routing/drift_mean"
    assert (row["collapsed"], row["collapse_step"], row["collapse_reasons"]) == (0, None, [])


def test_drift_absent_leaves_the_column_empty_and_other_drift_names_are_read(tmp_path):
    base = [_rl(1, **{"rollout/reward": 0.2, "train/grad_norm": 1.0})]
    recs = _write(tmp_path / "a.jsonl", base)
    assert S.run_metrics(recs)["drift_mean"] is None and "drift" not in S.arm_curves([recs])
    recs = _write(tmp_path / "b.jsonl", [dict(base[0], **{"routing/drift/layer0": 0.5, "routing/drift_x": 0.25})])
    assert S.run_metrics(recs)["drift_mean"] == 0.25 and S.run_metrics(recs)["drift_key"] == "routing/drift_x"


def test_a_non_finite_loss_collapses_at_its_step(tmp_path):
    recs = _write(tmp_path / "metrics.jsonl", [
        _rl(1, **{"rollout/reward": 0.2, "train/grad_norm": 1.0, "loss/value": 0.1}),
        _rl(2, **{"rollout/reward": 0.2, "train/grad_norm": 1.0, "loss/value": None, "nonfinite": {"loss/value": "nan"}}),
    ])
    row = S.run_metrics(recs)
    assert (row["collapsed"], row["collapse_step"]) == (1, 2)
    assert row["collapse_reasons"] == ["1 non-finite value(s) of rollout/reward, train/grad_norm or loss/value"]


def _curves(rewards: list[float], grads: list[float]) -> list[dict]:
    return [_rl(i + 1, **{"rollout/reward": r, "train/grad_norm": g}) for i, (r, g) in enumerate(zip(rewards, grads))]


def test_collapse_rule_and_its_step_on_hand_made_curves(tmp_path):
    assert (S.WINDOW, S.DROP) == (10, 0.15)
    # reward 0.5 for steps 1-15, then 0.1: the 10-step means end 0.46, 0.42, 0.38, 0.34 at steps 16..19; 0.5 - 0.34
    # = 0.16 > 0.15 first at step 19
    recs = _write(tmp_path / "a.jsonl", _curves([0.5] * 15 + [0.1] * 15, [1.0] * 30))
    row = S.run_metrics(recs)
    assert (row["collapsed"], row["collapse_step"]) == (1, 19)
    assert row["collapse_reasons"] == ["reward mean of 10 steps fell 0.400 below its best (> 0.15)"]
    # a grad-norm spike alone is no collapse, but it is reported: 11 at step 25, median 1
    recs = _write(tmp_path / "b.jsonl", _curves([0.5] * 30, [1.0] * 24 + [11.0] + [1.0] * 5))
    row = S.run_metrics(recs)
    assert (row["collapsed"], row["collapse_step"], row["grad_norm_max_over_median"]) == (0, None, 11.0)
    # a one-step dip to 0 moves a 10-step mean by 0.05: no collapse; a slow fall of 0.16 over 20 steps is one
    recs = _write(tmp_path / "c.jsonl", _curves([0.5] * 11 + [0.0] + [0.5] * 18, [1.0] * 30))
    assert S.run_metrics(recs)["collapsed"] == 0 and S.run_metrics(recs)["collapse_step"] is None
    slow = [0.5] * 10 + [0.5 - 0.01 * i for i in range(1, 21)]  # 0.49, 0.48, ..., 0.30 at steps 11..30
    recs = _write(tmp_path / "d.jsonl", _curves(slow, [1.0] * 30))
    # the mean ending at step 10 + k is 0.5 - 0.01 (1 + ... + k) / 10 for k <= 10 (0.445 at step 20), then
    # 0.5 - 0.01 (k - 4.5): step 29 0.355 (fall 0.145), step 30 0.345 (fall 0.155 > 0.15)
    assert S.run_metrics(recs)["collapse_step"] == 30


def test_the_collapse_rule_is_written_once_in_the_docs():
    doc = " ".join((REPO / "docs" / "routing_stability.md").read_text().split())
    assert S.COLLAPSE_RULE in doc


# (seed, arm): held-out evaluations at steps 1 and 2, rewards, k3 and flip rates of steps 1 and 2; warm start 0.1
RUNS = {
    (0, "minirl"): ([0.35, 0.30], [0.2, 0.4], [0.01, 0.03], [0.1, 0.3]),
    (1, "minirl"): ([0.10, 0.20], [0.1, 0.3], [0.02, 0.02], [0.2, 0.4]),
    (0, "minirl_r3"): ([0.40, 0.40], [0.3, 0.5], [0.00, 0.01], [0.05, 0.05]),
    (1, "minirl_r3"): ([0.30, 0.25], [0.2, 0.2], [0.01, 0.01], [0.1, 0.1]),
}


@pytest.fixture
def study(tmp_path):
    rows, records = [], {}
    for (seed, arm), (evals, rewards, k3, flips) in RUNS.items():
        recs = [{"step": 0, "phase": "warm_start", "eval/accuracy": 0.1}]
        recs += [_rl(i + 1, **{"eval/accuracy": e, "rollout/reward": r, "mismatch/k3": k, "routing/flip_rate_mean": f,
                               "train/grad_norm": 1.0}) for i, (e, r, k, f) in enumerate(zip(evals, rewards, k3, flips))]
        recs = _write(tmp_path / f"seed{seed}" / arm / "metrics.jsonl", recs)
        rows.append({"seed": seed, "arm": arm, **S.run_metrics(recs)})
        records.setdefault(arm, []).append(recs)
    return rows, records


def _stat(mean: float, se: float) -> dict:
    return {"mean": pytest.approx(mean, abs=1e-12), "se": pytest.approx(se, abs=1e-12), "n": 2}


def test_per_arm_mean_se_paired_differences_and_curves(study):
    rows, records = study
    arms = S.per_arm(rows, ["minirl", "minirl_r3"])
    # two seeds: se = |a - b| / 2
    assert arms["minirl"]["eval_final"] == _stat(0.25, 0.05) and arms["minirl"]["eval_peak"] == _stat(0.275, 0.075)
    assert arms["minirl_r3"]["eval_final"] == _stat(0.325, 0.075) and arms["minirl_r3"]["eval_peak"] == _stat(0.35, 0.05)
    assert arms["minirl"]["k3_mean"] == _stat(0.02, 0.0) and arms["minirl"]["flip_rate_mean"] == _stat(0.25, 0.05)
    assert arms["minirl"]["collapsed"] == _stat(0.0, 0.0) and arms["minirl"]["collapse_step"]["n"] == 0
    pair = T.paired(rows, RS.pairs(RS.select(["minirl", "minirl_r3"])), S.PAIRED_KEYS)
    assert list(pair) == ["minirl_r3 - minirl"]
    # per seed: final 0.40 - 0.30 = 0.10, 0.25 - 0.20 = 0.05; peak 0.40 - 0.35 = 0.05, 0.30 - 0.20 = 0.10
    assert pair["minirl_r3 - minirl"]["eval_final"] == _stat(0.075, 0.025)
    assert pair["minirl_r3 - minirl"]["eval_peak"] == _stat(0.075, 0.025)
    # k3 per run 0.005 and 0.01 against 0.02 and 0.02: differences -0.015 and -0.01
    assert pair["minirl_r3 - minirl"]["k3_mean"] == _stat(-0.0125, 0.0025)
    curves = S.arm_curves(records["minirl"])
    assert curves["heldout"]["steps"] == [0, 1, 2] and curves["heldout"]["mean"] == pytest.approx([0.1, 0.225, 0.25])
    assert curves["heldout"]["se"] == pytest.approx([0.0, 0.125, 0.05])
    assert curves["reward"]["steps"] == [1, 2] and curves["reward"]["mean"] == pytest.approx([0.15, 0.35])
    assert curves["reward"]["se"] == pytest.approx([0.05, 0.05]) and "entropy" not in curves


def test_summary_markdown(study, tmp_path):
    rows, _ = study
    summary = {"labels": {"minirl": "MiniRL", "minirl_r3": "MiniRL + R3"}, "seeds": 2, "setup": "setup line",
               "seconds": 12.0, "runtime": "RL runs 10 s", "groups": {"on_policy": ["minirl", "minirl_r3"]},
               "per_arm": S.per_arm(rows, ["minirl", "minirl_r3"]), "runs": rows, "collapse_rule": S.COLLAPSE_RULE,
               "paired": T.paired(rows, [("minirl_r3", "minirl")], S.PAIRED_KEYS), "plots": {"on_policy": "x.png"}}
    md = S.render_markdown(summary)
    assert "| minirl (MiniRL) | 0.250 ± 0.050 | 0.275 ± 0.075 | 0/2 | - |" in md
    assert "| minirl_r3 - minirl | 0.075 ± 0.025 | 0.075 ± 0.025 | 0.000 ± 0.000 |" in md
    assert "No run collapsed." in md and "Plots: x.png" in md


# arm -> (loss, updates per rollout, (clip_low, clip_high), routing mode, TIS on, TIS ratio, aggregation): the
# meaning docs/routing_stability.md gives each arm, written out here by hand
TOKEN_SUM, TOKEN_MEAN, MINIRL_CLIP, NONE = "seq_mean_token_sum", "seq_mean_token_mean", (0.2, 0.27), (1.0, 1.0e9)
EXPECTED = {
    "minirl": ("grpo", 1, MINIRL_CLIP, "off", True, "pi_theta", TOKEN_SUM),
    "minirl_r3": ("grpo", 1, MINIRL_CLIP, "R3", True, "pi_theta", TOKEN_SUM),
    "no_is": ("grpo", 1, MINIRL_CLIP, "off", False, "pi_theta", TOKEN_SUM),
    "no_is_r3": ("grpo", 1, MINIRL_CLIP, "R3", False, "pi_theta", TOKEN_SUM),
    "length_norm": ("grpo", 1, MINIRL_CLIP, "off", True, "pi_theta", TOKEN_MEAN),
    "length_norm_r3": ("grpo", 1, MINIRL_CLIP, "R3", True, "pi_theta", TOKEN_MEAN),
    **{arm: v for n in (2, 4, 8) for arm, v in {
        f"n{n}_noclip": ("grpo", n, NONE, "off", True, "pi_theta", TOKEN_SUM),
        f"n{n}_r2_noclip": ("grpo", n, NONE, "R2", True, "pi_theta", TOKEN_SUM),
        f"n{n}_r2": ("grpo", n, MINIRL_CLIP, "R2", True, "pi_theta", TOKEN_SUM),
        f"n{n}_r3": ("grpo", n, MINIRL_CLIP, "R3", True, "pi_theta", TOKEN_SUM)}.items()},
    "grpo": ("grpo", 4, MINIRL_CLIP, "off", True, "pi_old", TOKEN_MEAN),
    "grpo_r3": ("grpo", 4, MINIRL_CLIP, "R3", True, "pi_old", TOKEN_MEAN),
    "gspo": ("gspo", 4, (3e-4, 4e-4), "off", True, "pi_old", TOKEN_MEAN),
    "gspo_r3": ("gspo", 4, (3e-4, 4e-4), "R3", True, "pi_old", TOKEN_MEAN),
}


@pytest.mark.parametrize("arm", RS.ARMS, ids=[a.name for a in RS.ARMS])
def test_every_arm_loads_validates_and_means_what_the_docs_say(arm, monkeypatch):
    monkeypatch.chdir(REPO)
    run = load_config(RS.CONFIG, list(arm.sets))
    validate(run, 1)
    a = run.algorithm
    got = (a.loss.name, run.trainer.updates_per_rollout, a.loss.clip_bounds(), run.routing.mode,
           a.corrections.tis.enabled, a.corrections.tis.ratio, a.loss.aggregation)
    assert got == EXPECTED[arm.name]
    assert (a.corrections.tis.cap, a.advantage.scale_by_std, run.rollout.dtype) == (5.0, False, "bfloat16")
    assert run.routing.capture_rollout_routes and run.routing.attribute_mismatch
    row = next(line for line in (REPO / "docs" / "routing_stability.md").read_text().splitlines()
               if line.startswith(f"| `{arm.name}` |"))
    assert all(f"`{s}`" in row for s in arm.sets), row  # the docs' table lists the exact overrides


def test_arm_selection_and_pairs():
    assert [a.name for a in RS.select(["gspo_vs_grpo"])] == ["grpo", "grpo_r3", "gspo", "gspo_r3"]
    assert [a.name for a in RS.select(["n4_r3,minirl", "on_policy"])][:2] == ["minirl", "minirl_r3"]
    assert len(RS.select(list(RS.GROUPS))) == len(RS.ARMS) == 22
    assert RS.pairs(RS.select(["off_policy_N8"])) == [("n8_r2_noclip", "n8_noclip"), ("n8_r2", "n8_noclip"),
                                                     ("n8_r3", "n8_noclip"), ("n8_r3", "n8_r2")]
    assert RS.pairs(RS.select(["gspo", "gspo_r3"])) == [("gspo_r3", "gspo")]  # references not selected are left out
    with pytest.raises(ValueError, match=r"unknown \['n3_r2'\]"):
        RS.select(["n3_r2"])


def test_plan_shares_a_warm_start_per_seed(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    args = RS.parse_args(["--seeds", "2", "--arms", "minirl", "gspo", "--out", str(tmp_path), "--set", "rollout.seed=7"])
    plan = RS.check_configs(args)
    assert [j.name for j in plan["jobs"][1]] == ["seed1/warm_start", "seed1/minirl", "seed1/gspo"]
    runs = {j.arm: plan["configs"][j.name] for j in plan["jobs"][1]}
    for run in runs.values():
        assert (run.rollout.seed, run.data.seed, run.learner.seed, run.model.tiny.seed) == (8, 1, 1235, 1)
    warm = runs["warm_start"]
    assert (warm.trainer.steps, warm.trainer.sft.max_steps, warm.trainer.sft.target_accuracy) == (0, 300, 0.15)
    assert warm.model.path == str(tmp_path / "seed1" / "model")
    for arm in ("minirl", "gspo"):
        assert runs[arm].model.path == str(tmp_path / "seed1" / "warm_start" / "hf_final")
        assert (runs[arm].trainer.sft.max_steps, runs[arm].trainer.steps) == (0, RS.FULL["steps"])
    assert runs["gspo"].algorithm.loss.name == "gspo" and runs["minirl"].algorithm.loss.name == "grpo"


@pytest.mark.parametrize("argv, message", [
    (["--seeds", "0"], "--seeds must be >= 1 (got 0)"),
    (["--arms", "minirl", "bogus"], "--arms: unknown ['bogus']"),
    (["--set", "trainer.stepz=3"], "trainer.stepz"),
    (["--set", "algorithm.loss.clip_low=1.5"], "algorithm.loss.clip_low"),
])
def test_bad_command_lines_fail_before_any_run(tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        RS.main(["--out", str(out), *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not out.exists()
