"""Configuration of the RL loop (`msrl train`): step counts, batch shapes, the SFT warm-start stage,
evaluation and weight sync."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from megatron_sparse_rl.config.checks import MAX_BATCH, MAX_SAMPLES, MAX_STEPS
from megatron_sparse_rl.config.checks import check as _check
from megatron_sparse_rl.config.checks import require_range as _range
from megatron_sparse_rl.config.rollout import check_temperature


InFlightKV = Literal["keep", "recompute"]
SFTKVKeys = Literal["dense", "sequential"]
SFT_KV_POLICIES = ("rkv", "snapkv", "streamingllm")
"""The rollout.kv policies sparsity-aware SFT replays (kv/simulate.py); H2O's accumulated attention is not."""
StalePolicy = Literal["drop", "recompute"]

MAX_SYNC_BUCKET_MB = float(1 << 20)
"""The largest trainer.sync_bucket_mb (1 TiB: a bucket is staged whole in memory)."""
MAX_STALENESS = 8
"""The largest trainer.max_staleness: the rollout rank holds that many batches ahead of the learner (docs/async.md)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class SFTKVKeepConfig:
    """Sparsity-aware SFT (`trainer.sft.kv_keep`, off by default; docs/sparse_kv.md "Sparsity-aware SFT"): each SFT
    row is trained under the keep sets the run's own sparse engine (rollout.kv: policy, budget, window, interval)
    would make on that teacher-forced sequence, through the learner's per-layer attention masks, so the warm start
    learns to answer from a compressed cache."""

    enabled: bool = False
    """Train the SFT stage under the simulated keep sets. Needs rollout.kv.policy rkv, snapkv or streamingllm and
    a learner at parallel.tp = cp = pp = 1 (checked at validate)."""
    fraction: float = 1.0
    """Share of each SFT batch's rows trained under the keep sets (the first ceil(fraction x rows) of each
    data-parallel rank's rows); the others train densely (causal), which keeps what the dense engine answers."""
    keys: SFTKVKeys = "dense"
    """Where the policy's keys and window queries come from: "dense" = one no-grad causal forward (the engine's keys
    after its first compaction come from its own sparse history, so later keep sets are approximate); "sequential" =
    one no-grad forward per compaction, forward c under the masks of compactions 0..c-1 (what an engine fed the same
    tokens computes, up to numerics; costs up to one forward per compaction)."""

    def __post_init__(self):
        _check(0.0 < self.fraction <= 1.0, f"trainer.sft.kv_keep.fraction must be in (0, 1] (got {self.fraction})")
        _check(self.keys in get_args(SFTKVKeys),
               f"trainer.sft.kv_keep.keys must be one of {list(get_args(SFTKVKeys))} (got {self.keys!r})")


@dataclass(kw_only=True, frozen=True, slots=True)
class SFTConfig:
    """Supervised warm-start on the task's reference answers before RL (0 steps = off)."""

    max_steps: int = 0
    """Upper bound on SFT optimizer steps (0 = no SFT stage)."""
    batch_size: int = 32
    """Examples per SFT step (global, split across data-parallel ranks)."""
    lr: float = 1e-3
    """Learning rate of the SFT stage (constant)."""
    target_accuracy: float = 0.0
    """Stop SFT early once held-out accuracy reaches this (0 = run max_steps)."""
    eval_every: int = 20
    """Evaluate every N SFT steps (for the early stop)."""
    kv_keep: SFTKVKeepConfig = field(default_factory=SFTKVKeepConfig)
    """Sparsity-aware SFT: train under the keep sets the run's sparse KV cache would make (off by default)."""

    def __post_init__(self):
        _check(self.max_steps >= 0, f"trainer.sft.max_steps must be >= 0 (got {self.max_steps})")
        _check(self.batch_size >= 1, f"trainer.sft.batch_size must be >= 1 (got {self.batch_size})")
        _check(self.lr > 0, f"trainer.sft.lr must be > 0 (got {self.lr})")
        _check(0 <= self.target_accuracy <= 1, f"trainer.sft.target_accuracy must be in [0, 1] (got {self.target_accuracy})")
        _check(self.eval_every >= 1, f"trainer.sft.eval_every must be >= 1 (got {self.eval_every})")
        for name, low, high in (("max_steps", 0, MAX_STEPS), ("batch_size", 1, MAX_BATCH),
                                ("eval_every", 1, MAX_STEPS)):
            _range(getattr(self, name), f"trainer.sft.{name}", low, high)


