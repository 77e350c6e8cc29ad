"""Configuration of the rollout engine (section `rollout`): sampling, sparse KV cache, vLLM engine.

Frozen, keyword-only dataclasses with a docstring under every field; each `__post_init__` rejects a
bad value with the dotted path of the field, the rule and the value, e.g.
`ValueError("rollout.sampling.top_p must be in (0, 1] (got 1.5)")`.
`megatron_sparse_rl.rollout.RolloutEngine` consumes `RolloutConfig`; `kv` is only the schema of the
sparse-KV policy (the policies live in `megatron_sparse_rl.kv`).
"""
from dataclasses import dataclass, field
from typing import Literal, get_args
from megatron_sparse_rl.config.checks import MAX_BATCH, MAX_RANKS, MAX_SAMPLES, MAX_SEED, MAX_TOKENS
from megatron_sparse_rl.config.checks import require as _require
from megatron_sparse_rl.config.checks import require_range as _range

KVPolicy = Literal["none", "rkv", "snapkv", "h2o", "streamingllm"]
KVPooling = Literal["max", "avg"]
RolloutDtype = Literal["float32", "bfloat16"]
RolloutQuantization = Literal["none", "fp8"]
LogprobsMode = Literal["processed", "raw"]
GREEDY_BELOW = 1e-5
"""vLLM decodes greedily below this temperature (vllm/sampling_params.py `_SAMPLING_EPS`, 0.32) and refuses n > 1."""
MIN_SAMPLED_TEMPERATURE = 1e-2
"""vLLM raises any temperature in (0, 0.01) to 0.01 with a warning (`_MAX_TEMP`, 0.32), while the learner would score
at the temperature written: so a temperature is 0 (greedy) or at least this."""
MIN_GROUP_TOP_P = 1e-2
"""With groups (n > 1) top_p is at least this: a nucleus keeps only the most likely token wherever that token's
probability reaches top_p (at every position when top_p <= 1 / vocabulary size), so below 0.01 nearly every position
of a trained model is decoded greedily and the samples of a group come out the same."""
MAX_SAMPLING_SEED = 2**63 - 1
"""The largest rollout.sampling.seed: the run gives each step's requests seeds derived from rollout.seed (steps x
1,000,003, training/steps.py), which pass 2**32 in long runs, so this is the range of a torch generator's seed."""
MAX_KV_CACHE_GB = 1 << 16
"""The largest rollout.kv_cache_gb (64 TiB: more than any machine's memory)."""


def check_temperature(temperature: float, field: str, *, n: int = 1, n_field: str = "") -> None:
    """Raise ValueError naming `field` (and `n_field`) when the engine would not sample at `temperature` as written:
    below 0, in (0, MIN_SAMPLED_TEMPERATURE) (vLLM samples at 0.01 instead), or greedy (0) with `n` > 1 samples."""
    _require(temperature >= 0, field, "must be >= 0", temperature)
    if temperature < GREEDY_BELOW and n > 1:
        raise ValueError(f"{field} = {temperature:g} (greedy) with {n_field} = {n}: greedy decoding gives every "
                         f"sample of a group the same response (vLLM refuses n > 1 when greedy, and each group's "
                         f"advantages would be 0); set {field} >= {MIN_SAMPLED_TEMPERATURE:g}, or {n_field} = 1")
    if 0 < temperature < MIN_SAMPLED_TEMPERATURE:
        raise ValueError(f"{field} must be 0 (greedy) or >= {MIN_SAMPLED_TEMPERATURE:g} (got {temperature:g}): vLLM "
                         f"samples any temperature below {MIN_SAMPLED_TEMPERATURE:g} at {MIN_SAMPLED_TEMPERATURE:g} "
                         "(and treats one below 1e-05 as greedy), while the learner scores at the temperature written")


