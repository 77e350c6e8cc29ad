"""vLLM internals reached while an engine runs: the engine core and scheduler behind an `LLM`, request ids, the
model runner, its model and per-step batch (`StepContext`), the sampler, the block pool, and the platform and
version checks of the CPU patches. Part of `vllm_access` (re-exported there; its `NEEDS` table lists what these
rely on)."""
from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_sparse_rl.vllm_access.base import RUNNER, STATE, VLLM_VERSION, fail, resolve


# ---- engine (driver process) ------------------------------------------------------------------------------
def scheduler(llm):
    """The scheduler instance of an in-process `LLM` (the sparse-KV one when sparse KV is on)."""
    client = llm.llm_engine.engine_core
    core = getattr(client, "engine_core", client)
    if not hasattr(core, "scheduler"):
        fail(f"LLM.llm_engine.engine_core ({type(core).__name__}).scheduler", "is missing (an in-process engine core "
              "is needed: VLLM_ENABLE_V1_MULTIPROCESSING=0)", "engine")
    return core.scheduler


def has_in_process_scheduler(llm) -> bool:
    """Whether `scheduler(llm)` is reachable (the engine core runs in this process)."""
    client = llm.llm_engine.engine_core
    return hasattr(getattr(client, "engine_core", client), "scheduler")


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


# ---- request ids ---------------------------------------------------------------------------------------------
# vLLM 0.32 internal request ids: "<external>-<8 hex>" (input processor), children of n > 1:
# "<index>_<external>-<8 hex>" (parallel sampling).
_INTERNAL_ID = re.compile(r"^(?:(\d+)_)?(.+)-[0-9a-f]{8}$")


def request_key(internal_id: str) -> tuple[str, int] | None:
    """(output request id, sample index) of a vLLM internal request id; None if it does not parse."""
    m = _INTERNAL_ID.match(internal_id)
    return None if m is None else (m.group(2), int(m.group(1) or 0))


def output_token_counts(llm) -> dict[tuple[str, int], int]:
    """{(output request id, sample index): output tokens so far} of every unfinished request of an in-process
    engine core (between engine steps)."""
    out = {}
    for internal_id, request in scheduler(llm).requests.items():
        key = request_key(internal_id)
        if key is None:
            fail("Scheduler.requests", f"holds a request id {internal_id!r} that does not parse", "in_flight")
        out[key] = int(request.num_output_tokens)
    return out


# ---- worker: runner, model, weights, this project's state on the runner ---------------------------------
def model_runner(worker):
    return worker.model_runner


def model_runner_class() -> type:
    """The V1 model runner class (the CPU runner subclasses it)."""
    return resolve(RUNNER)


def model(runner) -> torch.nn.Module:
    return runner.get_model()


def uses_mla(llm) -> bool:
    """Whether an in-process `LLM` runs multi-head latent attention (one latent KV row per token and layer shared
    by all heads), as opposed to per-head K/V (also an MLA model under VLLM_MLA_DISABLE=1)."""
    return bool(llm.llm_engine.model_config.use_mla)


_RELOAD_LOGGERS = tuple(f"vllm.model_executor.model_loader.reload.{m}" for m in ("layerwise", "inplace"))
_PARTIAL_RELOAD = ("Failed to load weights", "Following weights were not loaded from checkpoint")


def _partial_reload_to_debug(record: logging.LogRecord) -> bool:
    """vLLM's reload warns for every layer a load leaves out (and lists every tensor it left out): what a sync of a
    subset does on purpose (a LoRA learner's adapted tensors, weight_sync/scope.py), so those are DEBUG here. The
    syncs' checksums and the probe check what the engine holds; the layers left out keep their weights."""
    if record.levelno == logging.WARNING and any(m in str(record.msg) for m in _PARTIAL_RELOAD):
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
    return True


def reload_weights(worker, weights) -> None:
    """Load HF-named `weights` (the whole model or a subset) in place through vLLM's layerwise reload."""
    loggers = [logging.getLogger(name) for name in _RELOAD_LOGGERS]
    for logger in loggers:
        logger.addFilter(_partial_reload_to_debug)
    try:
        worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    finally:
        for logger in loggers:
            logger.removeFilter(_partial_reload_to_debug)


def runner_state(runner, default=None):
    """The sparse-KV state kept on a model runner (`default` if none was set)."""
    return vars(runner).get(STATE, default)


def set_runner_state(runner, state) -> None:
    setattr(runner, STATE, state)