@dataclass(kw_only=True, frozen=True, slots=True)
class TrainerConfig:
    """The RL loop: rollout -> reward -> old logprobs -> advantages -> corrections -> updates -> sync."""

    steps: int = 10
    """RL steps (one rollout each)."""
    prompts_per_step: int = 16
    """Prompts per rollout (global); each gets rollout.sampling.n samples."""
    updates_per_rollout: int = 1
    """Optimizer steps per rollout (mini-batches); > 1 makes later updates off-policy."""
    eval_every: int = 5
    """Evaluate held-out accuracy every N RL steps (and at the end); 0 = only at the end."""
    eval_prompts: int = 64
    """Held-out prompts per evaluation."""
    eval_temperature: float = 1.0
    """Sampling temperature of evaluation: accuracy is the mean correctness of `eval_samples` samples per
    held-out prompt (the expected reward of the policy, which RL optimises); 0 = greedy decoding, else at least 0.01
    (vLLM samples any smaller one at 0.01)."""
    eval_samples: int = 4
    """Samples per held-out prompt (1 when eval_temperature is 0)."""
    sync_bucket_mb: float = 64.0
    """Bucket size of the learner -> engine weight sync."""
    sync_engine_slices: bool = True
    """Disaggregated engines of rollout.tensor_parallel_size > 1: each engine rank receives only its slice of the
    tensor-parallel weights (False: every engine rank receives whole tensors and vLLM's loaders narrow them)."""
    verify_sync_every: int = 10
    """Check engine logprobs against the learner on a probe sequence after the first sync and every N syncs
    (0 = never)."""
    verify_sync_tol: float | None = None
    """Largest allowed |engine - learner| logprob difference on the probe: of the max over its tokens, or of the mean
    for a bf16 engine, whose MoE routers flip on some tokens (docs/weight_sync.md, "Low-precision engines"). null =
    0.3 for a bf16 engine, else by the learner's dtype: 1e-3 for float32, 1e-1 for bfloat16 (the tolerance
    `msrl convert --verify` uses)."""
    max_staleness: int = 0
    """Asynchronous RL (docs/async.md; disaggregated placement): 0 = synchronous (sample, train, sync); k in [1, 8] =
    the rollout ranks sample up to k batches ahead while the learner ranks train, and the new weights reach them
    between engine steps without draining the requests in flight, so every token is trained at most k weight
    versions after the version that sampled it (RolloutBatch.token_version)."""
    stale_policy: StalePolicy = "drop"
    """With max_staleness k > 0, a batch whose tokens are more than k versions behind the training version (the
    pipeline bounds it by construction; this is the guard): "drop" its samples that hold such tokens, or
    "recompute" (sample the whole step again now, as a resumed run does). Counted: async/dropped_samples,
    async/resampled."""
    in_flight_kv: InFlightKV = "keep"
    """With max_staleness > 0, the KV cache of requests running when new weights arrive: "keep" (computed by the
    previous weights) or "recompute" (vLLM recomputes prompt + tokens so far under the new weights)."""
    stop_timeout_s: float = 300.0
    """After SIGTERM / SIGINT the run finishes the step in flight, checkpoints and exits 75 (stopped, resumable); if
    that has not happened within this many seconds, it exits at once without a checkpoint (docs/runs.md). `msrl
    launch local` gives torchrun's workers this long (plus a margin) before it kills them."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Supervised warm-start stage."""

    def __post_init__(self):
        _check(self.steps >= 0, f"trainer.steps must be >= 0 (got {self.steps})")
        _check(self.prompts_per_step >= 1, f"trainer.prompts_per_step must be >= 1 (got {self.prompts_per_step})")
        _check(self.updates_per_rollout >= 1,
               f"trainer.updates_per_rollout must be >= 1 (got {self.updates_per_rollout})")
        _check(self.eval_every >= 0, f"trainer.eval_every must be >= 0 (got {self.eval_every})")
        _check(self.eval_prompts >= 1, f"trainer.eval_prompts must be >= 1 (got {self.eval_prompts})")
        check_temperature(self.eval_temperature, "trainer.eval_temperature")  # 0 samples once (greedy)
        _check(self.eval_samples >= 1, f"trainer.eval_samples must be >= 1 (got {self.eval_samples})")
        _check(self.sync_bucket_mb > 0, f"trainer.sync_bucket_mb must be > 0 (got {self.sync_bucket_mb})")
        _check(self.verify_sync_every >= 0, f"trainer.verify_sync_every must be >= 0 (got {self.verify_sync_every})")
        for name, low, high in (("steps", 0, MAX_STEPS), ("prompts_per_step", 1, MAX_BATCH),
                                ("updates_per_rollout", 1, MAX_SAMPLES), ("eval_every", 0, MAX_STEPS),
                                ("eval_prompts", 1, MAX_BATCH), ("eval_samples", 1, MAX_SAMPLES),
                                ("verify_sync_every", 0, MAX_STEPS)):
            _range(getattr(self, name), f"trainer.{name}", low, high)
        _check(self.sync_bucket_mb <= MAX_SYNC_BUCKET_MB,
               f"trainer.sync_bucket_mb must be in (0, {MAX_SYNC_BUCKET_MB:g}] (got {self.sync_bucket_mb})")
        _check(isinstance(self.max_staleness, int) and 0 <= self.max_staleness <= MAX_STALENESS,
               f"trainer.max_staleness must be an integer in [0, {MAX_STALENESS}]: 0 synchronous, k > 0 the rollout "
               f"ranks sample up to k batches ahead (got {self.max_staleness!r})")
        _check(self.stale_policy in get_args(StalePolicy),
               f"trainer.stale_policy must be one of {list(get_args(StalePolicy))} (got {self.stale_policy!r})")
        _check(self.in_flight_kv in get_args(InFlightKV),
               f"trainer.in_flight_kv must be one of {list(get_args(InFlightKV))} (got {self.in_flight_kv!r})")
        _check(10 <= self.stop_timeout_s <= 86400,
               f"trainer.stop_timeout_s must be in [10, 86400] seconds (got {self.stop_timeout_s})")
        _check(self.verify_sync_tol is None or self.verify_sync_tol > 0,
               f"trainer.verify_sync_tol must be > 0 or null (got {self.verify_sync_tol})")