def check_group_truncation(top_k: int, top_p: float, n: int) -> None:
    """Raise ValueError naming rollout.sampling.top_k or top_p and n when the truncation leaves only the most likely
    token, as a greedy temperature does (`check_temperature`), while a group of n > 1 samples should differ."""
    same = "gives every sample of a group the same response (each group's advantages would be 0)"
    if n > 1 and top_k == 1:
        raise ValueError(f"rollout.sampling.top_k = 1 (greedy) with rollout.sampling.n = {n}: keeping only the most "
                         f"likely token {same}; set rollout.sampling.top_k = -1 (off) or >= 2, or "
                         "rollout.sampling.n = 1")
    if n > 1 and top_p < MIN_GROUP_TOP_P:
        raise ValueError(f"rollout.sampling.top_p = {top_p:g} (nearly greedy) with rollout.sampling.n = {n}: a nucleus "
                         f"below {MIN_GROUP_TOP_P:g} keeps only the most likely token wherever its probability reaches "
                         f"{top_p:g} (nearly every position) and {same}; set rollout.sampling.top_p >= "
                         f"{MIN_GROUP_TOP_P:g}, or rollout.sampling.n = 1")


@dataclass(kw_only=True, frozen=True, slots=True)
class SamplingConfig:
    """How responses are sampled (maps onto vLLM's SamplingParams)."""

    n: int = 4
    """Samples per prompt (the GRPO group size); each prompt gives n rows sharing one group id."""
    temperature: float = 1.0
    """Softmax temperature: 0 means greedy decoding (then n must be 1), else at least 0.01 (vLLM samples any smaller
    one at 0.01 while the learner would score at the value written)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1 = off); with n > 1 at least
    0.01 (a smaller nucleus decodes nearly every token greedily, so the samples of a group would be the same)."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 = off. 1 is greedy decoding (then n must be 1)."""
    max_tokens: int = 128
    """Most response tokens per sample (the response may stop earlier at EOS or a stop string)."""
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends when the decoded response contains one (it is not returned)."""
    seed: int | None = None
    """Per-request sampling seed (sample i of a batch uses seed + i); None = the engine's RNG stream."""

    def __post_init__(self) -> None:
        _require(self.n >= 1, "rollout.sampling.n", "must be >= 1", self.n)
        _range(self.n, "rollout.sampling.n", 1, MAX_SAMPLES)
        check_temperature(self.temperature, "rollout.sampling.temperature", n=self.n, n_field="rollout.sampling.n")
        _require(0 < self.top_p <= 1, "rollout.sampling.top_p", "must be in (0, 1]", self.top_p)
        _require(self.top_k == -1 or 1 <= self.top_k <= MAX_TOKENS, "rollout.sampling.top_k",
                 f"must be -1 (off) or in [1, {MAX_TOKENS}]", self.top_k)
        check_group_truncation(self.top_k, self.top_p, self.n)
        _require(self.max_tokens >= 1, "rollout.sampling.max_tokens", "must be >= 1", self.max_tokens)
        _range(self.max_tokens, "rollout.sampling.max_tokens", 1, MAX_TOKENS)
        _require(isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop),
                 "rollout.sampling.stop", "must be a tuple of non-empty strings", self.stop)
        _require(self.seed is None or 0 <= self.seed <= MAX_SAMPLING_SEED, "rollout.sampling.seed",
                 f"must be None or in [0, {MAX_SAMPLING_SEED}]", self.seed)


