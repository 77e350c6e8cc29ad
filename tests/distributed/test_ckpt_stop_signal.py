"""A checkpoint after a stop signal to the rank's process group (patches/megatron_ckpt_queue.py).

torchrun's agent stops its workers by signalling each worker's process group, which also reaches the server
process of Megatron's dist-checkpoint results queue. Checks, on a 1-rank learner: after a first save, SIGTERM and
SIGINT to the queue's server leave it running and a second save writes a checkpoint that loads back to the same
weights; the server of a process that is killed (SIGKILL, no clean-up) exits on its own.
Run: .venv/bin/python -m pytest -q tests/distributed/test_ckpt_stop_signal.py
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_sparse_rl.models.tiny import build_tiny_hf_model
from tests import learner_workers as W
from tests.spawn import run_distributed

pytestmark = pytest.mark.distributed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def save_after_signals_worker(rank, world_size, model_dir, root):
    from megatron_sparse_rl.learner.checkpoint import load_learner, save_learner
    from megatron_sparse_rl.patches import megatron_ckpt_queue

    learner = W.make_learner(world_size, model_dir)
    save_learner(learner, f"{root}/first")
    server = megatron_ckpt_queue.server_pid()
    for sig in (signal.SIGTERM, signal.SIGINT):  # what torchrun's agent sends the worker's process group
        os.kill(server, sig)
    time.sleep(0.5)
    alive = _alive(server)
    saved = str(save_learner(learner, f"{root}/second"))
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    for p in learner.model.parameters():
        p.data.zero_()
    load_learner(learner, saved)
    same = all(bool((p == before[n]).all()) for n, p in learner.model.named_parameters())
    return alive, saved, same


def test_a_save_after_sigterm_to_the_process_group_writes(tmp_path):
    model_dir = build_tiny_hf_model(tmp_path / "moe", seed=0)
    alive, saved, same = run_distributed(save_after_signals_worker, 1, args=(str(model_dir), str(tmp_path)),
                                         timeout=300)[0]
    assert alive, "the results queue's server died of SIGTERM / SIGINT"
    assert saved.endswith("second") and os.path.isdir(saved) and same


ORPHAN = """
import os, sys, time
from megatron_sparse_rl.patches import megatron_ckpt_queue
megatron_ckpt_queue.apply()
print(megatron_ckpt_queue.server_pid(), flush=True)
time.sleep(600)
"""


def test_the_queue_server_exits_when_its_process_is_killed():
    proc = subprocess.Popen([sys.executable, "-c", ORPHAN], stdout=subprocess.PIPE, text=True)
    try:
        server = int(proc.stdout.readline())
        assert _alive(server)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.time() + 15
    while _alive(server) and time.time() < deadline:
        time.sleep(0.2)
    assert not _alive(server), f"the queue's server {server} outlived its killed parent"
