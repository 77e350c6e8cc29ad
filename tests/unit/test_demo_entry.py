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
