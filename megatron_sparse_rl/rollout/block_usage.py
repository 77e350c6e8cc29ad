"""`BlockUsageProbe`: vLLM's own count of KV blocks in use and of running requests, step by step.

Wraps `schedule()` of one in-process engine's scheduler instance (dense or sparse) and reads the block
pool after each step's allocations: blocks in use = pool size - 1 (vLLM's null block) - free blocks.
Used by `RolloutEngine.generate` (RolloutBatch.kv_usage), the sparse-KV tests and `msrl bench kv`.

    with BlockUsageProbe(engine) as probe:
        engine.generate(...)
    probe.peak_blocks, probe.peak_running, probe.mean_waiting, probe.steps
"""
from __future__ import annotations

from megatron_sparse_rl import vllm_access


class BlockUsageProbe:
    def __init__(self, engine):
        self.scheduler = engine.scheduler()
        self.pool = vllm_access.block_pool(self.scheduler)
        self.blocks: list[int] = []
        self.running: list[int] = []
        self.waiting: list[int] = []
        self.preemptions = 0

    @property
    def pool_blocks(self) -> int:
        """Usable blocks of the pool (vLLM's null block excluded)."""
        return vllm_access.pool_usage(self.pool)[1]

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
    def mean_waiting(self) -> float:
        """Requests waiting (not admitted yet, or preempted) per step, averaged over the steps."""
        return sum(self.waiting) / max(len(self.waiting), 1)

    @property
    def mean_blocks(self) -> float:
        """Blocks in use per step, averaged over the steps."""
        return sum(self.blocks) / max(len(self.blocks), 1)

    @property
    def steps(self) -> int:
        return len(self.blocks)

    def __enter__(self) -> "BlockUsageProbe":
        vllm_access.wrap_schedule(self.scheduler, self._after_step)
        return self

    def _after_step(self, out) -> None:
        self.blocks.append(vllm_access.pool_usage(self.pool)[0])
        self.running.append(vllm_access.num_running(self.scheduler))
        self.waiting.append(vllm_access.num_waiting(self.scheduler))
        self.preemptions += len(vllm_access.preempted_requests(out))

    def __exit__(self, *exc) -> None:
        vllm_access.unwrap_schedule(self.scheduler)
