"""A resume compares the config saved with the checkpoint with its own (run/run_dir.py `check_resume`,
run/resume_config.py): changes to what the resumed steps compute are refused, listed as `path: old -> new`,
before anything is written; harmless ones are allowed and listed; `checkpoint.allow_config_change` accepts the
others; a checkpoint saved without a config resumes with a warning that it could not be compared. The checkpoints
here are fake directories laid out as `save_learner` writes them (no Megatron)."""
import json
import logging
import subprocess
from pathlib import Path

import pytest

from megatron_sparse_rl.config import RunConfig, load_config, to_dict
from megatron_sparse_rl.learner.checkpoint import CONFIG
from megatron_sparse_rl.learner.integrity import digest_files, write_manifest
from megatron_sparse_rl.run.resume_config import allowed, compare
from megatron_sparse_rl.run.run_dir import RunDirError, claim
from tests.msrl import MSRL
from tests.snapshot import snapshot

REPO = Path(__file__).resolve().parents[2]
# The e2e trainer test's settings (tests/e2e/test_trainer.py), as the run that saved the checkpoint had them.
SAVED = ("trainer.steps=4", "trainer.sft.max_steps=3", "learner.optimizer.lr=1e-3", "checkpoint.save_every=2")


def _run(tmp_path: Path, *sets: str) -> RunConfig:
    pairs = [f"logging.dir={tmp_path / 'run'}", f"model.path={tmp_path / 'model'}", *SAVED, *sets]
    return load_config(REPO / "configs/tiny_moe.yaml", pairs)


def _saved_run(tmp_path: Path, config: dict | None, name: str = "step_000004_sft_000003") -> Path:
    """A run directory as a finished run leaves it: run.json, metrics, and one checkpoint of that run holding
    `config` (None: a checkpoint saved before configs were stored)."""
    run_id = claim(_run(tmp_path)).run_id
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 4, "phase": "rl"}\n')
    path = tmp_path / "run" / "checkpoints" / name
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"weights" * 100)
    (path / "common_state.pt").write_bytes(b"state")
    if config is not None:
        (path / CONFIG).write_text(json.dumps(config, indent=1) + "\n")
    write_manifest(path, digest_files(path), owner=run_id)
    (path / "COMPLETE").write_text("ok\n")
    return path


