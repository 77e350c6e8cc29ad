"""A checkpoint after a stop signal to the rank's process group (patches/megatron_ckpt_queue.py).

torchrun's agent stops its workers by signalling each worker's process group. Megatron-Core's dist-checkpoint writer
kept its results queue in a manager server process of that group, which the signal killed, so the stop's checkpoint
failed. Checks, on a 1-rank learner: after a save the rank has no process of the writer left (nothing a signal to
its group can kill), its results queue is the in-process one, and after SIGTERM and SIGINT to the rank's process
group (the rank itself ignoring them, as the trainer's handlers do) a second save writes a checkpoint that loads back
to the same weights.
Run: .venv/bin/python -m pytest -q tests/distributed/test_ckpt_stop_signal.py
"""
import os
import signal

import pytest

from megatron_sparse_rl.models.tiny import build_tiny_hf_model
from tests import learner_workers as W
from tests.spawn import run_distributed

pytestmark = pytest.mark.distributed


def save_after_signals_worker(rank, world_size, model_dir, root):
    import psutil

    from megatron_sparse_rl.learner.checkpoint import load_learner, save_learner
    from megatron_sparse_rl.patches import megatron_ckpt_queue

    learner = W.make_learner(world_size, model_dir)
    os.setpgid(0, 0)  # a process group of its own, as torchrun gives each worker
    save_learner(learner, f"{root}/first")
    left = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)
            if "resource_tracker" not in " ".join(p.cmdline())]  # multiprocessing's own, not the writer's
    for sig in (signal.SIGTERM, signal.SIGINT):  # what torchrun's agent sends the worker's process group
        previous = signal.signal(sig, signal.SIG_IGN)
        try:
            os.killpg(0, sig)
        finally:
            signal.signal(sig, previous)
    saved = str(save_learner(learner, f"{root}/second"))
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    for p in learner.model.parameters():
        p.data.zero_()
    load_learner(learner, saved)
    same = all(bool((p == before[n]).all()) for n, p in learner.model.named_parameters())
    return left, megatron_ckpt_queue.in_process(), saved, same


def test_a_save_after_sigterm_to_the_process_group_writes(tmp_path):
    model_dir = build_tiny_hf_model(tmp_path / "moe", seed=0)
    # a fresh rank (backend given): it moves to a process group of its own
    left, in_process, saved, same = run_distributed(save_after_signals_worker, 1, args=(str(model_dir), str(tmp_path)),
                                                    timeout=300, backend="gloo")[0]
    assert not left, f"processes of the checkpoint writer outlive the save: {left}"
    assert in_process
    assert saved.endswith("second") and os.path.isdir(saved) and same
