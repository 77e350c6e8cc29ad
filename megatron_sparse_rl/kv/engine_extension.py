"""`SparseKV`: the sparse-KV feature of a `RolloutEngine`, an engine extension (rollout/extension.py).

Built where the run is set up when `rollout.kv.policy` is not "none", and handed to the engine:

    engine = RolloutEngine(model_dir, cfg, extensions=sparse_kv_extensions(cfg.kv))   # [SparseKV()] unless dense
    batch = engine.generate(prompts, sampling)     # batch.features.kv_keep: one KVKeepRecord per row
    sparse_kv_stats(engine), sparse_kv_timing(engine)
    set_sparse_kv_budget(engine, 48)               # later generates compact to 48 (rollout.kv.budget_schedule)

Before vLLM starts it installs the runner hooks in this process (kv/vllm_hooks.py), asks the vLLM plugin to install
them in the engine's spawned processes (kv/vllm_plugin.py) and gives vLLM the sparse-KV scheduler and settings.
After each generate it pops every row's keep record from the worker(s); after each turn of multi-turn episodes it
continues every episode's record with its turn's (`turn_fields`); after re-scoring requests it drops the records
they left. The worker calls below run through `RolloutEngine.apply_worker`.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import torch

from megatron_sparse_rl import vllm_access
from megatron_sparse_rl.kv import vllm_hooks, vllm_plugin
from megatron_sparse_rl.kv.record import KVKeepRecord
from megatron_sparse_rl.kv.settings import SparseKVSettings
from megatron_sparse_rl.kv.vllm_worker import TIMING
from megatron_sparse_rl.rollout.extension import EngineExtension


class SparseKV(EngineExtension):
    """Fixed-budget KV compaction inside the engine's vLLM (see the module docstring)."""

    provides = "sparse_kv"

    def __init__(self):
        self._engine = None

    def vllm_features(self, mla: bool) -> tuple[str, ...]:
        return ("sparse_kv",) + (("sparse_kv_mla",) if mla else ())

    def engine_args(self, cfg) -> dict[str, Any]:
        """vLLM arguments of a sparse-KV engine: its scheduler, the settings both sides read, the runner patch."""
        from megatron_sparse_rl.kv.vllm_scheduler import SparseKVScheduler  # imports vLLM: only for an engine

        vllm_hooks.apply()
        vllm_plugin.request()  # the engine's spawned processes install the hooks through the entry point
        return dict(scheduler_cls=SparseKVScheduler,
                    additional_config=SparseKVSettings.from_kv_config(cfg.kv).to_additional_config())

    def on_started(self, engine) -> None:
        self._engine = engine

    def batch_fields(self, outputs, prompts, samples) -> dict[str, Any]:
        """`kv_keep`: one `KVKeepRecord` per row, popped from the worker."""
        records = self._engine.apply_worker(partial(_take_kv_records, samples=samples))
        return {"kv_keep": tuple(records[key] for key in samples)}

    follows_turns = True

    def turn_fields(self, outputs, prompts: list[list[int]], earlier: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Per row {"kv_keep": the episode's KVKeepRecord so far}: the row's earlier record followed by this turn's
        request's record (`KVKeepRecord.next_turn`; its prompt, the whole episode so far, was prefilled densely)."""
        samples = [(out.request_id, 0) for out in outputs]  # one sample per prompt: vLLM's sample index 0
        records = self._engine.apply_worker(partial(_take_kv_records, samples=samples))
        fields = []
        for out, prompt, before, key in zip(outputs, prompts, earlier, samples):
            record = before.get("kv_keep", KVKeepRecord(lengths=()))
            end = len(prompt) + len(out.outputs[0].token_ids)
            fields.append({"kv_keep": record.next_turn(records[key], len(prompt), end)})
        return fields

    def after_rescore(self) -> None:
        """The scoring requests' (compaction) records: nobody reads them."""
        self._engine.apply_worker(_drop_kv_records)

    def detach(self) -> None:
        self._engine = None


def sparse_kv_extensions(kv) -> list[SparseKV]:
    """The extensions an engine needs for the `rollout.kv` section `kv`: [SparseKV()], or none for dense KV."""
    return [SparseKV()] if kv.policy != "none" else []


def sparse_kv_stats(engine) -> dict[str, int]:
    """The sparse-KV scheduler's counters (compactions, blocks freed, peak blocks in use, peak running,
    preemptions, preempted compressed requests); in-process engine core only."""
    return dict(engine.scheduler().msrl_stats)


def set_sparse_kv_budget(engine, budget: int) -> None:
    """Make the engine's later generates compact to `budget` (rollout.kv.budget_schedule), between generate calls.
    The sparse-KV scheduler holds the budget: its compaction commands carry it to the worker(s), which keep that
    many entries per layer and KV head, and its admission control counts budget + interval. In-process engine core
    only (every CPU engine; a GPU engine with vLLM's engine-core process has no scheduler here)."""
    if not any(ext.provides == "sparse_kv" for ext in engine.extensions):
        raise ValueError("set_sparse_kv_budget: the engine runs a dense KV cache (no sparse-KV extension)")
    if not engine.in_process:
        raise RuntimeError("set_sparse_kv_budget needs the engine core in this process (its scheduler holds the "
                           "budget); rollout.kv.budget_schedule cannot run with vLLM's engine-core process")
    engine.scheduler().msrl_set_budget(budget)


def sparse_kv_timing(engine) -> dict[str, float]:
    """The sparse-KV worker's time since the last call, then reset (`kv.vllm_worker.TIMING`: compactions and
    the seconds spent compacting, scoring, copying and capturing queries); the first engine rank's."""
    return engine.apply_worker(_take_kv_timing)


def _take_kv_records(worker, samples):
    """This engine's keep records of `samples` ((output request id, sample index) each). In a tensor-parallel
    engine each rank's worker holds its own KV heads: the records are gathered over the engine's TP group and
    joined in head order."""
    state = vllm_access.runner_state(vllm_access.model_runner(worker))
    if state is None:  # no step ran with sparse KV yet
        records = {key: KVKeepRecord(lengths=()) for key in samples}
    else:
        records = state.take_records(samples)
    tp_size, tp_group = vllm_access.tensor_parallel_group()
    if tp_size == 1:
        return records
    parts: list = [None] * tp_size
    torch.distributed.all_gather_object(parts, records, group=tp_group)
    return {key: KVKeepRecord.join_heads([p[key] for p in parts]) for key in samples}


def _take_kv_timing(worker) -> dict[str, float]:
    state = vllm_access.runner_state(vllm_access.model_runner(worker))
    return dict.fromkeys(TIMING, 0.0) if state is None else state.take_timing()


def _drop_kv_records(worker):
    """Forget every keep record this worker holds (re-scoring requests leave some that nobody takes)."""
    state = vllm_access.runner_state(vllm_access.model_runner(worker))
    if state is not None:
        state.records.clear()
