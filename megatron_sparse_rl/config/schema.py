"""The run configuration: one frozen dataclass per component, composed into `RunConfig`.

Defaults live here; YAML files in configs/ hold overrides only. Each component receives its own
sub-config (never the root). Cross-component checks live in `validate.py`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal, get_args

from megatron_sparse_rl.config.algorithm import AlgorithmConfig
from megatron_sparse_rl.config.data import DataConfig, RewardConfig
from megatron_sparse_rl.config.env import EnvConfig
from megatron_sparse_rl.config.launch import LaunchConfig
from megatron_sparse_rl.config.lora import LoraConfig
from megatron_sparse_rl.config.rollout import RolloutConfig
from megatron_sparse_rl.config.routing import RoutingConfig
from megatron_sparse_rl.config.stages import LAYOUT_CHARS
from megatron_sparse_rl.config.trainer import TrainerConfig
from megatron_sparse_rl.config.trackers import MlflowConfig, Tracker, WandbConfig
from megatron_sparse_rl.config.checks import MAX_BATCH, MAX_RANKS, MAX_SEED, MAX_STEPS
from megatron_sparse_rl.config.checks import check as _check
from megatron_sparse_rl.config.checks import require_finite
from megatron_sparse_rl.config.checks import require_range as _range


QWEN_ARCHS = ("qwen3_moe", "qwen3")
MLA_ARCHS = ("deepseek_v3",)
TINY_ARCH_FIELDS: dict[str, tuple[str, ...]] = {
    "kv_heads": QWEN_ARCHS, "head_dim": QWEN_ARCHS,
    **{name: MLA_ARCHS for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "q_lora_rank",
                                    "first_k_dense", "shared_experts", "n_group", "topk_group", "rope_type")},
}
"""The `model.tiny` fields that apply to some architectures only (the others apply to all): set on another
architecture to anything but their default, they are refused."""
KernelChoice = Literal["auto", "local", "fast"]
"""learner.kernels: the modules that compute routed experts and core attention (models/kernels.py)."""
TINY_MAX_WIDTH = 1 << 17
"""The largest `model.tiny` hidden, MLP and latent size (131,072: above every released model's, e.g. Llama-3.1-405B's
MLP of 53,248); the random model is built in host memory at start."""
TINY_MAX_COUNT = 4096
"""The largest `model.tiny` layer, head, head-size, expert and group count (released models have at most 126 layers,
128 heads and 512 experts)."""


def _yaml(value) -> str:
    """`value` as YAML spells it: null, true, 512, 'yarn'."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)


