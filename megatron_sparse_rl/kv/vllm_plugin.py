"""The vLLM general plugin `msrl_sparse_kv` (setup.py entry point), inert unless one of our engines asked for it.

vLLM calls every `vllm.general_plugins` entry point in every process it starts (front end, engine core, workers),
for every user of the Python environment this package is installed in. `plugin()` therefore does nothing unless
the process's environment carries `REQUEST_ENV=1`, which `request()` sets in the process that builds a sparse-KV
engine (kv/engine_extension.py `SparseKV.engine_args`, before vLLM starts): the engine's spawned processes inherit
it and install the runner hooks of megatron_sparse_rl.kv.vllm_hooks. A vLLM started by anyone else
finds no request and is left exactly as it was: nothing is imported or patched and nothing is raised, whatever
its version. Asked for, a failed check raises: a sparse engine whose workers lack the hooks would ignore its
compactions silently.

This module imports nothing of vLLM or of this project at import time, so loading the entry point is cheap and
cannot fail a foreign vLLM start.
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

REQUEST_ENV = "MSRL_VLLM_SPARSE_KV"
"""Environment variable through which a process that starts a sparse-KV engine asks the plugin to act ("1")."""


def request() -> None:
    """Ask the plugin to install the sparse-KV runner hooks in the vLLM processes this process starts from now on
    (they inherit the environment). The hooks stay no-ops for dense engines (no `msrl_sparse_kv` settings)."""
    os.environ[REQUEST_ENV] = "1"


def requested() -> bool:
    """Whether this process was started by (or is) a process that builds one of our sparse-KV engines."""
    return os.environ.get(REQUEST_ENV) == "1"


def plugin() -> None:
    """Entry point vLLM calls in each of its processes: apply the sparse-KV hooks if requested, else nothing."""
    if not requested():
        logger.debug("msrl_sparse_kv plugin: not requested by a megatron_sparse_rl engine (%s unset), inert",
                     REQUEST_ENV)
        return
    from megatron_sparse_rl.kv import vllm_hooks

    vllm_hooks.apply()