@dataclass(kw_only=True, frozen=True, slots=True)
class KVBudgetScheduleConfig:
    """A KV budget that follows the low tail of the per-token ratio (`rollout.kv.budget_schedule`, off by default).

    Step t + 1's rollouts use the budget the rule gives from step t's budget b and the 5th percentile p5 of rho_t =
    pi_old / mu that step measured (`mismatch/rho_p5`; Sparrow, arXiv 2606.08446: stable while p5 >= 0.86): if
    p5 < target_p5, ceil(b * step_up); if p5 > target_p5 + margin, floor(b * step_down); else b; then clamped to
    [min_budget, max_budget]. The first step uses rollout.kv.budget (kv/budget_schedule.py `next_budget`;
    docs/sparse_kv.md, "Budget schedule")."""

    enabled: bool = False
    """Schedule the budget (needs a sparse rollout.kv.policy); false keeps rollout.kv.budget at every step."""
    target_p5: float = 0.86
    """The 5th percentile of rho_t to stay above (Sparrow's stable runs kept it >= 0.86)."""
    margin: float = 0.04
    """Lower the budget only while p5 > target_p5 + margin (a dead band, so the budget does not oscillate)."""
    step_up: float = 1.25
    """Factor of a raise (> 1; the new budget is rounded up)."""
    step_down: float = 0.9
    """Factor of a cut (in (0, 1); the new budget is rounded down)."""
    min_budget: int | None = None
    """Lowest budget (required when enabled): >= rollout.kv.window (+ sinks for streamingllm) and <= rollout.kv.budget."""
    max_budget: int | None = None
    """Highest budget (required when enabled): >= rollout.kv.budget."""

    def __post_init__(self) -> None:
        _require(0.0 < self.target_p5 <= 1.0, "rollout.kv.budget_schedule.target_p5", "must be in (0, 1]",
                 self.target_p5)
        _require(0.0 <= self.margin <= 1.0, "rollout.kv.budget_schedule.margin", "must be in [0, 1]", self.margin)
        _require(1.0 < self.step_up <= 16.0, "rollout.kv.budget_schedule.step_up", "must be in (1, 16]", self.step_up)
        _require(0.0 < self.step_down < 1.0, "rollout.kv.budget_schedule.step_down", "must be in (0, 1)",
                 self.step_down)
        for name, value in (("min_budget", self.min_budget), ("max_budget", self.max_budget)):
            _require(value is None or 1 <= value <= MAX_TOKENS, f"rollout.kv.budget_schedule.{name}",
                     f"must be None or in [1, {MAX_TOKENS}]", value)
        if self.enabled:
            for name, value in (("min_budget", self.min_budget), ("max_budget", self.max_budget)):
                _require(value is not None, f"rollout.kv.budget_schedule.{name}",
                         "must be set when rollout.kv.budget_schedule.enabled = true", value)
            _require(self.min_budget <= self.max_budget, "rollout.kv.budget_schedule.min_budget",
                     f"must be <= rollout.kv.budget_schedule.max_budget = {self.max_budget}", self.min_budget)