@dataclass(kw_only=True, frozen=True, slots=True)
class TinyModelConfig:
    """A tiny random Hugging Face model built locally at `model.path` when that directory is missing. Fields marked
    (qwen3_moe, qwen3) or (deepseek_v3) apply to those architectures only; set on another one to anything but
    their default, they are refused."""

    arch: Literal["qwen3_moe", "qwen3", "deepseek_v3"] = "qwen3_moe"
    """Architecture family: qwen3_moe (Qwen3-MoE; experts = 0 makes it dense), qwen3 (dense Qwen3) or deepseek_v3
    (DeepSeek-V3 / Kimi-K2: multi-head latent attention, `first_k_dense` dense layers then MoE layers with shared
    experts, sigmoid router with a correction bias, group-limited routing)."""
    hidden: int = 64
    """Hidden size."""
    layers: int = 2
    """Number of transformer layers."""
    heads: int = 4
    """Attention (query) heads."""
    kv_heads: int = 2
    """(qwen3_moe, qwen3) Key/value heads (grouped-query attention)."""
    head_dim: int = 32
    """(qwen3_moe, qwen3) Per-head size; must be one vLLM's CPU attention supports (32, 64, 80, 96, 112, 128, ...)."""
    experts: int = 4
    """Routed experts per MoE layer (0 = dense; deepseek_v3 needs >= 1)."""
    topk: int = 2
    """Experts chosen per token."""
    moe_ffn: int = 64
    """Hidden size of each expert's MLP (routed and shared experts)."""
    ffn: int = 128
    """Hidden size of the dense MLP (dense models; deepseek_v3: its first `first_k_dense` layers)."""
    # 512 and 64: models/tiny_families.py MLA_CPU_LATENT (not imported here: it pulls in torch); a unit test ties them
    kv_lora_rank: int = 512
    """(deepseek_v3) Rank of the compressed KV latent. The MLA cache holds kv_lora_rank + qk_rope_head_dim values per
    token per layer; vLLM's CPU MLA decode runs only 512 + 64 = 576 (without CUDA other sizes are refused)."""
    qk_rope_head_dim: int = 64
    """(deepseek_v3) Per-head query/key dimensions that carry RoPE (the rotated key part is shared by all heads)."""
    qk_nope_head_dim: int = 32
    """(deepseek_v3) Per-head query/key dimensions without RoPE (head size = nope + rope)."""
    v_head_dim: int = 32
    """(deepseek_v3) Per-head value size."""
    q_lora_rank: int | None = None
    """(deepseek_v3) Rank of the low-rank query projection; null = a full query projection."""
    first_k_dense: int = 1
    """(deepseek_v3) Leading layers with a dense MLP (`ffn`) instead of experts (first_k_dense_replace)."""
    shared_experts: int = 1
    """(deepseek_v3) Shared experts of every MoE layer (each of size `moe_ffn`), run for every token."""
    n_group: int = 1
    """(deepseek_v3) Expert groups of the group-limited router (1 = no groups; DeepSeek-V3 has 8). Must divide
    `experts`; with more than one group, topk // topk_group must be 2 (the learner's router matches HF's
    top-2 group score only then)."""
    topk_group: int = 1
    """(deepseek_v3) Groups a token may route to (must divide `topk`)."""
    rope_type: Literal["yarn", "default"] = "yarn"
    """(deepseek_v3) RoPE of the rope dimensions: yarn (as DeepSeek-V3 and Kimi-K2, scaled to a tiny context) or
    default."""
    init_std: float = 0.2
    """Std of the random normal init (transformers' `initializer_range`). Larger than the usual 0.02 so that a tiny
    model's next-token distributions are peaked and routing decisions well separated (parity tests mean more)."""
    seed: int = 0
    """Seed of the random weights."""

    def __post_init__(self):
        for f in fields(self):
            archs, value = TINY_ARCH_FIELDS.get(f.name), getattr(self, f.name)
            _check(archs is None or self.arch in archs or value == f.default,
                   f"model.tiny.{f.name} applies to model.tiny.arch {' or '.join(map(repr, archs or ()))} only, not "
                   f"{self.arch!r}: remove it or leave its default {_yaml(f.default)} (got {_yaml(value)})")
        for name in ("hidden", "layers", "heads", "kv_heads", "head_dim", "moe_ffn", "ffn", "kv_lora_rank",
                     "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_group", "topk_group"):
            _check(getattr(self, name) > 0, f"model.tiny.{name} must be > 0 (got {getattr(self, name)})")
        _check(self.experts >= 0, f"model.tiny.experts must be >= 0 (got {self.experts})")
        for name in ("hidden", "moe_ffn", "ffn", "kv_lora_rank"):
            _range(getattr(self, name), f"model.tiny.{name}", 1, TINY_MAX_WIDTH)
        for name in ("layers", "heads", "kv_heads", "head_dim", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                     "n_group", "topk_group"):
            _range(getattr(self, name), f"model.tiny.{name}", 1, TINY_MAX_COUNT)
        _range(self.experts, "model.tiny.experts", 0, TINY_MAX_COUNT)
        _range(self.seed, "model.tiny.seed", 0, MAX_SEED)
        _check(self.init_std > 0, f"model.tiny.init_std must be > 0 (got {self.init_std})")
        if self.arch in QWEN_ARCHS:
            _check(self.heads % self.kv_heads == 0, f"model.tiny.heads must be a multiple of model.tiny.kv_heads "
                                                    f"(got {self.heads} and {self.kv_heads})")
        else:
            self._check_mla()
        if self.experts:
            _check(1 <= self.topk <= self.experts,
                   f"model.tiny.topk must be in [1, experts={self.experts}] (got {self.topk})")

    def _check_mla(self):
        _check(self.experts >= 1, f"model.tiny.experts must be >= 1 for arch {self.arch!r} (got {self.experts})")
        _check(self.qk_rope_head_dim % 2 == 0,
               f"model.tiny.qk_rope_head_dim must be even: RoPE rotates pairs (got {self.qk_rope_head_dim})")
        _check(self.q_lora_rank is None or 0 < self.q_lora_rank <= TINY_MAX_WIDTH,
               f"model.tiny.q_lora_rank must be null or in [1, {TINY_MAX_WIDTH}] (got {self.q_lora_rank})")
        _check(0 <= self.first_k_dense <= self.layers,
               f"model.tiny.first_k_dense must be in [0, layers={self.layers}] (got {self.first_k_dense})")
        _check(0 <= self.shared_experts <= TINY_MAX_COUNT,
               f"model.tiny.shared_experts must be in [0, {TINY_MAX_COUNT}] (got {self.shared_experts})")
        _check(self.topk_group <= self.n_group,
               f"model.tiny.topk_group must be <= n_group={self.n_group} (got {self.topk_group})")