def _resume_line(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resuming run")]
    assert len(lines) == 1 and all(r.levelno == logging.WARNING for r in caplog.records
                                   if r.getMessage().startswith("resuming run"))
    return lines[0]


def test_changes_to_what_is_computed_are_refused_listing_each_and_nothing_is_touched(tmp_path):
    ckpt = _saved_run(tmp_path, to_dict(_run(tmp_path)))
    before = snapshot(tmp_path)
    changed = ("trainer.sft.max_steps=5", "model.tiny.hidden=32", "data.seed=7", "reward.kind=math",
               "algorithm.kl.coef=0.1", "rollout.sampling.temperature=0.7", "learner.optimizer.lr=0.0005",
               "trainer.steps=6", "logging.level=WARNING")
    with pytest.raises(RunDirError) as err:
        claim(_run(tmp_path, *changed))
    msg = str(err.value)
    assert str(ckpt) in msg and "checkpoint.allow_config_change=true" in msg and "logging.dir=" in msg
    for line in ("trainer.sft.max_steps: 3 -> 5", "model.tiny.hidden: 64 -> 32", "data.seed: 0 -> 7",
                 'reward.kind: "exact" -> "math"', "algorithm.kl.coef: 0.0 -> 0.1",
                 "rollout.sampling.temperature: 1.0 -> 0.7", "learner.optimizer.lr: 0.001 -> 0.0005"):
        assert f"\n  {line}" in msg, (line, msg)
    assert "allowed, also changed: logging.level" in msg and "trainer.steps: 4 -> 6" in msg
    assert snapshot(tmp_path) == before


def test_harmless_changes_resume_and_are_listed_in_the_resume_line(tmp_path, caplog):
    ckpt = _saved_run(tmp_path, to_dict(_run(tmp_path)))
    with caplog.at_level(logging.INFO):
        owner = claim(_run(tmp_path, "trainer.steps=6", "logging.level=WARNING", "checkpoint.keep_last=3",
                           "trainer.eval_every=1", "parallel.ep=2", "learner.micro_batch_size=2"))
    assert owner.resuming and owner.compared == ckpt
    line = _resume_line(caplog)
    assert f"at RL step 4 (SFT step 3) from {ckpt}" in line
    assert "config compared with the checkpoint's: 6 fields differ" in line
    for change in ("trainer.steps: 4 -> 6", 'logging.level: "INFO" -> "WARNING"', "checkpoint.keep_last: 2 -> 3",
                   "trainer.eval_every: 5 -> 1", "parallel.ep: 1 -> 2", "learner.micro_batch_size: 4 -> 2"):
        assert change in line, (change, line)
    assert "ACCEPTED" not in line


def test_an_unchanged_config_says_so(tmp_path, caplog):
    ckpt = _saved_run(tmp_path, to_dict(_run(tmp_path)))
    with caplog.at_level(logging.INFO):
        claim(_run(tmp_path))
    assert _resume_line(caplog).endswith(f"from {ckpt}\n  config compared with the checkpoint's: unchanged")


def test_allow_config_change_accepts_and_names_the_changes(tmp_path, caplog):
    _saved_run(tmp_path, to_dict(_run(tmp_path)))
    with caplog.at_level(logging.INFO):
        owner = claim(_run(tmp_path, "trainer.sft.max_steps=5", "checkpoint.allow_config_change=true"))
    assert owner.resuming
    line = _resume_line(caplog)
    assert "ACCEPTED (checkpoint.allow_config_change)" in line and "trainer.sft.max_steps: 3 -> 5" in line
    assert "checkpoint.allow_config_change: false -> true" in line  # listed among the allowed changes


def test_a_checkpoint_saved_without_a_config_resumes_with_a_warning(tmp_path, caplog):
    ckpt = _saved_run(tmp_path, None)
    with caplog.at_level(logging.INFO):
        owner = claim(_run(tmp_path, "trainer.sft.max_steps=5"))
    assert owner.resuming and owner.compared == ckpt
    assert "could not be compared" in _resume_line(caplog)


def test_the_newest_of_the_runs_checkpoints_is_compared(tmp_path):
    base = to_dict(_run(tmp_path))
    _saved_run(tmp_path, {**base, "trainer": {**base["trainer"], "sft": {**base["trainer"]["sft"], "max_steps": 9}}},
               name="step_000002_sft_000009")
    newest = tmp_path / "run" / "checkpoints" / "step_000004_sft_000003"
    newest.mkdir()
    (newest / CONFIG).write_text(json.dumps(base))
    run_id = json.loads((tmp_path / "run" / "run.json").read_text())["run_id"]
    write_manifest(newest, digest_files(newest), owner=run_id)
    (newest / "COMPLETE").write_text("ok\n")
    assert claim(_run(tmp_path)).compared == newest  # the older one's sft.max_steps 9 is not what is resumed


def test_a_damaged_saved_config_is_named(tmp_path):
    ckpt = _saved_run(tmp_path, to_dict(_run(tmp_path)))
    (ckpt / CONFIG).write_text('{"trainer": ')
    with pytest.raises(RunDirError, match="saved config is damaged") as err:
        claim(_run(tmp_path))
    assert str(ckpt / CONFIG) in str(err.value)


def test_compare_fields_added_or_removed_since_the_checkpoint():
    defaults = {"a": {"x": 1, "new": 0}, "trainer": {"steps": 10}}
    old = {"a": {"x": 1, "gone": 5}, "trainer": {"steps": 4}}
    assert [str(c) for c in compare(old, {"a": {"x": 1, "new": 0}, "trainer": {"steps": 6}}, defaults)] == [
        "a.gone: 5 -> (no longer a field)", "trainer.steps: 4 -> 6"]  # a field added since, at its default: no change
    changes = compare(old, {"a": {"x": 1, "new": 3}, "trainer": {"steps": 4}}, defaults)
    assert [(str(c), c.allowed) for c in changes] == [("a.gone: 5 -> (no longer a field)", True),
                                                      ("a.new: (not recorded) -> 3", False)]


def test_a_section_set_on_one_side_only_is_one_change():
    (change,) = compare({"model": {"tiny": None}}, {"model": {"tiny": {"hidden": 64}}})
    assert str(change) == 'model.tiny: null -> {"hidden": 64}' and not change.allowed


def test_a_long_value_keeps_both_ends():
    """A path past 160 characters (JSON-quoted) loses its middle, not its tail, which tells runs apart."""
    old, new = "/runs/a", "/scratch/" + "x" * 200 + "/run-7"
    (change,) = compare({"logging": {"dir": old}}, {"logging": {"dir": new}})
    quoted = '"' + new + '"'
    shown = str(change).split(" -> ")[1]
    assert len(shown) == 160 and shown == quoted[:78] + "..." + quoted[-79:] and shown.endswith('/run-7"')
    # shorter ones are whole
    (change,) = compare({"logging": {"dir": old}}, {"logging": {"dir": "/tmp/" + "y" * 140}})
    assert str(change) == 'logging.dir: "/runs/a" -> "/tmp/' + "y" * 140 + '"'


def test_what_is_allowed():
    for path in ("trainer.steps", "logging.dir", "checkpoint.keep_last", "parallel.tp", "launch.slurm.time",
                 "trainer.eval_every", "model.recompute_activations", "routing.record_stats"):
        assert allowed(path), path
    for path in ("trainer.sft.max_steps", "trainer.stepsX", "model.path", "model.tiny.hidden", "data.path",
                 "reward.kind", "algorithm.loss.name", "rollout.sampling.n", "rollout.kv.policy", "rollout.dtype",
                 "learner.optimizer.lr", "learner.seed", "routing.mode", "trainer.prompts_per_step"):
        assert not allowed(path), path


def test_msrl_train_refuses_a_changed_resume_before_starting(tmp_path):
    from megatron_sparse_rl.validation import validate
    from megatron_sparse_rl.validation.resolve import resolve

    run = _run(tmp_path)
    _saved_run(tmp_path, to_dict(resolve(run, validate(run, 1))))  # what a run saves: its resolved config
    before = snapshot(tmp_path)
    sets = [f"logging.dir={tmp_path / 'run'}", f"model.path={tmp_path / 'model'}", *SAVED, "trainer.sft.max_steps=5"]
    proc = subprocess.run([*MSRL, "train", str(REPO / "configs/tiny_moe.yaml"), "--set",
                           *sets], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "error: cannot resume" in proc.stderr
    assert "trainer.sft.max_steps: 3 -> 5" in proc.stderr
    assert snapshot(tmp_path) == before  # no model was built, no log written
