"""`ParallelDegrees`: the learner's parallel degrees (`parallel.*`) checked against a world size and a model's
shapes, as numbers only (no process group, no torch.distributed). `validate` (validation/validate.py) and the run
summary check a run with it; `ParallelLayout` (parallel/layout.py) is these degrees plus the groups it initialises.

    degrees = ParallelDegrees.from_config(run.parallel, world_size=8)   # ValueError naming the fields
    degrees.check_model(spec)             # TP divides heads, EP divides experts, the pipeline layout fits, ...
    degrees.stages(spec.num_layers)       # PipelineStages (config/stages.py): layers per (virtual) pipeline stage
    resolve_backend("auto", cuda=False)   # "gloo": what parallel.backend means on ranks with(out) CUDA
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_sparse_rl.config.schema import ParallelConfig
from megatron_sparse_rl.config.stages import PipelineStages, pipeline_stages


def resolve_backend(backend: str, cuda: bool | None = None) -> str:
    """`parallel.backend` -> the torch.distributed backend for ranks with (`cuda`; None: this machine's) CUDA."""
    if backend == "auto":
        if cuda is None:
            import torch  # lazy: importing the config package stays free of torch

            cuda = torch.cuda.is_available()
        return "nccl" if cuda else "gloo"
    return backend


@dataclass(frozen=True)
class ParallelDegrees:
    """The learner's parallel degrees over `world_size` learner ranks (data parallel is what is left)."""

    tp: int
    pp: int
    ep: int
    etp: int
    dp: int
    world_size: int
    sequence_parallel: bool = False
    cp: int = 1
    """`parallel.cp`: context parallel degree (each sequence split over cp ranks in 2 x cp chunks)."""
    backend: str = "gloo"
    rollout_ranks: int = 0
    """Disaggregated placement: ranks [world_size, world_size + rollout_ranks) own engines, not the model
    (`world_size` counts the learner ranks only). 0: every rank is a learner rank."""
    pipeline_layout: str | None = None
    """`parallel.pipeline_layout`: Megatron-Core's layout string, or None for balanced stages."""
    vpp: int = 1
    """`parallel.vpp`: model chunks (virtual pipeline stages) per pipeline rank."""

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int, rollout_ranks: int = 0, *,
                    cuda: bool | None = None) -> "ParallelDegrees":
        """`world_size`: the learner ranks (all ranks when colocated); `rollout_ranks`: engine-only ranks after them;
        `cuda`: whether the ranks that will run this layout have CUDA (resolves backend 'auto'); None = this
        machine (a CPU login node checking a GPU job passes True)."""
        if world_size < 1:
            raise ValueError(f"world size must be >= 1 (got {world_size})")
        if rollout_ranks < 0:
            raise ValueError(f"rollout_ranks must be >= 0 (got {rollout_ranks})")
        model_parallel = cfg.tp * cfg.pp * cfg.cp
        if world_size % model_parallel:
            names, values = ("parallel.tp * parallel.pp", f"{cfg.tp} * {cfg.pp}") if cfg.cp == 1 else \
                ("parallel.tp * parallel.pp * parallel.cp", f"{cfg.tp} * {cfg.pp} * {cfg.cp}")
            raise ValueError(
                f"world size {world_size} is not divisible by {names} = {values} = "
                f"{model_parallel}; use a world size that is a multiple of {model_parallel}"
            )
        per_stage = world_size // cfg.pp
        if per_stage % (cfg.ep * cfg.etp):
            raise ValueError(
                f"world size / parallel.pp = {per_stage} is not divisible by parallel.ep * parallel.etp = "
                f"{cfg.ep} * {cfg.etp}; expert parallel groups must tile each pipeline stage"
            )
        backend = resolve_backend(cfg.backend, cuda)
        if backend == "gloo" and cfg.etp > 1:
            raise ValueError("parallel.etp > 1 needs NCCL: gloo cannot do the uneven all-gather it uses (got etp="
                             f"{cfg.etp}, backend gloo)")
        return cls(tp=cfg.tp, pp=cfg.pp, ep=cfg.ep, etp=cfg.etp, dp=world_size // model_parallel,
                   world_size=world_size, sequence_parallel=cfg.sequence_parallel, cp=cfg.cp, backend=backend,
                   rollout_ranks=rollout_ranks, pipeline_layout=cfg.pipeline_layout, vpp=cfg.vpp)

    @property
    def sequence_multiple(self) -> int:
        """The learner right-pads every sequence it runs (its input positions) to a multiple of this: 2 x cp equal
        chunks for context parallelism (Megatron's load-balanced split), each divisible by tp under sequence
        parallelism. Padding after a token changes nothing before it under causal attention."""
        return (2 * self.cp if self.cp > 1 else 1) * (self.tp if self.sequence_parallel else 1)

    def padded_positions(self, positions: int) -> int:
        """The input positions the learner runs for a sequence of `positions` (right-padded to
        `sequence_multiple`)."""
        return -(-positions // self.sequence_multiple) * self.sequence_multiple

    def stages(self, num_layers: int) -> PipelineStages:
        """The decoder layers of each pipeline stage for a model of `num_layers` (ValueError naming the field when
        the layout does not fit)."""
        return pipeline_stages(self.pp, num_layers, self.pipeline_layout, self.vpp)

    def check_model(self, spec) -> None:
        """Raise ValueError if these degrees cannot shard `spec` (models/spec.py `ModelSpec`)."""
        problems = []
        if spec.num_heads % self.tp:
            problems.append(f"parallel.tp={self.tp} must divide the attention heads ({spec.num_heads})")
        if spec.num_kv_heads % self.tp:
            problems.append(f"parallel.tp={self.tp} must divide the KV heads ({spec.num_kv_heads})")
        if spec.vocab_size % self.tp:
            problems.append(f"parallel.tp={self.tp} must divide the vocabulary size ({spec.vocab_size})")
        try:
            self.stages(spec.num_layers)
        except ValueError as e:
            problems.append(str(e))
        if spec.is_moe:
            if spec.num_experts % self.ep:
                problems.append(f"parallel.ep={self.ep} must divide the expert count ({spec.num_experts})")
            if spec.moe_ffn_hidden_size % self.etp:
                problems.append(f"parallel.etp={self.etp} must divide the expert FFN size ({spec.moe_ffn_hidden_size})")
            if self.tp > 1 and not self.sequence_parallel:
                problems.append(f"parallel.sequence_parallel must be true with parallel.tp={self.tp} on an MoE model "
                                "(Megatron-Core refuses to train MoE under TP without it)")
        elif self.ep > 1:
            problems.append(f"parallel.ep={self.ep} needs an MoE model ({spec.architecture} has no routed experts)")
        has_dense_mlp = not all(spec.moe_layers) if spec.moe_layers else True
        if has_dense_mlp and spec.ffn_hidden_size % self.tp:
            problems.append(f"parallel.tp={self.tp} must divide the FFN size ({spec.ffn_hidden_size})")
        if problems:
            raise ValueError("parallel layout does not fit the model: " + "; ".join(problems))
