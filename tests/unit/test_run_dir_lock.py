"""One run per directory (run/run_dir.py, run/lock.py): a live run's directory is refused naming its
process, with nothing written by the refused one; so is a checkpoint directory a live run uses (`checkpoint.dir`,
or another run's default <logging.dir>/checkpoints), also by `msrl train` before anything starts; a run killed with
SIGKILL leaves a lock that is taken over; a forked child does not keep its parent's lock; `logging.overwrite`
removes only what a run recorded that it wrote; a degenerate `logging.dir` is refused when the config is read (so
`msrl validate` refuses it too).

    .venv/bin/python -m pytest -q tests/unit/test_run_dir_lock.py
"""
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from megatron_sparse_rl.config import ConfigError, load_config
from megatron_sparse_rl.learner.integrity import digest_files, write_manifest
from megatron_sparse_rl.run.run_dir import RUN_FILE, RunDirError, claim
from tests.msrl import MSRL
from tests.snapshot import snapshot

REPO = Path(__file__).resolve().parents[2]

# A process that claims `logging.dir` the way rank 0 of `msrl train` does, says so, then waits (or forks a child
# that outlives it, with FORK=1). It prints its pid or the refusal.
HOLDER = textwrap.dedent("""
    import os, sys, time
    from megatron_sparse_rl.config import load_config
    from megatron_sparse_rl.run.run_dir import RunDirError, claim
    run = load_config(sys.argv[1], sys.argv[2:])
    try:
        owner = claim(run)
    except RunDirError as e:
        print("refused", e, flush=True)
        sys.exit(2)
    child = os.fork() if os.environ.get("FORK") == "1" else None
    if child == 0:
        time.sleep(60)  # a child (an engine process) outliving its parent
        os._exit(0)
    print("claimed", os.getpid(), child or "", flush=True)
    time.sleep(float(os.environ.get("HOLD_S", "60")))
""")


def _sets(tmp_path: Path, *extra: str) -> list[str]:
    return [f"logging.dir={tmp_path / 'run'}", f"model.path={tmp_path / 'model'}", *extra]


def _run(tmp_path: Path, *extra: str):
    return load_config(REPO / "configs/tiny_moe.yaml", _sets(tmp_path, *extra))


def _holder(tmp_path: Path, *extra: str, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HOLDER, str(REPO / "configs/tiny_moe.yaml"),
                             *_sets(tmp_path, *extra)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **env})


def _wait_claimed(proc: subprocess.Popen) -> list[int]:
    line = proc.stdout.readline().split()
    assert line and line[0] == "claimed", (line, proc.stderr.read()[-2000:] if proc.poll() is not None else "")
    return [int(x) for x in line[1:]]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def test_a_live_runs_directory_is_refused_naming_its_process_and_nothing_is_written(tmp_path):
    first = _holder(tmp_path)
    try:
        [pid] = _wait_claimed(first)
        before = snapshot(tmp_path)
        with pytest.raises(RunDirError) as err:
            claim(_run(tmp_path))
        msg = str(err.value)
        assert f"process {pid} on host" in msg and str(tmp_path / "run") in msg and "-c" in msg
        assert "logging.dir=" in msg
        assert snapshot(tmp_path) == before  # listing and checksums: the refused start wrote nothing
    finally:
        _stop(first)


def test_two_runs_started_at_once_one_is_refused_naming_the_other(tmp_path):
    procs = [_holder(tmp_path, HOLD_S="8") for _ in range(2)]
    try:
        lines = sorted(p.stdout.readline().strip() for p in procs)
    finally:
        for p in procs:
            _stop(p)
    claimed, refused = lines[0], lines[1]
    assert claimed.startswith("claimed ") and refused.startswith("refused "), lines
    assert f"process {claimed.split()[1]} on host" in refused and str(tmp_path / "run") in refused
    record = json.loads((tmp_path / "run" / RUN_FILE).read_text())
    assert record["holder"]["pid"] == int(claimed.split()[1])
    # one run's record and its checkpoint directory (made and locked when it claims), nothing of the refused one
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoints", RUN_FILE]