@dataclass(kw_only=True, frozen=True, slots=True)
class KVConfig:
    """Fixed-budget KV cache compression during rollout (Sparse-RL); "none" keeps the dense cache.

    The one KV schema: the settings vLLM carries to its scheduler and workers (`kv.settings.SparseKVSettings`)
    are this class, and the policies take it as their knobs. The policies live in
    `megatron_sparse_rl.kv.policies`; the vLLM integration that applies them and frees blocks in
    `megatron_sparse_rl.kv` (see docs/sparse_kv.md)."""

    policy: KVPolicy = "none"
    """Which tokens to keep: none (dense), rkv, snapkv, h2o or streamingllm."""
    budget: int = 1024
    """KV entries kept per request (per layer and KV head) after a compaction."""
    window: int = 8
    """Most recent tokens always kept (and the observation window of score-based policies)."""
    interval: int = 128
    """Compact when the stored length reaches budget + interval (amortises the compaction cost)."""
    sinks: int = 4
    """streamingllm: first tokens always kept (attention sinks); the budget must hold them and the window
    (budget >= sinks + window)."""
    pooling: KVPooling = "max"
    """rkv, snapkv: 1-D pooling of the importance scores over neighbouring tokens: max or avg."""
    kernel: int = 7
    """rkv, snapkv: pooling kernel size (odd; 1 = no pooling)."""
    rkv_lambda: float = 0.1
    """rkv: weight of importance against redundancy (score = lambda * imp - (1 - lambda) * red)."""
    rkv_threshold: float = 0.5
    """rkv: cosine similarity above which two keys count as redundant."""
    record_keep: bool = False
    """Return the kept positions of every layer/KV head at every compaction (`RolloutBatch.features.kv_keep`);
    false records only the compaction steps (the memory of a full record grows with layers x heads x
    budget per compaction). The trainer then also recomputes pi_sparse on the learner (one more forward
    per step, masks of layers x kv_heads x T^2 per sample) for the metrics kv/k1_sparse_numerics and
    kv/k1_sparse_compression."""
    block_size: int | None = None
    """KV cache block size in tokens (a multiple of 32 on CPU); None = vLLM's default (128 on CPU). Blocks
    are the unit that compaction frees: smaller blocks follow the budget more tightly."""
    pool_blocks: int | None = None
    """Fix the engine's KV pool to this many blocks (vLLM num_gpu_blocks_override) instead of sizing it
    from memory; for benchmarks and tests at a fixed pool. None = sized by rollout.kv_cache_gb."""
    admission_control: bool = True
    """Admit a request only when the worst-case blocks of all running requests still fit the pool (no
    preemption of compressed requests); false leaves vLLM's optimistic admission and preemption."""
    budget_schedule: KVBudgetScheduleConfig = field(default_factory=KVBudgetScheduleConfig)
    """Each step's budget from the tail of the previous step's per-token ratio (off by default); `budget` is the
    first step's."""

    def __post_init__(self) -> None:
        _require(self.policy in get_args(KVPolicy), "rollout.kv.policy", f"must be one of {list(get_args(KVPolicy))}",
                 self.policy)
        _require(self.window >= 1, "rollout.kv.window", "must be >= 1", self.window)
        _range(self.window, "rollout.kv.window", 1, MAX_TOKENS)
        _require(self.interval >= 1, "rollout.kv.interval", "must be >= 1", self.interval)
        _range(self.interval, "rollout.kv.interval", 1, MAX_TOKENS)
        if self.budget < self.window:
            raise ValueError(f"rollout.kv.budget must be >= window (got {self.budget} < {self.window})")
        _range(self.budget, "rollout.kv.budget", self.window, MAX_TOKENS)
        _require(self.sinks >= 0, "rollout.kv.sinks", "must be >= 0", self.sinks)
        _range(self.sinks, "rollout.kv.sinks", 0, MAX_TOKENS)
        if self.policy == "streamingllm" and self.budget <= self.sinks:
            raise ValueError(f"rollout.kv.budget must be > sinks for streamingllm (got {self.budget} <= {self.sinks})")
        if self.policy == "streamingllm" and self.budget < self.sinks + self.window:
            raise ValueError(f"rollout.kv.budget must be >= sinks + window for streamingllm (got {self.budget} < "
                             f"{self.sinks} + {self.window}): it keeps the {self.sinks} sinks and the last budget - "
                             f"sinks = {self.budget - self.sinks} tokens, fewer than the {self.window} most recent "
                             "tokens rollout.kv.window promises; raise rollout.kv.budget or lower sinks or window")
        _require(self.pooling in get_args(KVPooling), "rollout.kv.pooling", f"must be one of {list(get_args(KVPooling))}",
                 self.pooling)
        _require(1 <= self.kernel <= MAX_TOKENS and self.kernel % 2 == 1, "rollout.kv.kernel",
                 f"must be an odd integer in [1, {MAX_TOKENS}]", self.kernel)
        _require(self.block_size is None or (16 <= self.block_size <= MAX_TOKENS and self.block_size % 16 == 0),
                 "rollout.kv.block_size", f"must be None or a multiple of 16 in [16, {MAX_TOKENS}]", self.block_size)
        _require(self.pool_blocks is None or 2 <= self.pool_blocks <= MAX_TOKENS, "rollout.kv.pool_blocks",
                 f"must be None or in [2, {MAX_TOKENS}]", self.pool_blocks)
        _require(0.0 <= self.rkv_lambda <= 1.0, "rollout.kv.rkv_lambda", "must be in [0, 1]", self.rkv_lambda)
        _require(-1.0 <= self.rkv_threshold <= 1.0, "rollout.kv.rkv_threshold", "must be in [-1, 1]",
                 self.rkv_threshold)
        self._check_schedule()

    def _check_schedule(self) -> None:
        """The schedule's bounds hold the starting budget, and its lowest budget keeps what `budget` must keep."""
        sched = self.budget_schedule
        if not sched.enabled:
            return
        if self.policy == "none":
            raise ValueError("rollout.kv.budget_schedule.enabled = true needs a sparse rollout.kv.policy (got 'none': "
                             "a dense cache has no budget to schedule)")
        if not sched.min_budget <= self.budget <= sched.max_budget:
            name = "min_budget" if self.budget < sched.min_budget else "max_budget"
            raise ValueError(f"rollout.kv.budget_schedule.{name} = {getattr(sched, name)}: the bounds "
                             f"[{sched.min_budget}, {sched.max_budget}] must hold the starting budget "
                             f"rollout.kv.budget = {self.budget}")
        least = self.window + (self.sinks if self.policy == "streamingllm" else 0)
        if sched.min_budget < least:
            raise ValueError(f"rollout.kv.budget_schedule.min_budget must be >= {least} (rollout.kv.window"
                             + (" + sinks for streamingllm" if self.policy == "streamingllm" else "")
                             + f", what every budget must keep; got {sched.min_budget})")


