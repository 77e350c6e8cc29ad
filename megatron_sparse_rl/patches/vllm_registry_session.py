"""Patch: vLLM's model-registry inspection child starts in a session of its own, so that a stop signal sent to the
trainer's process group during engine start-up does not kill it (vllm 0.32.0, every platform).

The gap it covers
-----------------
`LLM(...)` inspects the model's class in a child Python (vllm/model_executor/models/registry.py
`_run_in_subprocess`: `subprocess.run([python, -m, vllm.model_executor.models.registry])`, "to avoid initializing
CUDA") whenever <VLLM_CACHE_ROOT>/modelinfos lacks the answer: at the first engine start of a model class with a
cold cache (the runs share one: $VLLM_CACHE_ROOT, else <tmp>/msrl_vllm_cache_<uid>). The child runs for seconds in
the trainer's process group, and a stop signal sent to the group kills it: torchrun stops its ranks with killpg (`msrl launch local`, SLURM's torchrun mode), a terminal's
Ctrl-C signals the foreground group. vLLM then fails the start ("Error raised in subprocess ... died with
<Signals.SIGTERM: 15>", then pydantic's "Model architectures ['Qwen3MoeForCausalLM'] failed to be inspected"), so a
stop that ends a run cleanly before its first step (run/stops.py: exit 75) ended it with tracebacks instead.
Seen: `msrl train configs/tiny_moe.yaml` with SIGTERM to its process group as vLLM started exited 1; `msrl launch
local --nproc 2` stopped the same way printed rank 1's traceback, and rank 0 waited until trainer.stop_timeout_s
(300 s) abandoned it.

The fix
-------
`apply()` replaces `registry._run_in_subprocess` with the same function whose child is started with
`start_new_session=True`: only the trainer hears the stop and decides what to do (stop before the first step), and
the child finishes its inspection and exits. A trainer killed outright leaves it to finish on its own, as before.
Nothing else changes (same command, input, output file, error). Idempotent; checks the vLLM version and, through
`megatron_sparse_rl.vllm_access` (feature "registry_session"), the function and command it relies on. The trainer's
engine set-up (training/context.py) applies it; `revert()` exists for tests that show the gap.
"""
from __future__ import annotations

import logging
import os
import pickle
import subprocess
import tempfile

from megatron_sparse_rl import vllm_access

logger = logging.getLogger(__name__)

_MARK = "_msrl_registry_session"


def _target():
    vllm_access.require_version("vllm_registry_session", "check whether vllm/model_executor/models/registry.py "
                                "_run_in_subprocess is unchanged (its child command, input and output file)")
    vllm_access.check(features=("registry_session",))
    from vllm.model_executor.models import registry

    return registry


def _run_in_own_session(fn):
    """vLLM 0.32.0's `_run_in_subprocess`, its child started in a session of its own (module docstring)."""
    import cloudpickle

    registry = _target()
    with tempfile.TemporaryDirectory() as tempdir:
        output_filepath = os.path.join(tempdir, "registry_output.tmp")
        input_bytes = cloudpickle.dumps((fn, output_filepath))
        returned = subprocess.run(registry._SUBPROCESS_COMMAND, input=input_bytes, capture_output=True,
                                  start_new_session=True)
        try:
            returned.check_returncode()
        except Exception as e:
            raise RuntimeError(f"Error raised in subprocess:\n{returned.stderr.decode()}") from e
        with open(output_filepath, "rb") as f:
            return pickle.load(f)


setattr(_run_in_own_session, _MARK, True)


def is_applied() -> bool:
    return getattr(_target()._run_in_subprocess, _MARK, False)


def apply() -> None:
    """Install the patch (idempotent)."""
    registry = _target()
    if is_applied():
        return
    _run_in_own_session._msrl_original = registry._run_in_subprocess
    registry._run_in_subprocess = _run_in_own_session
    logger.debug("patched vllm's model-registry inspection: its child starts in a session of its own")


def revert() -> None:
    """Remove the patch if installed (for tests that show the unpatched behaviour)."""
    registry = _target()
    if is_applied():
        registry._run_in_subprocess = registry._run_in_subprocess._msrl_original