@dataclass(kw_only=True, frozen=True, slots=True)
class ModelConfig:
    """Which model to train. Its architecture comes from the HF `config.json` at `path`, never from YAML."""

    path: str = ""
    """Hugging Face model directory (config.json, safetensors, tokenizer)."""
    tiny: TinyModelConfig | None = None
    """If set and `path` does not exist yet, build a tiny random model there first."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of the learner; bfloat16 keeps fp32 main weights in the optimizer (CPU and GPU; on CPU
    Megatron's local attention rounds attention scores to bf16, so float32 is the exact choice there)."""
    recompute_activations: bool = False
    """Full activation recompute of every transformer layer in the backward pass."""
    moe_aux_loss_coeff: float = 0.0
    """Coefficient of Megatron's load-balancing auxiliary loss (0 = off)."""
    dsa_indexer_loss_coeff: float = 0.0
    """Coefficient of the DeepSeek Sparse Attention indexer's own KL loss (Megatron's `dsa_indexer_loss_coeff`;
    learner/dsa_indexer_loss.py): trains the indexer towards the main attention's head-summed distribution, the
    rest of the model untouched; step metric indexer/kl_loss. 0 = off; > 0 needs a DSA model."""
    lora: LoraConfig | None = None
    """LoRA adapters (rank, alpha, dropout, target modules); null: none, every parameter trains. Set, the base is
    frozen and only the adapters train; engines receive the merged weights. Runs at parallel.cp = 1 (any
    tensor, pipeline, data and expert parallel size, with or without sequence parallel; colocated or disaggregated) with
    attention, dense-MLP and shared-expert targets, and dropout 0 at tp > 1; the rest is refused at validate
    (docs/lora.md)."""

    def __post_init__(self):
        _check(self.moe_aux_loss_coeff >= 0, f"model.moe_aux_loss_coeff must be >= 0 (got {self.moe_aux_loss_coeff})")
        _check(self.dsa_indexer_loss_coeff >= 0,
               f"model.dsa_indexer_loss_coeff must be >= 0 (got {self.dsa_indexer_loss_coeff})")