@dataclass(kw_only=True, frozen=True, slots=True)
class RolloutConfig:
    """The vLLM rollout engine: precision, memory, batch limits and what to record."""

    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Default sampling of training rollouts."""
    kv: KVConfig = field(default_factory=KVConfig)
    """Sparse KV cache policy."""
    dtype: RolloutDtype = "float32"
    """Engine weight/activation dtype. float32: the engine agrees with an fp32 learner to ~1e-7 (no mismatch to
    correct); bfloat16: the engine holds the learner's weights rounded to bf16 and computes in bf16, as production
    engines do (on CPU where vLLM's CPU platform lists bf16, checked at validate). The sync probe compares it with
    the learner holding the same weights, bounding the mean difference (docs/weight_sync.md, "Low-precision
    engines")."""
    quantization: RolloutQuantization = "none"
    """fp8: at every sync the learner's attention and MLP/expert weights are quantised to float8_e4m3fn with 128x128
    block scales (the DeepSeek-V3 / Qwen3 FP8 release format; weights only, activations stay in rollout.dtype), and
    the engine computes with exactly those weights: their dequantised values (vLLM's CPU FP8 kernels need AMX; GPU
    FP8 kernels are not wired yet). Embeddings, lm_head, norms and routers stay unquantised, as in the releases."""
    kv_cache_gb: int | None = 1
    """KV cache size in GiB. CPU: exported as VLLM_CPU_KVCACHE_SPACE (an integer GiB); GPU: passed as
    kv_cache_memory_bytes. None: vLLM sizes it from gpu_memory_utilization."""
    max_num_seqs: int = 64
    """Most sequences vLLM runs concurrently in one step."""
    max_model_len: int | None = None
    """Longest prompt + response, in tokens. None = what the model supports: its max_position_embeddings, capped to
    the longest sequence one engine rank's KV cache holds when rollout.kv_cache_gb sizes it (vLLM refuses to start
    an engine whose cache cannot hold one sequence of max_model_len). Resolved once from the model's config.json
    (or model.tiny) by `config.resolve.resolve`; a value set here must not exceed max_position_embeddings."""
    gpu_memory_utilization: float = 0.5
    """Fraction of device memory vLLM may take (on CPU: of host memory, checked at start-up)."""
    enforce_eager: bool = True
    """No torch.compile / CUDA graphs (required on CPU; faster start-up for tests)."""
    prefix_caching: bool = False
    """vLLM's automatic prefix caching: a request whose leading full KV blocks another request computed reuses them
    instead of prefilling them again. Multi-turn episodes (env.kind) use it to continue an episode without
    re-prefilling its earlier turns (rollout/multi_turn.py measures what is re-prefilled); without it every turn
    prefills the whole history. Off by default: single-turn rollouts share no prefixes worth it, and sparse KV
    (rollout.kv.policy) rewrites blocks in place, so it refuses this (sparse-KV episodes re-prefill every turn).
    vLLM's CPU platform turns it off for multi-head latent attention models."""
    record_sampling_mask: bool = False
    """Record, at every sampled token, the ids the sampler could draw (what top-k/top-p kept) in
    RolloutBatch.features.sampling_mask, for algorithm.keep_sampling_mask. Needs logprobs_mode = processed."""
    logprobs_mode: LogprobsMode = "processed"
    """What `rollout_logprobs` measure. processed: the logprob under the distribution actually sampled
    from (temperature, top-k/top-p applied and renormalised; the behaviour policy of the off-policy
    corrections). raw: log_softmax of the unmodified logits (temperature 1, no truncation). The trainer's
    learner scores at the sampling temperature, so only processed logprobs are mu when it is not 1."""
    tensor_parallel_size: int = 1
    """Tensor-parallel degree of one engine, CPU or GPU. Above 1 the engine joins the torchrun world through
    vLLM's external_launcher and the world splits into engines of this many consecutive ranks: colocated it
    must divide the world size; disaggregated, both the learner and the rollout rank counts."""
    seed: int = 0
    """Seed of the engine's random state (model init, sampling when sampling.seed is None)."""

    def __post_init__(self) -> None:
        _require(self.dtype in get_args(RolloutDtype), "rollout.dtype", f"must be one of {list(get_args(RolloutDtype))}",
                 self.dtype)
        _require(self.quantization in get_args(RolloutQuantization), "rollout.quantization",
                 f"must be one of {list(get_args(RolloutQuantization))}", self.quantization)
        _require(self.kv_cache_gb is None or 1 <= self.kv_cache_gb <= MAX_KV_CACHE_GB, "rollout.kv_cache_gb",
                 f"must be None or in [1, {MAX_KV_CACHE_GB}]", self.kv_cache_gb)
        _require(self.max_num_seqs >= 1, "rollout.max_num_seqs", "must be >= 1", self.max_num_seqs)
        _range(self.max_num_seqs, "rollout.max_num_seqs", 1, MAX_BATCH)
        _require(self.max_model_len is None or 2 <= self.max_model_len <= MAX_TOKENS, "rollout.max_model_len",
                 f"must be None (from the model) or in [2, {MAX_TOKENS}]", self.max_model_len)
        _require(0 < self.gpu_memory_utilization <= 1, "rollout.gpu_memory_utilization", "must be in (0, 1]",
                 self.gpu_memory_utilization)
        _require(self.logprobs_mode in get_args(LogprobsMode), "rollout.logprobs_mode",
                 f"must be one of {list(get_args(LogprobsMode))}", self.logprobs_mode)
        if self.record_sampling_mask and self.logprobs_mode != "processed":
            raise ValueError("rollout.record_sampling_mask = true needs rollout.logprobs_mode = processed (the kept "
                             f"ids are read from the processed logprobs; got {self.logprobs_mode!r})")
        _require(self.tensor_parallel_size >= 1, "rollout.tensor_parallel_size", "must be >= 1",
                 self.tensor_parallel_size)
        _range(self.tensor_parallel_size, "rollout.tensor_parallel_size", 1, MAX_RANKS)
        _require(self.seed >= 0, "rollout.seed", "must be >= 0", self.seed)
        _range(self.seed, "rollout.seed", 0, MAX_SEED)
        if self.prefix_caching and self.kv.policy != "none":
            raise ValueError(f"rollout.prefix_caching = true cannot run with rollout.kv.policy = {self.kv.policy!r}: "
                             "sparse KV rewrites cached blocks in place, so no block holds a prefix to share")
        # None: checked against the value resolved from the model (validation/resolve.py)
        if self.max_model_len is not None and self.sampling.max_tokens >= self.max_model_len:
            raise ValueError(f"rollout.sampling.max_tokens must be < rollout.max_model_len "
                             f"(got {self.sampling.max_tokens} >= {self.max_model_len})")


def engine_precision(rollout: RolloutConfig) -> str:
    """What the engine computes with, for the run summary (rollout.dtype, rollout.quantization)."""
    if rollout.quantization == "none":
        return f"engine dtype {rollout.dtype}"
    return (f"engine fp8 weights (float8_e4m3fn, 128x128 block scales, quantised at every sync) computed as their "
            f"dequantised values in {rollout.dtype}: vLLM's FP8 kernels are not used")
