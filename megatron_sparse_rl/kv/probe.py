"""`BlockUsageProbe`: vLLM's own count of KV blocks in use and of running requests, step by step.

Wraps `schedule()` of one in-process engine's scheduler instance (dense or sparse) and reads the block
pool after each step's allocations: blocks in use = pool size - 1 (vLLM's null block) - free blocks.
Used by the sparse-KV tests and `msrl bench kv`.

    with BlockUsageProbe(engine) as probe:
        engine.generate(...)
    probe.peak_blocks, probe.peak_running, probe.steps
"""
from __future__ import annotations


class BlockUsageProbe:
    def __init__(self, engine):
        core = engine._llm.llm_engine.engine_core
        self.scheduler = getattr(core, "engine_core", core).scheduler
        self.pool = self.scheduler.kv_cache_manager.block_pool
        self.blocks: list[int] = []
        self.running: list[int] = []
        self.preemptions = 0

    @property
    def pool_blocks(self) -> int:
        """Usable blocks of the pool (vLLM's null block excluded)."""
        return self.pool.num_gpu_blocks - 1

    @property
    def peak_blocks(self) -> int:
        return max(self.blocks, default=0)

    @property
    def peak_running(self) -> int:
        return max(self.running, default=0)

    @property
    def mean_running(self) -> float:
        """Requests running per step, averaged over the steps."""
        return sum(self.running) / max(len(self.running), 1)

    @property
    def steps(self) -> int:
        return len(self.blocks)

    def __enter__(self) -> "BlockUsageProbe":
        schedule = self.scheduler.schedule

        def probed(*args, **kwargs):
            out = schedule(*args, **kwargs)
            self.blocks.append(self.pool_blocks - self.pool.get_num_free_blocks())
            self.running.append(len(self.scheduler.running))
            self.preemptions += len(getattr(out, "preempted_req_ids", ()) or ())
            return out

        self.scheduler.schedule = probed
        return self

    def __exit__(self, *exc) -> None:
        del self.scheduler.schedule  # back to the class method
