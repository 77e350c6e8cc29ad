"""What a user sees follows what the run does (issue 51): the step line's per-feature fields for a table of configs,
metrics.png's panel titles read back from the figure for the same table (constant core panels replaced by a note,
per-layer heat maps), TensorBoard's custom-scalars layout, and `msrl compare`'s table against values recomputed from
metrics.jsonl, its bands and its refusals (through the CLI too).

    .venv/bin/python -m pytest -q tests/unit/test_run_views.py
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from megatron_sparse_rl.config import ConfigError, load_config
from megatron_sparse_rl.observability.features import step_line_fields, tensorboard_layout
from megatron_sparse_rl.observability.progress import format_metrics, step_line_groups
from tests.msrl import MSRL

REPO = Path(__file__).resolve().parents[2]
CORE = ["reward", "accuracy", "mismatch", "clip fraction"]

# Every metric any feature shows, with values whose formatting is written out by hand in ROWS.
FEATURE_METRICS = {
    "episode/turns": 1.75, "episode/tool_calls": 0.75, "episode/tool_errors": 0.125,
    "kv/saved_frac": 0.3312, "mismatch/rho_p5": 0.8634, "sparse_rl/rejected_seq_frac": 0.05,
    "kv/budget": 48.0, "kv/budget_next": 60.0,
    "routing/flip_rate_mean": 0.03125, "routing/flipped_token_fraction": 0.1,
    "async/staleness_mean": 1.25, "async/staleness_max": 2,
    "indexer/agreement": 0.97, "indexer/flip_rate": 0.2,
}
PER_LAYER = {"drift": "routing/drift/layer{}", "flip": "routing/flip_rate/layer{}",
             "indexer": "indexer/agreement/layer_{}"}

# (config, overrides, the step line's feature groups, the metrics that config's run logs beyond the core ones
#  and per-layer families, the panel titles of its figure)
ROWS = [
    ("configs/tiny_moe.yaml", ["routing.record_stats=false"], "", (), (), CORE),
    ("configs/tiny_moe.yaml", [], "", (), ("drift",), CORE + ["expert drift per layer"]),
    ("configs/tool_calc.yaml", [], "turns 1.75 tools 0.75 err 0.12",
     ("episode/turns", "episode/tool_calls", "episode/tool_errors"), ("drift",),
     CORE + ["episodes", "expert drift per layer"]),
    ("configs/sparse_rl_tiny_moe.yaml", [], "saved 33% p5 0.86",
     ("kv/saved_frac", "sparse_rl/rejected_seq_frac"), ("drift",), CORE + ["sparse KV", "expert drift per layer"]),
    ("configs/sparse_rl_fixed_memory.yaml", ["rollout.kv.budget_schedule.enabled=true"], "saved 33% p5 0.86 | budget 48",
     ("kv/saved_frac", "sparse_rl/rejected_seq_frac", "kv/budget", "kv/budget_next"), (),
     CORE + ["sparse KV", "KV budget"]),
    ("configs/tiny_moe.yaml", ["rollout.dtype=bfloat16", "routing.capture_rollout_routes=true"], "flip 0.031",
     ("routing/flip_rate_mean", "routing/flipped_token_fraction"), ("drift", "flip"),
     CORE + ["routing flips", "routing flip rate per layer", "expert drift per layer"]),
    ("configs/async_tiny_moe.yaml", [], "stale 1.25", ("async/staleness_mean", "async/staleness_max"), ("drift",),
     CORE + ["staleness", "expert drift per layer"]),
    ("configs/tiny_deepseek_v3.yaml", ["routing.indexer_replay=R2", "routing.record_stats=false"], "agree 0.970",
     ("indexer/agreement", "indexer/flip_rate"), ("indexer",), CORE + ["DSA indexer", "indexer agreement per layer"]),
    ("configs/tool_calc.yaml",
     ["rollout.prefix_caching=false", "rollout.kv.policy=streamingllm", "trainer.max_staleness=1"],
     "turns 1.75 tools 0.75 err 0.12 | saved 33% p5 0.86 | stale 1.25",
     ("episode/turns", "kv/saved_frac", "async/staleness_mean"), ("drift",),
     CORE + ["episodes", "sparse KV", "staleness", "expert drift per layer"]),
]
IDS = ["no-stats", "tiny_moe", "episodes", "sparse-kv", "kv-schedule", "bf16-flips", "async", "dsa", "episodes+kv+async"]

BASE = {"rollout/reward": 0.4, "rollout/accuracy": 0.375, "mismatch/k1": 0.0012}
BASE_LINE = "reward 0.400 acc 0.375 | k1 1.2e-03"


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_the_step_line_has_the_fields_of_the_features_on(row):
    config, overrides, expected, *_ = row
    run = load_config(REPO / config, overrides)
    line = format_metrics({**BASE, **FEATURE_METRICS}, step_line_groups(step_line_fields(run)))
    # "rej 0.050" is the core corrections field, shown whenever a rejection rate is logged
    assert line == BASE_LINE + " | rej 0.050" + (f" | {expected}" if expected else "")


def test_a_field_whose_metric_a_step_lacks_is_left_out():
    run = load_config(REPO / "configs/sparse_rl_tiny_moe.yaml")
    assert format_metrics({"mismatch/rho_p5": 0.5}, step_line_groups(step_line_fields(run))) == "p5 0.50"


def _records(extra: tuple[str, ...], families: tuple[str, ...], steps: int = 5, layers=(0, 1)) -> list[dict]:
    records = [{"step": 1, "phase": "sft", "sft/loss": 2.0}]
    for s in range(1, steps + 1):
        r = {"step": s, "phase": "rl", "rollout/reward": s / 10, "rollout/accuracy": s / 12,
             "mismatch/k1": 1e-3 * s, "mismatch/k3": 1e-4 * s, "loss/clip_frac": 0.01 * s,
             "mismatch/rho_p5": 0.9}  # every run logs rho_p5: it alone makes no sparse-KV panel
        r.update({k: FEATURE_METRICS[k] * s for k in extra})
        for fam in families:
            r.update({PER_LAYER[fam].format(layer): 0.1 * s + layer for layer in layers})
        records.append(r)
    return records


def _write(path: Path, records: list[dict]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("row", ROWS, ids=IDS)
def test_the_figure_has_one_panel_per_feature_and_a_heat_map_per_layer_metric(tmp_path, row):
    pytest.importorskip("matplotlib")
    from megatron_sparse_rl.observability.metrics import read_metrics
    from megatron_sparse_rl.observability.plot import figure, panel_titles, plot_metrics

    _, _, _, extra, families, titles = row
    path = _write(tmp_path, _records(extra, families)) / "metrics.jsonl"

    assert panel_titles(figure(read_metrics(path))) == titles
    if row is ROWS[-1]:  # the file it writes, once
        assert plot_metrics(path, tmp_path / "m.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_constant_core_panel_becomes_a_note(tmp_path):
    """The issue's tool_calc figure: k1 around 1e-8 and a clip fraction of 0 at every step carry no information."""
    pytest.importorskip("matplotlib")
    from megatron_sparse_rl.observability.plot import figure, panel_titles

    records = [{"step": s, "phase": "rl", "rollout/reward": s / 10, "rollout/accuracy": s / 12,
                "mismatch/k1": 1e-8 * (1 + (s % 2)), "mismatch/k3": 2e-14, "loss/clip_frac_low": 0.0,
                "loss/clip_frac_high": 0.0, "episode/turns": 2.0} for s in range(1, 5)]
    fig = figure(records)
    assert panel_titles(fig) == ["reward", "accuracy", "episodes"]
    note = " ".join(t.get_text() for t in fig.texts)
    assert "mismatch: k1 within [1e-08, 2e-08], k3 2e-14 at every step" in note
    assert "clip fraction: clip low+high 0 at every step" in note