@dataclass(kw_only=True, frozen=True, slots=True)
class ParallelConfig:
    """Parallel degrees of the learner. Data parallel is what is left: world / (tp * pp * cp)."""

    tp: int = 1
    """Tensor parallel degree (divides attention heads and KV heads)."""
    pp: int = 1
    """Pipeline parallel degree. Where it does not divide the layer count (DeepSeek-V3's and Kimi-K2's 61 layers) the
    stages are uneven, balanced automatically (7 layers over pp 3: 3,2,2), unless `pipeline_layout` says otherwise."""
    pipeline_layout: str | None = None
    """Megatron-Core's pipeline layout string, one stage per pipeline rank separated by '|': E the embedding (first),
    t a decoder layer, L the loss (last), x*n and (..)*n repeats, e.g. 'Ettt|tt|ttL' or 'Et*8|(t*8|)*6t*5L'. It must
    place every layer once; null: balanced stages. With `vpp` > 1 it has pp * vpp stages, the virtual stages in layer
    order (virtual stage v runs on pipeline rank v % pp). MTP layers ('m') are not supported."""
    vpp: int = 1
    """Virtual pipeline stages (model chunks) per pipeline rank: Megatron-Core's interleaved 1F1B schedule. Needs
    pp > 1; the layers are balanced over the pp * vpp virtual stages (7 layers at pp 2 x vpp 2: 2,2,2,1) unless
    `pipeline_layout` writes them, and each training step's micro-batches per data-parallel rank must be a multiple
    of pp (forward-only calls are padded to one)."""
    ep: int = 1
    """Expert parallel degree (divides the expert count)."""
    etp: int = 1
    """Expert tensor parallel degree (1 on CPU: gloo cannot do the uneven all-gather it needs)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs tp > 1)."""
    cp: int = 1
    """Context parallel degree (Megatron's context_parallel_size): every sequence is split into 2 x cp load-balanced
    chunks, rank r of the context-parallel group holding chunks r and 2cp - 1 - r, and attention all-gathers K/V over
    the group. The learner right-pads each sequence to a multiple of 2 x cp (x tp with sequence parallelism)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Collective backend of the run's torch.distributed world: auto = nccl with CUDA, gloo without; a named one
    is used as named (nccl on a machine without CUDA is an error before the world starts)."""

    def __post_init__(self):
        for name in ("tp", "pp", "ep", "etp", "cp"):
            _check(getattr(self, name) >= 1, f"parallel.{name} must be >= 1 (got {getattr(self, name)})")
            _range(getattr(self, name), f"parallel.{name}", 1, MAX_RANKS)
        _check(self.vpp >= 1, f"parallel.vpp must be >= 1 (got {self.vpp})")
        _range(self.vpp, "parallel.vpp", 1, MAX_RANKS)
        _check(self.vpp == 1 or self.pp > 1, f"parallel.vpp={self.vpp} needs parallel.pp > 1 (got pp={self.pp}): "
                                             "interleaving splits each pipeline rank's layers into vpp model chunks")
        _check(not self.sequence_parallel or self.tp > 1,
               f"parallel.sequence_parallel needs parallel.tp > 1 (got tp={self.tp})")
        if self.pipeline_layout is not None:
            bad = sorted(set(self.pipeline_layout) - LAYOUT_CHARS)
            _check(not bad, f"parallel.pipeline_layout has characters {bad} outside a Megatron-Core layout string "
                            f"(E t m L | ( ) , * digits) (got {self.pipeline_layout!r})")
            _check(self.pp > 1, f"parallel.pipeline_layout needs parallel.pp > 1 (got pp={self.pp})")


@dataclass(kw_only=True, frozen=True, slots=True)
class OptimizerConfig:
    """Adam(W) through Megatron's distributed optimizer wrapper."""

    lr: float = 1e-5
    """Peak learning rate."""
    min_lr: float = 0.0
    """Final learning rate of the decay schedule."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warm-up."""
    warmup_steps: int = 0
    """Linear warm-up optimizer steps."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.999
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 = off)."""

    def __post_init__(self):
        _check(self.lr > 0, f"learner.optimizer.lr must be > 0 (got {self.lr})")
        _check(0 <= self.min_lr <= self.lr, f"learner.optimizer.min_lr must be in [0, lr={self.lr}] (got {self.min_lr})")
        _check(self.warmup_steps >= 0, f"learner.optimizer.warmup_steps must be >= 0 (got {self.warmup_steps})")
        _range(self.warmup_steps, "learner.optimizer.warmup_steps", 0, MAX_STEPS)
        _check(self.weight_decay >= 0, f"learner.optimizer.weight_decay must be >= 0 (got {self.weight_decay})")
        for name in ("beta1", "beta2"):
            _check(0 <= getattr(self, name) < 1,
                   f"learner.optimizer.{name} must be in [0, 1) (got {getattr(self, name)})")
        _check(self.eps > 0, f"learner.optimizer.eps must be > 0 (got {self.eps})")
        _check(self.clip_grad >= 0, f"learner.optimizer.clip_grad must be >= 0 (got {self.clip_grad})")


