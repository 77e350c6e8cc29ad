"""Run directories never mix two runs (run/run_dir.py) and checkpoints are recognised as damaged or foreign
(learner/integrity.py, training/state.py). Every refusal must leave the directory exactly as it was."""
import json
import logging
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_sparse_rl.config import load_config
from megatron_sparse_rl.learner.integrity import digest_files, owner_of, verify_files, write_manifest
from megatron_sparse_rl.training import state
from megatron_sparse_rl.run.run_dir import RUN_FILE, RunDirError, claim
from tests.msrl import MSRL
from tests.snapshot import snapshot

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, **sets):
    pairs = [f"logging.dir={tmp_path / 'run'}", f"model.path={tmp_path / 'model'}"]
    pairs += [f"{k.replace('__', '.')}={v}" for k, v in sets.items()]
    return load_config(REPO / "configs/tiny_moe.yaml", pairs)


def _checkpoint(root: Path, name: str, owner: str | None, payload: bytes = b"weights") -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(payload * 100)
    (path / "common_state.pt").write_bytes(b"state")
    write_manifest(path, digest_files(path), owner=owner)
    (path / "COMPLETE").write_text("ok\n")
    return path


def test_fresh_directory_is_claimed_with_a_new_identity(tmp_path):
    owner = claim(_run(tmp_path))
    assert not owner.resuming and owner.path == tmp_path / "run"
    assert json.loads((tmp_path / "run" / RUN_FILE).read_text())["run_id"] == owner.run_id
    again = claim(_run(tmp_path))  # the same run started again (resume is on by default) continues it
    assert again.resuming and again.run_id == owner.run_id


@pytest.mark.parametrize("leftover", ["metrics.jsonl", "hf_final/model.safetensors", "checkpoints/step_000002_sft_000000/x"])
def test_another_runs_files_are_refused_and_left_alone(tmp_path, leftover):
    run_dir = tmp_path / "run"
    (run_dir / leftover).parent.mkdir(parents=True, exist_ok=True)
    (run_dir / leftover).write_text('{"step": 1, "phase": "rl"}\n')
    before = snapshot(tmp_path)
    with pytest.raises(RunDirError) as err:
        claim(_run(tmp_path))
    msg = str(err.value)
    assert str(run_dir) in msg and leftover.split("/")[0] in msg
    assert "checkpoint.resume=true" in msg and "logging.overwrite=true" in msg and "logging.dir=" in msg
    assert snapshot(tmp_path) == before


def test_a_previous_run_is_refused_when_resume_is_off(tmp_path):
    claim(_run(tmp_path))
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    before = snapshot(tmp_path)
    with pytest.raises(RunDirError, match="checkpoint.resume is off"):
        claim(_run(tmp_path, checkpoint__resume="false"))
    assert snapshot(tmp_path) == before


def test_checkpoints_another_run_wrote_are_never_adopted(tmp_path):
    shared = tmp_path / "shared_ckpts"
    mine = claim(_run(tmp_path, checkpoint__dir=shared))
    _checkpoint(shared, "step_000004_sft_000000", owner="someone-else")
    before = snapshot(tmp_path)
    with pytest.raises(RunDirError, match="did not write") as err:
        claim(_run(tmp_path, checkpoint__dir=shared))
    assert "step_000004_sft_000000" in str(err.value) and mine.run_id in str(err.value)
    assert snapshot(tmp_path) == before


def test_overwrite_removes_only_run_artifacts(tmp_path):
    first = claim(_run(tmp_path))
    run_dir = tmp_path / "run"
    (run_dir / "metrics.jsonl").write_text("{}\n")
    _checkpoint(run_dir / "checkpoints", "step_000001_sft_000000", owner=first.run_id)
    (run_dir / "notes.txt").write_text("mine")  # not a run artifact: kept
    (run_dir / "model").mkdir()
    (run_dir / "model" / "config.json").write_text("{}")
    second = claim(_run(tmp_path, logging__overwrite="true"))
    assert not second.resuming and second.run_id != first.run_id
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "model", "notes.txt", RUN_FILE]
    assert list((run_dir / "checkpoints").iterdir()) == []


def test_integrity_names_truncated_corrupted_and_missing_files(tmp_path):
    ck = _checkpoint(tmp_path, "step_000001_sft_000000", owner="run-a")
    assert verify_files(ck) == [] and owner_of(ck) == "run-a"
    shard = ck / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])
    assert verify_files(ck) == [f"{shard}: {len(data) - 10} bytes, {len(data)} at save (truncated or overwritten)"]
    shard.write_bytes(b"X" + data[1:])
    assert verify_files(ck) == [f"{shard}: sha256 differs from the one recorded at save (corrupted)"]
    (ck / "common_state.pt").unlink()
    assert len(verify_files(ck)) == 2 and f"{ck / 'common_state.pt'}: missing" in verify_files(ck)
    (ck / "MANIFEST.json").unlink()
    assert "MANIFEST.json: missing or unreadable" in verify_files(ck)[0]


def _ctx(root: Path, run_id: str):
    return SimpleNamespace(owner=SimpleNamespace(checkpoints=root, run_id=run_id, resuming=True))


def test_resume_skips_a_damaged_newest_checkpoint_with_a_warning(tmp_path, caplog):
    root = tmp_path / "ckpts"
    older = _checkpoint(root, "step_000002_sft_000000", owner="run-a")
    newest = _checkpoint(root, "step_000004_sft_000000", owner="run-a")
    _checkpoint(root, "step_000006_sft_000000", owner="run-b")  # another run's: never a candidate
    shard = newest / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:50])
    with caplog.at_level(logging.WARNING):
        assert state.newest_intact(_ctx(root, "run-a")) == older
    assert str(newest) in caplog.text and str(shard) in caplog.text and "truncated" in caplog.text
    assert state.own_checkpoints(_ctx(root, "run-a")) == [older, newest]


def test_resume_with_no_intact_checkpoint_names_every_damaged_file(tmp_path):
    root = tmp_path / "ckpts"
    a = _checkpoint(root, "step_000002_sft_000000", owner="run-a")
    b = _checkpoint(root, "step_000004_sft_000000", owner="run-a")
    for ck in (a, b):
        (ck / "__0_0.distcp").write_bytes(b"garbage")
    before = snapshot(tmp_path)
    with pytest.raises(RunDirError) as err:
        state.newest_intact(_ctx(root, "run-a"))
    assert str(a / "__0_0.distcp") in str(err.value) and str(b / "__0_0.distcp") in str(err.value)
    assert snapshot(tmp_path) == before


def test_msrl_train_refuses_a_directory_of_another_run_before_starting(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "phase": "rl"}\n')
    before = snapshot(tmp_path)
    proc = subprocess.run([*MSRL, "train", str(REPO / "configs/tiny_moe.yaml"), "--set",
                           f"logging.dir={run_dir}", f"model.path={tmp_path / 'model'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and str(run_dir) in proc.stderr and "metrics.jsonl" in proc.stderr
    assert snapshot(tmp_path) == before  # no model was built, nothing written


def test_convert_names_a_bit_flip_in_a_training_checkpoint(tmp_path):
    from megatron_sparse_rl.checkpoint.convert import _check_digests

    ck = _checkpoint(tmp_path, "step_000002_sft_000000", owner="run-a")
    _check_digests(ck)  # intact: no error
    shard = ck / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[7] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="damaged checkpoint files") as err:
        _check_digests(ck)
    assert f"{shard}: sha256 differs" in str(err.value)