def test_tensorboard_layout_names_the_panels_and_their_metrics():
    keys = {"rollout/reward", "mismatch/k1", "kv/saved_frac", "mismatch/rho_p5", "routing/drift/layer3",
            "routing/drift/layer1"}
    charts = tensorboard_layout(keys)["msrl"]
    assert charts == {"reward": ["Multiline", ["rollout/reward"]], "mismatch": ["Multiline", ["mismatch/k1"]],
                      "sparse KV": ["Multiline", ["kv/saved_frac", "mismatch/rho_p5"]],
                      "expert drift per layer": ["Multiline", ["routing/drift/layer1", "routing/drift/layer3"]]}


def test_tensorboard_gets_the_layout(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_sparse_rl.observability.metrics import MetricsWriter

    with MetricsWriter(tmp_path, layout=tensorboard_layout) as w:
        w.log(1, {"rollout/reward": 0.5, "episode/turns": 2.0})
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    assert "custom_scalars__config__" in acc.Tags()["tensors"]


# --- msrl compare ---------------------------------------------------------------------------------------------

def _run_dir(root: Path, name: str, seed: int, extra: dict | None = None, steps: int = 6) -> Path:
    records = [{"step": 0, "phase": "warm_start", "eval/accuracy": 0.9}]  # not an RL step: never compared
    for s in range(1, steps + 1):
        r = {"step": s, "phase": "rl", "time": 0.0, "rollout/reward": ((s * 7 + seed * 3) % 5) / 5,
             "rollout/accuracy": s / 10 + seed / 100, "mismatch/k1": 1e-3 / s}
        if s % 3 == 0:
            r["eval/accuracy"] = s / 20 + seed / 50
        r.update({k: v * s for k, v in (extra or {}).items()})
        records.append(r)
    return _write(root / f"seed{seed}" / name, records)


def _expected(run_dir: Path, metric: str) -> tuple[float, int, float, int]:
    """(final, its step, peak, its step) recomputed from the file: the last rl record holding the metric; the
    largest value (the first step holding it)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    points = [(r["step"], r[metric]) for r in rows if r["phase"] == "rl" and r.get(metric) is not None]
    peak = max(v for _, v in points)
    return points[-1][1], points[-1][0], peak, next(s for s, v in points if v == peak)


def test_compare_table_equals_the_values_recomputed_from_metrics_jsonl(tmp_path):
    pytest.importorskip("matplotlib")
    from megatron_sparse_rl.observability.compare import compare, figure, load_run

    dirs = [_run_dir(tmp_path, "dense", 0), _run_dir(tmp_path, "dense", 1),
            _run_dir(tmp_path, "sparse", 0, {"kv/saved_frac": 0.05})]
    out, rows = compare(dirs, tmp_path / "c.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    metrics = ["rollout/reward", "rollout/accuracy", "eval/accuracy", "mismatch/k1"]
    assert [(r.run, r.metric) for r in rows] == [(str(d), m) for d in dirs for m in metrics]
    for r in rows:
        assert (r.final, r.final_step, r.peak, r.peak_step) == _expected(Path(r.run), r.metric)
    runs = [load_run(d) for d in dirs]
    fig = figure(runs, metrics)
    assert [ax.get_title() for ax in fig.axes] == metrics
    for ax in fig.axes:  # dense: two runs -> a mean line and a band; sparse: its own line
        assert [line.get_label() for line in ax.get_lines()] == ["dense (mean of 2)", "sparse"]
        assert len(ax.collections) == 1
    # the band: at each step from the lower to the higher of the two dense runs
    mean = fig.axes[0].get_lines()[0].get_ydata()
    r0, r1 = (dict(zip(*run.series("rollout/reward"))) for run in runs[:2])
    assert list(mean) == pytest.approx([(r0[s] + r1[s]) / 2 for s in sorted(r0)])


def test_compare_refuses_a_metric_some_runs_lack_naming_them(tmp_path):
    pytest.importorskip("matplotlib")
    from megatron_sparse_rl.observability.compare import compare

    dense, sparse = _run_dir(tmp_path, "dense", 0), _run_dir(tmp_path, "sparse", 0, {"kv/saved_frac": 0.05})
    with pytest.raises(ConfigError, match=rf"'kv/saved_frac' is in 1 of the runs but not in '{dense}'"):
        compare([dense, sparse], tmp_path / "c.png", ["kv/saved_frac"])
    assert not (tmp_path / "c.png").exists()
    short = _run_dir(tmp_path, "short", 0, steps=2)  # no evaluation step: lacks eval/accuracy, a default metric
    with pytest.raises(ConfigError, match=rf"'eval/accuracy' is in 1 of the runs but not in '{short}'"):
        compare([dense, short], tmp_path / "c.png")
    with pytest.raises(ConfigError, match="no run logged the metric 'kv/saved' .*kv/saved_frac"):
        compare([sparse], tmp_path / "c.png", ["kv/saved"])
    with pytest.raises(ConfigError, match=rf"'{tmp_path / 'nothing'}' is no such run directory or metrics.jsonl"):
        compare([tmp_path / "nothing"], tmp_path / "c.png")


def test_msrl_compare_cli(tmp_path):
    """Through the CLI: the table on stdout, the PNG written, nothing else on the console; a refusal is one
    `error:` line naming the run and the metric, exit 2."""
    pytest.importorskip("matplotlib")
    a, b = _run_dir(tmp_path, "dense", 0), _run_dir(tmp_path, "sparse", 1, {"kv/saved_frac": 0.05})
    out = tmp_path / "cmp.png"
    proc = subprocess.run([*MSRL, "compare", str(a), str(b), "--metric", "rollout/reward", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["run", "metric", "final", "(step)", "peak", "(step)"] and lines[-1] == f"wrote {out}"
    for line, run in zip(lines[1:3], (a, b)):
        final, final_step, peak, peak_step = _expected(run, "rollout/reward")
        assert line.split() == [str(run), "rollout/reward", f"{final:.4g}", str(final_step), f"{peak:.4g}",
                                str(peak_step)]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    proc = subprocess.run([*MSRL, "compare", str(a), str(b), "--metric", "kv/saved_frac", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: msrl compare:") and proc.stderr.count("\n") == 1
    assert f"'kv/saved_frac' is in 1 of the runs but not in '{a}'" in proc.stderr


def test_the_studies_runs_png_is_msrl_compares_picture_of_every_run(tmp_path, monkeypatch):
    """experiments/study_plot.py `runs_png` (routing_stability.py, sparse_rl_compare.py): the default metrics every
    run logged (a 2-step arm without an evaluation leaves eval/accuracy out instead of refusing), arms banded."""
    pytest.importorskip("matplotlib")
    monkeypatch.syspath_prepend(str(REPO / "experiments"))
    import study_plot
    from megatron_sparse_rl.observability import compare as C

    rows = [{"run_dir": str(_run_dir(tmp_path, arm, seed, steps=steps))}
            for arm, seed, steps in (("dense", 0, 6), ("dense", 1, 6), ("sparse", 0, 2))]
    out = study_plot.runs_png(rows, tmp_path / "plots" / "runs.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not list(tmp_path.rglob("*.tmp"))
    runs = [C.load_run(r["run_dir"]) for r in rows]
    assert C.common_metrics(runs) == ["rollout/reward", "rollout/accuracy", "mismatch/k1"]
