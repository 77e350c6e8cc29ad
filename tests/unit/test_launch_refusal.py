"""A refusal inside the ranks of a torchrun launch (launch/refusal.py): each rank records it in its torchrun error file
instead of printing it, and `msrl launch local` prints it once as `error: ...` and exits 2, as `msrl train` alone
does, with nothing written (before: one `error:` line per rank, torch's ChildFailedError traceback, exit 1).

    .venv/bin/python -m pytest -q tests/unit/test_launch_refusal.py
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from megatron_sparse_rl.launch.refusal import messages
from megatron_sparse_rl.tools import cli
from tests.msrl import MSRL
from tests.snapshot import snapshot

ROOT = Path(__file__).resolve().parents[2]
TINY_MOE = str(ROOT / "configs" / "tiny_moe.yaml")


def _bad_data(tmp_path: Path) -> Path:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    return bad


def test_a_ranks_refusal_goes_to_its_error_file_and_torch_reads_it_back(tmp_path, monkeypatch, capsys):
    """In a rank (TORCHELASTIC_ERROR_FILE set) `msrl` prints nothing and writes the message where torchrun looks;
    torch's own reader of that file (ProcessFailure) gives back the message, which `messages` picks once."""
    bad = _bad_data(tmp_path)
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    argv = ["validate", TINY_MOE, "--set", f"model.path={tmp_path / 'model'}", f"logging.dir={tmp_path / 'run'}",
            "data.source=jsonl", f"data.path={bad}"]
    assert cli.main(argv) == 2
    assert "error:" not in capsys.readouterr().err
    expected = f"data.path: {bad}:2: missing key 'answer' (need 'prompt' and 'answer'; has ['prompt'])"
    assert json.loads(error_file.read_text())["message"]["message"] == f"error: {expected}"
    failures = {rank: ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=2, error_file=str(error_file))
                for rank in (0, 1)}
    failures[2] = ProcessFailure(local_rank=2, pid=102, exitcode=-15, error_file=str(tmp_path / "none.json"))
    assert messages(failures) == [expected]  # two ranks with the same refusal, one killed: one message
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    assert cli.main(argv) == 2 and capsys.readouterr().err == f"error: {expected}\n"  # alone: printed, as before


@pytest.mark.timeout(300)
def test_launch_local_prints_a_ranks_refusal_once_and_exits_2(tmp_path):
    bad = _bad_data(tmp_path)
    before = snapshot(tmp_path)
    done = subprocess.run([*MSRL, "launch", "local", TINY_MOE, "--nproc", "2", "--set",
                           f"model.path={tmp_path / 'model'}", f"logging.dir={tmp_path / 'run'}", "data.source=jsonl",
                           f"data.path={bad}"], cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-4000:]
    assert "Traceback" not in done.stdout + done.stderr
    errors = [line for line in (done.stdout + done.stderr).splitlines() if "error:" in line]
    assert errors == [f"error: data.path: {bad}:2: missing key 'answer' (need 'prompt' and 'answer'; has ['prompt'])"]
    assert snapshot(tmp_path) == before  # no run directory, no tiny model: Megatron and vLLM never started
