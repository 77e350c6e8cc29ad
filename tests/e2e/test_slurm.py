"""A real single-node SLURM cluster (munged + slurmctld + slurmd, launch/local_slurm.py) running jobs
submitted by `msrl launch slurm`: torchrun mode, srun mode, and preemption -> checkpoint request -> requeue.

    .venv/bin/python -m pytest -q tests/e2e/test_slurm.py

SLURM missing: installed with apt-get when running as root and CI or MSRL_INSTALL_SLURM=1 allows it (and
Debian's mirror is reachable); otherwise the tests skip saying why. About 40 s with SLURM installed.

The completed jobs run the real trainer (`msrl train`, 2 ranks, 2 steps) and must leave its metrics and
HF export; the preemption test holds launch/probe.py (config load + validate, gloo rendezvous) in a loop
until SIGUSR1 arrives.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from megatron_sparse_rl.launch import local_slurm
from tests.msrl import MSRL

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
# the real trainer, 2 ranks (data parallel, one colocated vLLM engine each), kept tiny
JOB = ["trainer.steps=2", "trainer.prompts_per_step=4", "trainer.eval_prompts=8", "rollout.sampling.n=4",
       "rollout.sampling.max_tokens=6", "rollout.max_model_len=64", "logging.tensorboard=false"]


def _mirror_reachable() -> bool:
    try:
        socket.create_connection(("deb.debian.org", 80), timeout=3).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    missing = local_slurm.missing_binaries()
    if missing:
        allowed = os.geteuid() == 0 and (os.environ.get("CI") or os.environ.get("MSRL_INSTALL_SLURM") == "1")
        if not allowed:
            pytest.skip(f"SLURM not installed (missing {', '.join(missing)}); run as root with CI=1 or "
                        f"MSRL_INSTALL_SLURM=1 to apt-get install {' '.join(local_slurm.PACKAGES)}")
        if not _mirror_reachable():
            pytest.skip("SLURM not installed and deb.debian.org is unreachable: cannot apt-get install it")
        local_slurm.install()
    with local_slurm.LocalSlurm(tmp_path_factory.mktemp("slurm")) as c:
        yield c


def _config(tmp: Path, **launch) -> Path:
    cfg = tmp / "job.yaml"
    cfg.write_text(json.dumps({"model": {"path": str(tmp / "model"), "tiny": {}},
                               "logging": {"dir": str(tmp / "run")}, "launch": {"nproc_per_node": 2, **launch}}))
    return cfg


def _msrl(args: list[str], env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*MSRL, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _slurm_sets(mode: str, *extra: str) -> list[str]:
    sets = [f"launch.slurm.partition={local_slurm.PARTITION}", "launch.slurm.gpus_per_node=0",
            "launch.slurm.exclusive=false", f"launch.slurm.venv={REPO / '.venv'}", f"launch.slurm.mode={mode}",
            "launch.slurm.time=00:05:00", *JOB, *extra]
    return [a for s in sets for a in ("--set", s)]


# torchrun mode is `make test-all` only (76 s on the 2-core CI machine): srun mode runs the same job in `make test`,
# and torchrun itself is in every `msrl launch local` test
@pytest.mark.parametrize("mode", [pytest.param("torchrun", marks=pytest.mark.slow), "srun"])
def test_job_runs_to_completion(cluster, tmp_path, mode):
    cfg = _config(tmp_path)
    r = _msrl(["launch", "slurm", str(cfg), "--wait", *_slurm_sets(mode)], cluster.env(), timeout=400)
    logs = "\n".join(p.read_text() for p in (tmp_path / "run" / "slurm").glob("*.out"))
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}\njob log:\n{logs}\n{cluster.logs()}"
    assert "submitted job" in r.stdout and "ranks finished with exit code 0" in logs
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["phase"] == "rl"] == [1, 2]
    assert (tmp_path / "run" / "hf_final" / "config.json").is_file()


def test_failing_job_exit_code_reaches_msrl(cluster, tmp_path):
    cfg = _config(tmp_path)  # every rank fails at once: the program's module does not exist
    missing = "megatron_sparse_rl.launch.no_such_module"
    r = _msrl(["launch", "slurm", str(cfg), "--wait", *_slurm_sets("srun", f"launch.program={missing}")], cluster.env())
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "slurm").glob("*.out"))
    assert r.returncode == 1, r.stdout + r.stderr + logs
    assert f"No module named {missing}" in logs and "ranks finished with exit code 1" in logs
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def _job_field(env: dict, job: str, field: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    for tok in out.split():
        if tok.startswith(field + "="):
            return tok.split("=", 1)[1]
    return ""


def test_preemption_signal_checkpoints_then_requeues(cluster, tmp_path):
    cfg = _config(tmp_path)
    probe = "launch.program=megatron_sparse_rl.launch.probe --hold 60"
    r = _msrl(["launch", "slurm", str(cfg), *_slurm_sets("srun", probe)], cluster.env())
    assert r.returncode == 0, r.stdout + r.stderr
    job = r.stdout.split("submitted job ")[1].split()[0]
    env, log_dir = cluster.env(), tmp_path / "run" / "slurm"
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline and "msrl: job" not in "".join(p.read_text() for p in log_dir.glob("*.out")):
        time.sleep(0.5)
    time.sleep(3)  # let the ranks reach their hold loop
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, check=True)
    while time.monotonic() < deadline and _job_field(env, job, "Restarts") in ("", "0"):
        time.sleep(0.5)
    logs = "".join(p.read_text() for p in log_dir.glob("*.out"))
    subprocess.run(["scancel", job], env=env)
    assert _job_field(env, job, "Restarts") == "1", f"job log:\n{logs}\n{cluster.logs()}"
    assert "USR1 received" in logs and "requeueing job" in logs
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1] == {"event": "preempted"}