CKPT_REFUSAL = ("{field} {path!r} is in use by a live run: process {pid} on host {host}, command: {command}. Wait "
               "for it to finish or stop it, or give this run a checkpoint directory of its own (--set "
               "checkpoint.dir=...): two runs must not share one")


@pytest.mark.parametrize("case", ["both set it", "the live run's default", "this run's default"])
def test_a_checkpoint_dir_a_live_run_uses_is_refused_naming_it_and_nothing_is_written(tmp_path, case):
    """Two runs in different logging.dir sharing one checkpoint directory: the second is refused, naming the
    setting, the directory and the live run's process, whichever run names the directory and whichever takes the
    default (before, only logging.dir was locked and both started)."""
    shared = {"both set it": tmp_path / "shared", "the live run's default": tmp_path / "run" / "checkpoints",
              "this run's default": tmp_path / "second" / "checkpoints"}[case]
    first_sets = [] if case == "the live run's default" else [f"checkpoint.dir={shared}"]
    second_sets = [f"logging.dir={tmp_path / 'second'}"] + ([] if case == "this run's default"
                                                            else [f"checkpoint.dir={shared}"])
    first = _holder(tmp_path, *first_sets)
    try:
        [pid] = _wait_claimed(first)
        before = snapshot(tmp_path)
        with pytest.raises(RunDirError) as err:
            claim(_run(tmp_path, *second_sets))
        field = "checkpoint.dir (default <logging.dir>/checkpoints)" if case == "this run's default" else \
            "checkpoint.dir"
        command = " ".join(psutil.Process(pid).cmdline())[:500]  # a holder's command line is kept to 500 characters
        assert str(err.value) == CKPT_REFUSAL.format(field=field, path=str(shared), pid=pid,
                                                     host=socket.gethostname(), command=command)
        assert snapshot(tmp_path) == before  # the second run's logging.dir was made for its lock, and removed
    finally:
        _stop(first)


def test_msrl_train_refuses_a_shared_checkpoint_dir_before_anything_starts(tmp_path):
    shared = tmp_path / "shared"
    first = _holder(tmp_path, f"checkpoint.dir={shared}")
    try:
        [pid] = _wait_claimed(first)
        before = snapshot(tmp_path)
        done = subprocess.run([*MSRL, "train", str(REPO / "configs/tiny_moe.yaml"), "--set",
                               f"logging.dir={tmp_path / 'second'}", f"model.path={tmp_path / 'model'}",
                               f"checkpoint.dir={shared}"], cwd=REPO, capture_output=True, text=True, timeout=200)
    finally:
        _stop(first)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: checkpoint.dir {str(shared)!r} is in use by a live "
                                                     f"run: process {pid} on host"), errors
    assert snapshot(tmp_path) == before  # no second run directory, no tiny model: Megatron and vLLM never started


def test_a_run_killed_with_sigkill_leaves_a_lock_that_is_taken_over(tmp_path, caplog):
    first = _holder(tmp_path)
    [pid] = _wait_claimed(first)
    run_id = json.loads((tmp_path / "run" / RUN_FILE).read_text())["run_id"]
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    with caplog.at_level(logging.INFO, logger="megatron_sparse_rl.run.run_dir"):
        owner = claim(_run(tmp_path))
    assert owner.resuming and owner.run_id == run_id and owner.lock.held
    assert f"process {pid} on host" in caplog.text and "no longer running" in caplog.text
    assert json.loads((tmp_path / "run" / RUN_FILE).read_text())["holder"]["pid"] == os.getpid()


def test_a_forked_child_does_not_keep_the_lock_of_a_dead_parent(tmp_path):
    first = _holder(tmp_path, FORK="1")
    _, child = _wait_claimed(first)
    first.send_signal(signal.SIGKILL)  # the parent dies; its forked child (an engine process) lives on
    first.wait(timeout=30)
    try:
        os.kill(child, 0)  # still alive
        owner = claim(_run(tmp_path))
        assert owner.resuming and owner.lock.held
    finally:
        os.kill(child, signal.SIGKILL)


