"""Observability: metrics.jsonl round trip (non-finite values, resume truncation, torn lines),
TensorBoard events, the progress line against hand-written text, and the PNG plot.

    .venv/bin/python -m pytest -q tests/unit/test_observability.py
"""
from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
import torch

from megatron_sparse_rl.observability.metrics import MetricsWriter, read_metrics, to_record
from megatron_sparse_rl.observability.plot import plot_metrics, series
from megatron_sparse_rl.observability.progress import ProgressPrinter, format_duration, format_metrics, progress_bar


def test_metrics_jsonl_round_trip(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        w.log(1, {"rollout/reward": 0.25, "train/tokens": 12, "eval/ok": True, "note": "x",
                  "loss/value": torch.tensor(1.5), "mismatch/k1": float("nan"), "grad": float("inf"),
                  "neg": float("-inf"), "missing": None})
        w.log(2, {"rollout/reward": 0.5}, phase="sft")
        assert w.records == 2
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    raw = json.loads(lines[0])  # strict JSON: no NaN tokens in the file
    assert "NaN" not in lines[0] and raw["mismatch/k1"] is None
    assert raw["nonfinite"] == {"mismatch/k1": "nan", "grad": "inf", "neg": "-inf"}
    first, second = read_metrics(tmp_path / "metrics.jsonl")
    assert first["step"] == 1 and first["phase"] == "rl" and first["rollout/reward"] == 0.25
    assert first["train/tokens"] == 12 and first["eval/ok"] is True and first["note"] == "x"
    assert first["loss/value"] == 1.5 and first["missing"] is None
    assert math.isnan(first["mismatch/k1"]) and first["grad"] == math.inf and first["neg"] == -math.inf
    assert "nonfinite" not in first
    assert second["phase"] == "sft" and second["step"] == 2


def test_metrics_reject_bad_names_and_values(tmp_path):
    with pytest.raises(ValueError, match="metric name 'step' is not allowed"):
        to_record(0, {"step": 1})
    with pytest.raises(TypeError, match="metric 'x': expected a number"):
        to_record(0, {"x": [1, 2]})


def test_resume_keeps_the_checkpointed_records_and_appends(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        for step in range(1, 6):
            w.log(step, {"r": step / 10})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "r"')  # torn line of a killed run
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    with MetricsWriter(tmp_path, tensorboard=False, keep_records=3) as w:
        assert w.records == 3
        w.log(4, {"r": 0.44})
    assert [(r["step"], r["r"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [
        (1, 0.1), (2, 0.2), (3, 0.3), (4, 0.44)]
    with pytest.raises(ValueError, match="holds 4 records, fewer than the 9"):
        MetricsWriter(tmp_path, tensorboard=False, keep_records=9)


def test_malformed_middle_line_names_its_number(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a valid metrics record"):
        read_metrics(tmp_path / "metrics.jsonl")


def test_tensorboard_events(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsWriter(tmp_path, tensorboard=True) as w:
        assert w.tensorboard_enabled
        w.log(1, {"rollout/reward": 0.25, "note": "skip me"})
        w.log(2, {"rollout/reward": 0.75})
        w.log(1, {"eval/accuracy": 0.5}, phase="sft")
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"rollout/reward"}
    assert [(e.step, e.value) for e in acc.Scalars("rollout/reward")] == [(1, 0.25), (2, 0.75)]
    sft = EventAccumulator(str(tmp_path / "tensorboard" / "sft"))  # each phase is its own TensorBoard run
    sft.Reload()
    assert [(e.step, e.value) for e in sft.Scalars("sft/eval/accuracy")] == [(1, 0.5)]


def test_tensorboard_resume_in_rl_keeps_the_sft_events(tmp_path):
    """SFT steps 1-6 and RL steps 1-4 logged, a checkpoint after RL step 2 (10 - 2 records kept), the resume logs
    RL steps 3-5 anew: TensorBoard's reader shows every SFT step and each RL step once, with the new values."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsWriter(tmp_path, keep_records=0) as first:
        for step in range(1, 7):
            first.log(step, {"loss": float(step)}, phase="sft")
        for step in range(1, 5):
            first.log(step, {"r": float(step)})
            if step == 2:
                saved = first.records
    with MetricsWriter(tmp_path, keep_records=saved) as second:
        for step in range(3, 6):
            second.log(step, {"r": 10.0 + step})

    def read(*parts):
        acc = EventAccumulator(str(tmp_path.joinpath("tensorboard", *parts)))
        acc.Reload()
        return acc
    assert [(e.step, e.value) for e in read("sft").Scalars("sft/loss")] == [(s, float(s)) for s in range(1, 7)]
    assert [(e.step, e.value) for e in read().Scalars("r")] == [(1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0)]


def test_progress_line_hand_written():
    clock = [100.0]
    out = io.StringIO()
    p = ProgressPrinter(10, width=10, stream=out, clock=lambda: clock[0])
    p.restart(0)
    clock[0] = 130.0  # 3 steps in 30 s since restart(0) -> 10 s/step, 7 left -> 70 s
    line = p.update(3, {"time/rollout_s": 1.234, "time/train_s": 0.5, "time/sync_s": 0.05,
                        "rollout/tokens_per_s": 812.4, "rollout/reward": 0.41, "rollout/accuracy": 0.375,
                        "mismatch/k1": 0.0012, "mismatch/k3": 0.0004, "loss/clip_frac_low": 0.01,
                        "loss/clip_frac_high": 0.02, "mis/rejected_seq_frac": 0.05, "unshown": 1,
                        "rollout/kv_peak_occupancy": 0.4149})
    assert line == ("[###.......]  3/10  30% eta 1m10s | roll 1.23s train 0.50s sync 0.05s | 812 tok/s kv 41% | "
                    "reward 0.410 acc 0.375 | k1 1.2e-03 k3 4.0e-04 | clip 0.030 rej 0.050")
    assert out.getvalue() == line + "\n"


def test_progress_pieces():
    assert progress_bar(0, 4, 4) == "[....]" and progress_bar(4, 4, 4) == "[####]" and progress_bar(9, 4, 4) == "[####]"
    assert [format_duration(s) for s in (0, 59, 61, 3600 + 180, float("nan"))] == ["0s", "59s", "1m01s", "1h03m", "?"]
    assert format_metrics({}) == ""
    assert format_metrics({"loss/clip_frac": 0.1, "loss/clip_frac_low": 0.5, "eval/accuracy": float("nan")}) == \
        "eval nan | clip 0.100"
    p = ProgressPrinter(5, clock=lambda: 0.0, stream=io.StringIO())
    assert p.line(2, {}).endswith("eta ?")  # first line, no step times: unknown


def test_eta_is_sane_from_the_first_step():
    """Issue 38: a 4-minute demo showed eta 2h54m at step 1, the start-up (SFT, warm-start eval) counted as step 1."""
    clock = [0.0]
    p = ProgressPrinter(60, stream=io.StringIO(), clock=lambda: clock[0])
    clock[0] = 175.0  # engine start, SFT and the warm-start evaluation took 175 s before step 1 ended
    step_times = {"time/rollout_s": 2.0, "time/train_s": 1.0, "time/sync_s": 0.25}
    assert "eta 3m12s |" in p.line(1, step_times)  # its own 3.25 s x 59 left = 191.75 s (not 175 x 59)
    clock[0] = 179.0  # step 2 took 4 s (measured between lines from now on): 4 x 58 = 232 s
    assert "eta 3m52s" in p.line(2, step_times)
    clock[0] = 191.0  # steps 2-4 in 16 s: 16 / 3 x 56 = 298.7 s
    assert "eta 4m59s" in p.line(4, {})
    clock[0] = 500.0  # a resumed run's clock restarts where it resumes: 100 s for step 5 -> 100 x 55 = 5500 s
    p.restart(4)
    clock[0] = 600.0
    assert "eta 1h31m" in p.line(5, {})


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        w.log(1, {"sft/loss": 2.0}, phase="sft")
        for step in range(1, 6):
            m = {"rollout/reward": step / 10, "rollout/accuracy": step / 12, "mismatch/k1": 1e-3,
                 "mismatch/k3": float("nan") if step == 3 else 1e-4}
            if step % 2 == 0:
                m["eval/accuracy"] = step / 15
            w.log(step, m)  # no clip fraction at all: its panel is a "not logged" note
    out = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "plots" / "curves.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    assert not (tmp_path / "plots" / "curves.png.tmp").exists()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert series(records, ("eval/accuracy",)) == ([2, 4], [2 / 15, 4 / 15])
    assert series(records, ("mismatch/k3",))[0] == [1, 2, 4, 5]  # the NaN point is skipped


def _emit_everything():
    """What a run's start prints: the project's INFO, library INFO, known-benign and real library warnings."""
    import logging
    import warnings

    logging.getLogger("megatron_sparse_rl.training.report").info("held-out accuracy before RL: 0.250")
    logging.getLogger("vllm.config.model").info("Resolved architecture: Qwen3MoeForCausalLM")
    logging.getLogger("vllm.model_executor.model_loader").warning("%s: Failed to load weights", "RotaryEmbedding")
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # a repeated warning is otherwise shown once per process
        warnings.warn("Apex is not installed. Falling back to Torch Norm")
    logging.getLogger("vllm.v1.core").warning("KV cache is nearly full")
    logging.getLogger("megatron.core.models").error("a library error")
    reload = logging.getLogger("vllm.model_executor.model_loader.reload.inplace")
    reload.warning("Following weights were not loaded from checkpoint: %s",  # MLA's derived projections: benign
                   {"model.layers.0.self_attn.mla_attn.mla_attn.W_UK_T", "model.layers.0.self_attn.mla_attn.mla_attn.W_UV"})
    reload.warning("Following weights were not loaded from checkpoint: %s",  # a real gap: shown
                   {"model.layers.1.mlp.gate.weight", "model.layers.1.self_attn.mla_attn.mla_attn.W_UV"})


@contextlib.contextmanager
def _root_logging_restored():
    """The root logger (yielded) as it was before the block: handlers (closed), level, no warnings capture."""
    import logging

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        yield root
    finally:
        for h in root.handlers:
            h.close()
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
        logging.captureWarnings(False)


@pytest.mark.parametrize("verbose", [False, True])
def test_console_shows_own_lines_and_real_warnings_the_log_file_everything(tmp_path, capsys, verbose):
    import logging

    from megatron_sparse_rl.observability.logging import attach_log_file, init_logging

    with _root_logging_restored() as root:
        init_logging(0, "INFO", verbose=verbose)
        log_file = attach_log_file(tmp_path / "logs" / "rank0.log")
        _emit_everything()
        for h in root.handlers:
            h.flush()
        console = capsys.readouterr().err
        lines = [ln for ln in console.splitlines() if ln.startswith("[rank 0]")]
        in_file = log_file.read_text()
    assert "[rank 0] INFO megatron_sparse_rl.training.report: held-out accuracy before RL: 0.250" in lines
    assert any("KV cache is nearly full" in ln for ln in lines) and any("a library error" in ln for ln in lines)
    assert any("model.layers.1.mlp.gate.weight" in ln for ln in lines)
    benign = ("Resolved architecture", "Failed to load weights", "Apex is not installed", "layers.0.self_attn")
    for text in benign:
        assert text in in_file  # never lost
        assert any(text in ln for ln in lines) == verbose


def test_a_full_disk_names_the_metrics_file(tmp_path):
    """The kernel's ENOSPC (writes to /dev/full) names no file: the writer's error names metrics.jsonl and the
    step, and the records before it stay whole."""
    import os

    from megatron_sparse_rl.config import ConfigError

    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.log(1, {"loss": 0.5})
        ok_fd, writer._fd = writer._fd, os.open("/dev/full", os.O_WRONLY)
        try:
            with pytest.raises(ConfigError, match=rf"metrics record of step 2 to '{tmp_path / 'metrics.jsonl'}': "
                                                  "No space left on device"):
                writer.log(2, {"loss": 0.25})
        finally:
            os.close(writer._fd)
            writer._fd = ok_fd
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1]


@pytest.mark.parametrize("verbose", [False, True])
def test_tool_logging_keeps_library_warnings_in_the_file(tmp_path, capsys, verbose):
    """`msrl bench` / `msrl convert` (issue 38): our lines on the console; a library's warning only in the log
    file unless verbose; a library's error on the console always."""
    import logging

    from megatron_sparse_rl.observability.logging import init_tool_logging

    with _root_logging_restored() as root:
        log_file = init_tool_logging("bench", verbose=verbose, path=tmp_path / "bench.log")
        logging.getLogger("megatron_sparse_rl.tools.bench_cmd").info("our result line")
        logging.getLogger("megatron.core.transformer").warning("a Megatron warning")
        logging.getLogger("vllm.engine").warning("a vLLM warning")
        logging.getLogger("vllm.engine").error("a vLLM error")
        for h in root.handlers:
            h.flush()
        console = capsys.readouterr().err
        in_file = log_file.read_text()
    assert log_file == tmp_path / "bench.log"
    for text in ("our result line", "a Megatron warning", "a vLLM warning", "a vLLM error"):
        assert text in in_file
    assert "our result line" in console and "a vLLM error" in console
    assert ("a Megatron warning" in console) == verbose and ("a vLLM warning" in console) == verbose


def test_the_reporter_shows_p5_with_sparse_kv(tmp_path):
    from dataclasses import replace
    from types import SimpleNamespace

    from megatron_sparse_rl.config import RunConfig
    from megatron_sparse_rl.training.report import Reporter

    run = RunConfig()
    for policy, shown in (("none", False), ("streamingllm", True)):
        cfg = replace(run, rollout=replace(run.rollout, kv=replace(run.rollout.kv, policy=policy)))
        report = Reporter(SimpleNamespace(is_main=True, run_dir=tmp_path, run=cfg, writer=None), total=4)
        report.progress.stream = io.StringIO()
        report.step(1, {"rollout/kv_peak_occupancy": 0.5, "mismatch/rho_p5": 0.9})
        assert ("p5 0.90" in report.progress.stream.getvalue()) is shown, policy
