"""`ParallelLayout`: validated parallel degrees and the one place that initialises Megatron's groups.

    layout = ParallelLayout.from_config(run.parallel, world_size=8)
    layout.check_model(spec)             # TP divides heads, EP divides experts, ...
    groups = layout.initialize()         # Megatron parallel_state on gloo (CPU) or NCCL (GPU)

Everything else receives the `ParallelGroups` it needs instead of reaching into `parallel_state`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_sparse_rl.config.schema import ParallelConfig
from megatron_sparse_rl.models.spec import ModelSpec


@dataclass(frozen=True)
class ParallelGroups:
    """Process groups and this rank's coordinates in them."""

    tp: Any
    pp: Any
    dp: Any
    ep: Any
    etp: Any
    expert_dp: Any
    model_parallel: Any
    tp_rank: int
    pp_rank: int
    dp_rank: int
    ep_rank: int
    etp_rank: int


@dataclass(frozen=True)
class ParallelLayout:
    tp: int
    pp: int
    ep: int
    etp: int
    dp: int
    world_size: int
    sequence_parallel: bool = False
    backend: str = "gloo"

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> "ParallelLayout":
        if world_size < 1:
            raise ValueError(f"world size must be >= 1 (got {world_size})")
        model_parallel = cfg.tp * cfg.pp
        if world_size % model_parallel:
            raise ValueError(
                f"world size {world_size} is not divisible by parallel.tp * parallel.pp = {cfg.tp} * {cfg.pp} = "
                f"{model_parallel}; use a world size that is a multiple of {model_parallel}"
            )
        per_stage = world_size // cfg.pp
        if per_stage % (cfg.ep * cfg.etp):
            raise ValueError(
                f"world size / parallel.pp = {per_stage} is not divisible by parallel.ep * parallel.etp = "
                f"{cfg.ep} * {cfg.etp}; expert parallel groups must tile each pipeline stage"
            )
        backend = cfg.backend
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "gloo" and cfg.etp > 1:
            raise ValueError("parallel.etp > 1 needs NCCL: gloo cannot do the uneven all-gather it uses (got etp="
                             f"{cfg.etp}, backend gloo)")
        return cls(tp=cfg.tp, pp=cfg.pp, ep=cfg.ep, etp=cfg.etp, dp=world_size // model_parallel,
                   world_size=world_size, sequence_parallel=cfg.sequence_parallel, backend=backend)

    def check_model(self, spec: ModelSpec) -> None:
        """Raise ValueError if this layout cannot shard `spec`."""
        problems = []
        if spec.num_heads % self.tp:
            problems.append(f"parallel.tp={self.tp} must divide the attention heads ({spec.num_heads})")
        if spec.num_kv_heads % self.tp:
            problems.append(f"parallel.tp={self.tp} must divide the KV heads ({spec.num_kv_heads})")
        if spec.vocab_size % self.tp:
            problems.append(f"parallel.tp={self.tp} must divide the vocabulary size ({spec.vocab_size})")
        if spec.num_layers % self.pp:
            problems.append(f"parallel.pp={self.pp} must divide the layer count ({spec.num_layers})")
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

    def initialize(self, timeout_minutes: int = 30) -> ParallelGroups:
        """Initialise torch.distributed (if needed) and Megatron's model-parallel groups."""
        from megatron.core import parallel_state as ps

        if not dist.is_initialized():
            dist.init_process_group(self.backend)
        if dist.get_world_size() != self.world_size:
            raise ValueError(f"layout was made for world size {self.world_size}, "
                             f"but torch.distributed has {dist.get_world_size()} ranks")
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(
            tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
            expert_model_parallel_size=self.ep, expert_tensor_parallel_size=self.etp,
            distributed_timeout_minutes=timeout_minutes, create_gloo_process_groups=self.backend == "gloo",
        )
        return ParallelGroups(
            tp=ps.get_tensor_model_parallel_group(), pp=ps.get_pipeline_model_parallel_group(),
            dp=ps.get_data_parallel_group(), ep=ps.get_expert_model_parallel_group(),
            etp=ps.get_expert_tensor_parallel_group(), expert_dp=ps.get_expert_data_parallel_group(),
            model_parallel=ps.get_model_parallel_group(),
            tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
            dp_rank=ps.get_data_parallel_rank(), ep_rank=ps.get_expert_model_parallel_rank(),
            etp_rank=ps.get_expert_tensor_parallel_rank(),
        )

    @staticmethod
    def destroy() -> None:
        """Tear down Megatron's groups (the torch.distributed world stays)."""
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
