"""Scheduler side of the sparse-KV integration (vLLM 0.32.0 V1 engine core): compaction with real block
freeing, offset block accounting, admission control, preemption flags.

`SparseKVScheduler` is handed to vLLM as `scheduler_cls` (by `RolloutEngine`); its constructor returns
the async or the sync variant to match `scheduler_config.async_scheduling` (CPU forces sync). Before each
`schedule()`:
- every running request past its prefill whose stored KV length (true length - dropped[req]) reached
  budget + interval is compacted back to `budget`: its block list is cut to cdiv(budget, block_size)
  blocks, the tail blocks go back to the BlockPool, dropped[req] grows by (stored - budget), and a
  command {req_id: (stored, budget)} rides to the worker on the SchedulerOutput (`msrl_sparse_kv`);
- the KV manager's coordinator sees lengths offset by dropped[req] (`_OffsetCoordinator`), so vLLM
  allocates blocks for the compacted length while `request.num_computed_tokens` stays the TRUE count
  (positions, max_model_len, outputs depend on it);
- with admission control, a waiting request is admitted only if the worst-case blocks of the running
  requests and its own still fit the pool, so compressed requests are never preempted; a compressed
  request that is preempted anyway (admission control off) is recomputed densely by vLLM and flagged.
Prefix caching must be off (compaction rewrites blocks in place). Outside its own inherited state (running and
waiting queues, admission limit, requests), vLLM's objects are reached through `vllm_access/`, which
lists and checks every attribute used here; the scheduler checks its live instance at construction.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinatorNoPrefixCache
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from megatron_sparse_rl import vllm_access
from megatron_sparse_rl.kv import vllm_hooks
from megatron_sparse_rl.kv.settings import CONFIG_KEY, SparseKVSettings

logger = logging.getLogger(__name__)


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


class _OffsetCoordinator(KVCacheCoordinatorNoPrefixCache):
    """Block math on the compacted length: every token count of a request is reduced by dropped[req]."""

    msrl_dropped: dict[str, int]

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, num_encoder_tokens,
                                   total_computed_tokens, num_local_computed_tokens, num_tokens_main_model,
                                   apply_admission_cap=False, prefill_end=0):
        d = self.msrl_dropped.get(request_id, 0)
        return super().get_num_blocks_to_allocate(
            request_id, num_tokens - d, new_computed_blocks, num_encoder_tokens, total_computed_tokens - d,
            num_local_computed_tokens - d, num_tokens_main_model - d, apply_admission_cap=apply_admission_cap,
            prefill_end=prefill_end)

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model, num_encoder_tokens=0):
        d = self.msrl_dropped.get(request_id, 0)
        return super().allocate_new_blocks(request_id, num_tokens - d, num_tokens_main_model - d,
                                           num_encoder_tokens)

    def remove_skipped_blocks(self, request_id, processed_computed_tokens, num_prompt_tokens=None):
        d = self.msrl_dropped.get(request_id, 0)
        return super().remove_skipped_blocks(request_id, max(0, processed_computed_tokens - d), num_prompt_tokens)

    def cache_blocks(self, request, num_computed_tokens):
        if self.msrl_dropped.get(request.request_id, 0):
            return  # compacted blocks hold no prefix of the token stream: never hash them
        return super().cache_blocks(request, num_computed_tokens)


class _SparseKVMixin:
    """The sparse-KV behaviour shared by the sync and async variants (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        vllm_access.check_instance(self, ("sparse_kv",))
        self.msrl = SparseKVSettings.from_vllm_config(self.vllm_config)
        if self.msrl is None:
            raise RuntimeError(f"SparseKVScheduler needs additional_config[{CONFIG_KEY!r}] (RolloutEngine sets it)")
        coord, managers = vllm_access.kv_coordinator(self)
        if type(coord) is not KVCacheCoordinatorNoPrefixCache:
            raise RuntimeError(f"sparse KV needs prefix caching off and one KV cache group (got {type(coord).__name__})")
        groups = self.kv_cache_config.kv_cache_groups
        if len(groups) != 1 or len(managers) != 1:
            raise RuntimeError(f"sparse KV supports one full-attention KV cache group (got {len(groups)})")
        if self.defer_block_free:
            raise RuntimeError("sparse KV does not support KV connectors that defer block frees")
        vllm_access.swap_coordinator(coord, _OffsetCoordinator)
        coord.msrl_dropped = self.msrl_dropped = {}
        self.msrl_manager = managers[0]
        self.msrl_pool = vllm_access.block_pool(self)
        self.msrl_block_size = self.msrl_manager.block_size
        self.msrl_preempted_compressed: set[str] = set()
        self.msrl_stats = {"compactions": 0, "blocks_freed": 0, "peak_blocks_in_use": 0, "peak_running": 0,
                           "preemptions": 0, "preempted_compressed": 0}

    def msrl_set_budget(self, budget: int) -> None:
        """Compact to `budget` from now on (rollout.kv.budget_schedule, between generate calls); the commands carry
        it to the worker, and admission control counts budget + interval. Checked by KVConfig's rules."""
        self.msrl = dataclasses.replace(self.msrl, budget=budget,
                                        budget_schedule=dataclasses.replace(self.msrl.budget_schedule, enabled=False))

    # ---- compaction ------------------------------------------------------------------------------
    def _msrl_compact(self) -> dict[str, tuple[int, int]]:
        budget, trigger = self.msrl.budget, self.msrl.budget + self.msrl.interval
        keep_blocks = cdiv(budget, self.msrl_block_size)
        commands: dict[str, tuple[int, int]] = {}
        for req in self.running:
            rid = req.request_id
            if req.is_finished() or req.num_computed_tokens < req.num_prompt_tokens:
                continue  # finished, or prefill still in chunks
            d = self.msrl_dropped.get(rid, 0)
            stored = req.num_computed_tokens - d
            if stored < trigger:
                continue
            blocks = self.msrl_manager.req_to_blocks[rid]
            if len(blocks) != cdiv(stored, self.msrl_block_size):
                raise RuntimeError(f"sparse KV: request {rid} holds {len(blocks)} blocks for {stored} stored tokens")
            tail = blocks[keep_blocks:]
            del blocks[keep_blocks:]
            self.msrl_pool.free_blocks(reversed(tail))
            self.msrl_dropped[rid] = d + stored - budget
            commands[rid] = (stored, budget)
            self.msrl_stats["compactions"] += 1
            self.msrl_stats["blocks_freed"] += len(tail)
        return commands

    # ---- admission control -------------------------------------------------------------------------
    def _msrl_worst_blocks(self, req) -> int:
        """Most blocks `req` can ever hold: its full length if it never reaches the trigger, else the
        larger of its prompt and budget + interval."""
        max_tokens = req.sampling_params.max_tokens if req.sampling_params is not None else 1
        full = req.num_prompt_tokens + (max_tokens or 1)
        peak = min(full, max(req.num_tokens, self.msrl.budget + self.msrl.interval))
        return cdiv(peak, self.msrl_block_size)

    def _msrl_admission_cap(self) -> int | None:
        """How many requests may be running after this step's admissions (None: no cap)."""
        if not self.msrl.admission_control:
            return None
        held = {r.request_id: len(self.msrl_manager.req_to_blocks.get(r.request_id, ())) for r in self.running}
        need = sum(max(0, self._msrl_worst_blocks(r) - held[r.request_id]) for r in self.running)
        room = self.msrl_pool.get_num_free_blocks() - need
        admitted = 0
        for req in list(self.waiting):
            w = self._msrl_worst_blocks(req)
            if w > room:
                break
            room -= w
            admitted += 1
        return len(self.running) + admitted

    # ---- vLLM hooks --------------------------------------------------------------------------------
    def schedule(self, *args, **kwargs):
        commands = self._msrl_compact()
        cap = self._msrl_admission_cap()
        active = self.max_num_active_reqs
        if cap is not None:
            self.max_num_active_reqs = min(active, max(cap, 0))
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            self.max_num_active_reqs = active
        scheduled, _, _ = vllm_access.step_requests(out)
        vllm_access.set_rider(out, {
            "compact": commands,
            "dropped": {rid: self.msrl_dropped[rid] for rid in scheduled if self.msrl_dropped.get(rid)},
        })
        stats = self.msrl_stats
        stats["peak_blocks_in_use"] = max(stats["peak_blocks_in_use"], vllm_access.pool_usage(self.msrl_pool)[0])
        stats["peak_running"] = max(stats["peak_running"], len(self.running))
        return out

    def _preempt_request(self, request, timestamp, drop_stale_output=False):
        rid = request.request_id
        self.msrl_stats["preemptions"] += 1
        if self.msrl_dropped.pop(rid, 0):
            # vLLM recomputes it densely from its token ids; its outputs so far came from a compressed cache.
            self.msrl_preempted_compressed.add(rid)
            self.msrl_stats["preempted_compressed"] += 1
            logger.warning("sparse KV: compressed request %s preempted (recomputed densely; flagged)", rid)
        return super()._preempt_request(request, timestamp, drop_stale_output)

    def _free_request_blocks(self, request):
        self.msrl_dropped.pop(request.request_id, None)
        return super()._free_request_blocks(request)


class _SyncSparseKVScheduler(_SparseKVMixin, Scheduler):
    pass


class _AsyncSparseKVScheduler(_SparseKVMixin, AsyncScheduler):
    pass


class SparseKVScheduler:
    """vLLM `scheduler_cls`: builds the sync or async sparse-KV scheduler to match the engine's config."""

    def __new__(cls, *args: Any, **kwargs: Any):
        if not vllm_hooks.is_applied():
            # the compaction commands would reach a runner without the hooks and be silently ignored
            raise RuntimeError("sparse KV: the model-runner hooks are not installed in this vLLM process; the "
                               "vllm.general_plugins entry point msrl_sparse_kv must load (is it excluded by "
                               "VLLM_PLUGINS? is megatron_sparse_rl pip-installed?), or call "
                               "megatron_sparse_rl.kv.vllm_hooks.apply() before the engine starts")
        vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        variant = _AsyncSparseKVScheduler if vllm_config.scheduler_config.async_scheduling else _SyncSparseKVScheduler
        obj = variant.__new__(variant)
        obj.__init__(*args, **kwargs)
        return obj
