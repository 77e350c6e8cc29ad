"""`make demo`'s entry point: a previous demo run's artifacts are replaced (only those, announced); --resume
keeps them. The training itself is stubbed here: this is about the entry point's own file handling (the
real demo run is tests/e2e/test_trainer.py's held-out accuracy test and `make demo`)."""
import pytest

from megatron_sparse_rl import demo


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    import megatron_sparse_rl.trainer as trainer

    seen = {}

    def fake_train(run):
        seen["left"] = sorted(p.name for p in (tmp_path / "run").iterdir())
        return {"warm_start_accuracy": 0.1, "final_accuracy": 0.2, "rl_steps": 1, "seconds": 0.0}

    monkeypatch.setattr(trainer, "train", fake_train)
    d = tmp_path / "run"
    (d / "checkpoints" / "step_000001").mkdir(parents=True)
    (d / "metrics.jsonl").write_text("{}\n")
    (d / "notes.txt").write_text("mine\n")
    return d, seen


def test_previous_run_is_replaced_but_nothing_else(run_dir, capsys):
    d, seen = run_dir
    assert demo.main(["--set", f"logging.dir={d}", f"model.path={d / 'model'}"]) == 0
    assert seen["left"] == ["notes.txt"]
    assert "replacing the previous demo run" in capsys.readouterr().out


def test_resume_keeps_the_previous_run(run_dir):
    d, seen = run_dir
    assert demo.main(["--resume", "--set", f"logging.dir={d}", f"model.path={d / 'model'}"]) == 0
    assert seen["left"] == ["checkpoints", "metrics.jsonl", "notes.txt"]


def _trainer_metrics(run_dir, *, warm=0.25, evals=(0.3, 0.5)):
    """metrics.jsonl as the trainer writes it: SFT evals, syncs, the warm-start record, RL steps with evals.
    Returns the record count after each RL step (what a checkpoint at that step keeps on resume)."""
    from megatron_sparse_rl.observability.metrics import MetricsWriter

    kept = []
    with MetricsWriter(run_dir, tensorboard=False) as w:
        w.log(0, {"mismatch/k1": 0.0}, phase="sync")
        w.log(1, {"sft/loss": 2.0, "eval/accuracy": 0.1}, phase="sft")
        w.log(2, {"sft/loss": 1.0, "eval/accuracy": 0.2}, phase="sft")
        w.log(0, {"eval/accuracy": warm}, phase="warm_start")
        for step, acc in enumerate(evals, 1):
            w.log(step, {"rollout/reward": 0.5, "eval/accuracy": acc})
            kept.append(w.records)
    return kept


def _resumed_reporter(run_dir, keep_records):
    """A Reporter of a run resumed from a checkpoint holding `keep_records` metrics records (open_metrics
    cuts the file back first, as the trainer does)."""
    from types import SimpleNamespace

    from megatron_sparse_rl.config import RunConfig
    from megatron_sparse_rl.observability.metrics import MetricsWriter
    from megatron_sparse_rl.training.report import Reporter

    MetricsWriter(run_dir, tensorboard=False, keep_records=keep_records).close()
    return Reporter(SimpleNamespace(is_main=True, run_dir=run_dir, run=RunConfig()), total=3)


def test_a_resumed_run_gets_its_warm_start_accuracy_back(tmp_path):
    kept = _trainer_metrics(tmp_path)
    report = _resumed_reporter(tmp_path, kept[0])  # checkpoint after RL step 1, past the warm start
    assert (report.warm_start_accuracy, report.last_eval) == (0.25, 0.3)
    report = _resumed_reporter(tmp_path, kept[0] - 1)  # the record of step 1 was after the checkpoint
    assert (report.warm_start_accuracy, report.last_eval) == (0.25, 0.25)


def test_before_the_warm_start_or_on_a_fresh_run_there_is_none(tmp_path):
    from megatron_sparse_rl.training.report import recorded_accuracies

    assert recorded_accuracies(tmp_path / "metrics.jsonl") == (None, None)
    _trainer_metrics(tmp_path)
    report = _resumed_reporter(tmp_path, 3)  # checkpoint after SFT: the warm start is still to come
    assert report.warm_start_accuracy is None and report.last_eval == 0.2


def test_resume_summary_reports_the_improvement(tmp_path, monkeypatch, capsys):
    import megatron_sparse_rl.trainer as trainer

    d = tmp_path / "run"
    kept = _trainer_metrics(d, warm=0.25, evals=(0.3, 0.5))
    before = sorted(p.name for p in d.iterdir())

    def resumed_train(run):  # resumes after RL step 1 and finishes step 2 (its eval record is kept here)
        report = _resumed_reporter(d, kept[1])
        return {"warm_start_accuracy": report.warm_start_accuracy, "final_accuracy": report.last_eval,
                "rl_steps": 2, "seconds": 1.0}

    monkeypatch.setattr(trainer, "train", resumed_train)
    assert demo.main(["--resume", "--set", f"logging.dir={d}", f"model.path={d / 'model'}"]) == 0
    assert "held-out accuracy: 0.250 after the SFT warm-start -> 0.500 after 2 RL steps" in capsys.readouterr().out
    assert sorted(p.name for p in d.iterdir()) == before  # nothing written or removed


@pytest.mark.parametrize("summary, code, message", [
    ({"warm_start_accuracy": 0.4, "final_accuracy": 0.4}, 1, "RL did not improve held-out accuracy in this run "
                                                              "(0.400 -> 0.400)"),
    ({"warm_start_accuracy": None, "final_accuracy": 0.4}, 1, "the warm-start accuracy is not in this run's metrics"),
    ({"warm_start_accuracy": 0.1, "final_accuracy": 0.4}, 0, ""),
])
def test_summary_exit_code_and_message(capsys, summary, code, message):
    assert demo.report({"rl_steps": 2, "seconds": 1.0, **summary}) == code
    captured = capsys.readouterr()
    assert message in captured.err and "held-out accuracy:" in captured.out
    assert (captured.err == "") == (code == 0)


def test_a_stopped_run_says_how_to_continue(capsys):
    """Preempted or stopped by a signal: exit 75 (stopped, resumable) and the way to continue."""
    summary = {"rank": 0, "stopped": "SIGINT received", "preempted": False, "at": "RL step 2, SFT step 3",
               "checkpoint": "runs/x/checkpoints/step_000002"}
    assert demo.report(summary) == 75
    out = capsys.readouterr().out
    assert "--resume` continues" in out and "SIGINT received" in out and "runs/x/checkpoints/step_000002" in out
