"""A run's listening sockets, read from the kernel (psutil, tests/sockets.py) every 0.2 s while it runs: a
one-process `msrl train` listens on loopback only (before: its store on every interface). Tiny MoE on CPU, one RL
step. The disaggregated `msrl launch local --nproc 2` (torchrun's agent, a learner rank and a rollout rank) is
checked the same way in tests/e2e/test_trainer_disaggregated.py (`test_launch_listens_on_loopback_only`, on the
launch it runs anyway).

    .venv/bin/python -m pytest -q -m e2e tests/e2e/test_ports.py
"""
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.msrl import MSRL
from tests.sockets import off_loopback, sample_listeners

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def _sets(run_dir: Path, model_dir: Path) -> list[str]:
    return [f"logging.dir={run_dir}", f"model.path={model_dir}", "trainer.steps=1", "trainer.prompts_per_step=2",
            "trainer.eval_prompts=2", "rollout.sampling.n=2", "rollout.sampling.max_tokens=4",
            "rollout.max_model_len=64", "checkpoint.save_every=0", "logging.tensorboard=false"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("model") / "tiny"


def _run_and_sample(cmd: list[str]) -> set:
    env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}  # the defaults under test
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = sample_listeners(proc, timeout=300)
    out = proc.stdout.read()
    assert proc.returncode == 0, out[-3000:]
    return seen


def _rl_steps(run_dir: Path) -> list[int]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["step"] for r in records if r["phase"] == "rl"]


@pytest.mark.slow  # `make test-all` only (37 s): the disaggregated launch (module docstring) checks the same on three
# processes
def test_train_in_one_process_listens_on_loopback_only(tmp_path, model_dir):
    run_dir = tmp_path / "run"
    seen = _run_and_sample([*MSRL, "train", str(REPO / "configs/tiny_moe.yaml"),
                            "--set", *_sets(run_dir, model_dir)])
    assert _rl_steps(run_dir) == [1]
    assert seen, "the run's store should have been seen listening"
    assert not off_loopback(seen), off_loopback(seen)