def tensor_parallel_group() -> tuple[int, Any]:
    """(size, CPU process group) of this worker's engine tensor-parallel group."""
    from vllm.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    return tp.world_size, tp.cpu_group


# ---- the per-step batch (route and sampling-mask captures) ---------------------------------------------
@dataclass(frozen=True)
class StepContext:
    """One engine step's flat token batch as the model's forward sees it. req_ids: internal request ids in batch
    order; starts: [len(req_ids) + 1] row offsets per request; input_ids, positions: [starts[-1]] views."""

    req_ids: list[str]
    starts: list[int]
    input_ids: torch.Tensor | None
    positions: torch.Tensor


def on_model_forward(runner, hook: Callable) -> Any:
    """Register `hook(module, args, kwargs)` before every forward of the runner's model; returns the handle."""
    return model(runner).register_forward_pre_hook(hook, with_kwargs=True)


def step_context(runner, forward_kwargs: dict) -> StepContext:
    """The step the runner's model is about to run (call from an `on_model_forward` hook)."""
    n = runner.input_batch.num_reqs
    starts = runner.query_start_loc.cpu[:n + 1].tolist()
    ids = forward_kwargs.get("input_ids")
    return StepContext(req_ids=list(runner.input_batch.req_ids[:n]), starts=starts,
                       input_ids=None if ids is None else ids[:starts[-1]],
                       positions=forward_kwargs["positions"][:starts[-1]])


# ---- sampler ---------------------------------------------------------------------------------------------
def sampler(runner) -> tuple[Any, str | None]:
    """(the runner's vLLM Sampler, its logprobs mode), or (None, None)."""
    s = getattr(runner, "sampler", None)
    return (s, s.logprobs_mode) if s is not None and hasattr(s, "sample") else (None, None)


def wrap_sample(s, on_sample: Callable[[torch.Tensor, torch.Tensor | None], None]) -> None:
    """Call `on_sample(sampled token ids, processed logprobs)` after every `s.sample`; `unwrap_sample` undoes it."""
    _call_after(s, "sample", lambda out: on_sample(*out))


def unwrap_sample(s) -> None:
    _undo_call_after(s, "sample")


def _call_after(obj, method: str, after: Callable[[Any], None]) -> None:
    """Shadow `obj.<method>` with an instance attribute that calls `after(result)` before returning it."""
    original = getattr(obj, method)

    def wrapped(*args, **kwargs):
        out = original(*args, **kwargs)
        after(out)
        return out

    wrapped._msrl_previous = obj.__dict__.get(method)  # an enclosing wrap to restore (None: the class method)
    setattr(obj, method, wrapped)


def _undo_call_after(obj, method: str) -> None:
    """Undo the latest `_call_after` of `obj.<method>`: wraps nest, so the wrap before it comes back (or, after the
    first, the class method)."""
    previous = getattr(obj.__dict__.get(method), "_msrl_previous", None)
    if previous is None:
        obj.__dict__.pop(method, None)
    else:
        setattr(obj, method, previous)


def block_pool(sched):
    return sched.kv_cache_manager.block_pool


def pool_usage(pool) -> tuple[int, int]:
    """(blocks taken, usable blocks) of a block pool (vLLM's null block excluded)."""
    usable = pool.num_gpu_blocks - 1
    return usable - pool.get_num_free_blocks(), usable


def wrap_schedule(sched, after: Callable[[Any], None]) -> None:
    """Call `after(scheduler_output)` after every `schedule()` of this scheduler; `unwrap_schedule` undoes it."""
    _call_after(sched, "schedule", after)


def unwrap_schedule(sched) -> None:
    """Undo the latest `wrap_schedule` (wraps nest: a probe around `generate`, whose own probe wraps inside it)."""
    _undo_call_after(sched, "schedule")


def num_running(sched) -> int:
    return len(sched.running)


def num_waiting(sched) -> int:
    """Requests added but not running (not admitted yet, or preempted)."""
    return len(sched.waiting)


def require_version(patch: str, what_to_check: str) -> None:
    """RuntimeError unless the installed vLLM is the version the `patch` module was written for; the message says
    what to check before updating it."""
    import vllm

    if vllm.__version__ != VLLM_VERSION:
        raise RuntimeError(f"patches.{patch} was written for vllm {VLLM_VERSION} (found {vllm.__version__}): "
                           f"{what_to_check}, then update this patch")


def is_cpu_platform() -> bool:
    """Whether vLLM runs on its CPU platform here."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