def test_the_claiming_process_shares_its_own_lock(tmp_path):
    first = claim(_run(tmp_path))
    again = claim(_run(tmp_path))
    assert first.lock.held and not again.lock.held and again.run_id == first.run_id


def _own_checkpoint(root: Path, name: str, owner: str) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"weights" * 10)
    write_manifest(path, digest_files(path), owner=owner)
    (path / "COMPLETE").write_text("ok\n")
    return path


def test_overwrite_removes_what_the_previous_run_wrote_and_keeps_a_users_files(tmp_path):
    first = claim(_run(tmp_path))
    run_dir = tmp_path / "run"
    (run_dir / "metrics.jsonl").write_text("{}\n")
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "rank0.log").write_text("log\n")
    _own_checkpoint(run_dir / "checkpoints", "step_000001_sft_000000", first.run_id)
    (run_dir / "checkpoints" / ".step_000002_sft_000000.tmp").mkdir()  # a save it did not finish
    (run_dir / "notes.txt").write_text("the user's")
    (run_dir / "data").mkdir()
    (run_dir / "data" / "prompts.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    users = {k: v for k, v in snapshot(run_dir).items() if k.startswith(("notes", "data"))}
    second = claim(_run(tmp_path, "logging.overwrite=true"))
    assert not second.resuming
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoints", "data", "notes.txt", RUN_FILE]
    assert list((run_dir / "checkpoints").iterdir()) == []
    assert {k: v for k, v in snapshot(run_dir).items() if k.startswith(("notes", "data"))} == users


def test_overwrite_refuses_files_no_run_recorded_and_removes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')  # no run.json: nobody recorded writing it
    before = snapshot(tmp_path)
    with pytest.raises(RunDirError) as err:
        claim(_run(tmp_path, "logging.overwrite=true"))
    assert str(run_dir / "metrics.jsonl") in str(err.value) and "never anyone else's" in str(err.value)
    assert snapshot(tmp_path) == before


def test_overwrite_never_removes_another_runs_checkpoint_in_a_shared_checkpoint_dir(tmp_path):
    shared = tmp_path / "shared"
    mine = claim(_run(tmp_path, f"checkpoint.dir={shared}"))
    _own_checkpoint(shared, "step_000001_sft_000000", mine.run_id)
    other = _own_checkpoint(shared, "step_000002_sft_000000", "another-run")
    before = snapshot(tmp_path)
    with pytest.raises(RunDirError) as err:
        claim(_run(tmp_path, f"checkpoint.dir={shared}", "logging.overwrite=true"))
    assert str(other) in str(err.value)
    assert snapshot(tmp_path) == before  # refused before removing anything, its own checkpoint included


@pytest.mark.parametrize("where", ["", " ", ".", "/", "home", "cwd", "parent", "repo", "file"])
def test_a_degenerate_logging_dir_is_refused_when_the_config_is_read(tmp_path, monkeypatch, where):
    work = tmp_path / "work"
    work.mkdir()
    (work / "a_file").write_text("x")
    monkeypatch.chdir(work)
    value = {"home": str(Path.home()), "cwd": str(work), "parent": "..", "repo": str(REPO),
             "file": "a_file"}.get(where, where)
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs/tiny_moe.yaml", [f"logging.dir={value!r}"])
    msg = str(err.value)
    assert msg.startswith("logging.dir") and "allowed: a directory of its own" in msg
    assert snapshot(tmp_path) == before


def test_msrl_validate_refuses_a_degenerate_logging_dir(capsys):
    from megatron_sparse_rl.tools.cli import main

    assert main(["validate", str(REPO / "configs/tiny_moe.yaml"), "--no-files", "--set", "logging.dir=/"]) == 2
    err = capsys.readouterr().err
    assert "error: logging.dir '/' is the filesystem root" in err and "Traceback" not in err