@dataclass(kw_only=True, frozen=True, slots=True)
class LearnerConfig:
    """The Megatron-Core learner."""

    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and learning-rate schedule."""
    micro_batch_size: int = 4
    """Sequences per forward/backward pass on one data-parallel rank."""
    group_by_length: bool = True
    """Put rows of similar length in the same micro-batch (longest first); each micro-batch runs only up to its
    longest row (pipeline parallel > 1: the batch's), so padding costs little compute. Off: rows in order."""
    seed: int = 1234
    """Seed of weight init (when not loading) and of Megatron's RNG trackers."""
    kernels: KernelChoice = "auto"
    """Which modules compute routed experts and core attention (models/kernels.py, docs/performance.md): "local"
    (Megatron's SequentialMLP, a loop over experts, and DotProductAttention, a materialised softmax), "fast"
    (grouped-GEMM experts over torch._grouped_mm and scaled_dot_product_attention; on CUDA also Megatron's fused
    SwiGLU and bias-dropout-add), "auto" (fast on CPU, where it measured faster, and on CUDA). Both hold the same
    parameters: checkpoints, optimizer state included, load across choices."""

    def __post_init__(self):
        _check(self.kernels in get_args(KernelChoice),
               f"learner.kernels must be one of {list(get_args(KernelChoice))} (got {self.kernels!r})")
        _check(self.micro_batch_size >= 1, f"learner.micro_batch_size must be >= 1 (got {self.micro_batch_size})")
        _range(self.micro_batch_size, "learner.micro_batch_size", 1, MAX_BATCH)
        _range(self.seed, "learner.seed", 0, MAX_SEED)


@dataclass(kw_only=True, frozen=True, slots=True)
class CheckpointConfig:
    """Distributed checkpoints of the whole run."""

    dir: str = ""
    """Where checkpoints go ('' = <logging.dir>/checkpoints)."""
    save_every: int = 0
    """Save every N steps (0 = only at the end)."""
    keep_last: int = 2
    """How many step checkpoints to keep."""
    resume: bool = True
    """Resume from the newest complete checkpoint in `dir` if there is one."""
    allow_config_change: bool = False
    """Resume even when this run's config changes what the resumed steps compute. A checkpoint holds the config of
    the run that saved it; on resume every field is compared (docs/runs.md). Changes to the model, data, reward,
    SFT stage, algorithm, sampling, optimizer, seeds, the engine's dtype, max_model_len and KV policy, routing
    replay, prompts_per_step or updates_per_rollout are refused, listed as `path: old -> new`, unless this is on.
    Changes to how long the run goes on (trainer.steps), evaluation, logging, checkpointing, the parallel layout
    (checkpoints reshard on load), launch settings, micro-batching, activation recompute, engine memory and
    metrics-only recording are allowed and listed. Accepted changes apply from the resumed step on; what the
    checkpoint already did is not redone (a finished SFT stage is not run again) and the learning-rate schedule
    continues with the values saved in the checkpoint (Megatron restores them)."""

    def __post_init__(self):
        _check(self.save_every >= 0, f"checkpoint.save_every must be >= 0 (got {self.save_every})")
        _check(self.keep_last >= 1, f"checkpoint.keep_last must be >= 1 (got {self.keep_last})")
        _range(self.save_every, "checkpoint.save_every", 0, MAX_STEPS)
        _range(self.keep_last, "checkpoint.keep_last", 1, MAX_STEPS)


@dataclass(kw_only=True, frozen=True, slots=True)
class LoggingConfig:
    """Where metrics, plots and logs go."""

    dir: str = "runs/default"
    """Run directory (metrics.jsonl, TensorBoard events, plots, checkpoints)."""
    level: Literal["DEBUG", "INFO", "WARNING"] = "INFO"
    """Console log level of this project's own messages on rank 0 (other ranks: WARNING)."""
    verbose: bool = False
    """Also show vLLM's, Megatron's and transformers' INFO lines and their known-benign start-up warnings on the
    console (`msrl train --verbose`); they always go to <dir>/logs/rank<N>.log."""
    tensorboard: bool = True
    """Also write TensorBoard event files (when tensorboard is installed)."""
    trackers: tuple[Tracker, ...] = ()
    """Experiment trackers to log to as well, any of wandb, mlflow: the metric names and steps TensorBoard gets and
    the run's resolved config (config/trackers.py; docs/data.md, "Trackers"). Rank 0 logs."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """W&B settings, used when `trackers` names wandb."""
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    """MLflow settings, used when `trackers` names mlflow."""
    overwrite: bool = False
    """Start a fresh run even when `dir` holds a previous run: what that run recorded in its run.json that it wrote
    (run.json, metrics, plots, TensorBoard events, the W&B offline run and MLflow's default store, logs, hf_final,
    the checkpoints carrying its id) is removed first, nothing else; files no run recorded are refused instead.
    Off: such a directory is refused unless the run resumes it."""

    def __post_init__(self):
        _check_run_dir(self.dir)
        twice = sorted({t for t in self.trackers if self.trackers.count(t) > 1})
        _check(not twice, f"logging.trackers names {', '.join(twice)} more than once (got {list(self.trackers)})")


REPO_ROOT = Path(__file__).resolve().parents[2]


def _check_run_dir(text: str) -> None:
    """Refuse a `logging.dir` that cannot be a run's own directory: empty, the filesystem root, the home directory,
    the current directory or one above it, this repository's root, or an existing file."""
    allowed = ("allowed: a directory of its own for this run, new or holding only this run's files, e.g. "
               "runs/my_run")
    _check(bool(text.strip()), f"logging.dir must not be empty ({allowed})")
    path = Path(os.path.abspath(text))
    cwd, home = Path.cwd().resolve(), Path.home().resolve()
    real = path.resolve()
    named = {Path(real.anchor): "the filesystem root", home: "your home directory", cwd: "the current directory"}
    if (REPO_ROOT / "setup.py").is_file():
        named.setdefault(REPO_ROOT, "this repository's root")
    what = named.get(real) or ("a directory above the current one" if real in cwd.parents else None)
    _check(what is None, f"logging.dir {text!r} is {what}: a run writes, and logging.overwrite removes, its files "
                         f"there ({allowed})")
    _check(not path.exists() or path.is_dir(), f"logging.dir {text!r} is an existing file, not a directory "
                                               f"({allowed})")


@dataclass(kw_only=True, frozen=True, slots=True)
class RunConfig:
    """The whole run: one sub-config per component."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The model and how to build it."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel degrees of the learner."""
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    """Learner batch sizes, optimizer, seed."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """vLLM rollout engine and sampling."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantages, policy loss, corrections, KL."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The RL loop: steps, batch shapes, SFT warm-start, evaluation, weight sync."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt data: the built-in arithmetic task or JSONL/parquet files."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """How responses are scored."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn episodes: the environment, its tools and limits (kind none: single-turn rollouts)."""
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    """MoE routing replay (R2/R3) and routing statistics."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing and resume."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Run directory and logs."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """Process layout for launchers."""

    def __post_init__(self):
        # Every float of the config must be finite (inf and nan are never meant); the sections' own range checks
        # ran first, so this catches what they let through (an inf learning rate, clip, tolerance, ...).
        require_finite(self)
