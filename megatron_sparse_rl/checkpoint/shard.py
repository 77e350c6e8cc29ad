"""This rank's Megatron model shard alone (no DDP gradient buffers, no optimizer), for conversion, and its
torch_dist save/load in the format of `learner/checkpoint.py`.

    shard = build_shard(hf_dir, layout, "float32")     # after megatron_cpu.apply(); initialises the groups
    save_model_only(shard.model, out)                  # loadable by load_learner(..., load_optimizer=False)
    load_model_only(shard.model, ckpt)                 # any checkpoint save_learner / save_model_only wrote
    sharded_shapes(shard.model)                        # torch_dist key -> (global shape, dtype) of this shard

A Learner holds, besides the model, a DDP gradient buffer (fp32, the size of the model shard) and an optimizer
(for bf16 an fp32 copy of every parameter, and Adam moments after a step); a conversion needs none of them,
so peak memory is about the model shard plus the tensor being moved.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from megatron_sparse_rl.config.schema import LearnerConfig
from megatron_sparse_rl.learner.checkpoint import write_common_state
from megatron_sparse_rl.learner.chunks import load_sharded, sharded_state_dict
from megatron_sparse_rl.learner.integrity import DONE
from megatron_sparse_rl.learner.model import build_gpt_model
from megatron_sparse_rl.models import load_spec
from megatron_sparse_rl.models.base import GPTAdapter
from megatron_sparse_rl.models.spec import ModelSpec
from megatron_sparse_rl.patches import megatron_ckpt_queue, torch_dist_safe_load


@dataclass
class ModelShard:
    adapter: GPTAdapter
    spec: ModelSpec
    layout: object
    groups: object
    model: torch.nn.Module


def build_shard(model_dir, layout, dtype: str) -> ModelShard:
    """Initialise `layout`'s process groups and build this rank's GPTModel shard (random init)."""
    adapter, spec = load_spec(model_dir)
    groups = layout.initialize()
    # Every tensor is overwritten by the load that follows, so the random init (about 90% of the build time on
    # CPU) is skipped there. Megatron's local layers then leave the tensor-parallel attributes unset, which
    # learner/params.py reads: _mark_tensor_parallel sets them as the init would. With CUDA (possibly TE
    # layers) the init is kept; it is fast there.
    skip_init = not torch.cuda.is_available()
    model, _ = build_gpt_model(adapter, spec, layout, groups, dtype=dtype, seed=LearnerConfig().seed,
                               **({"perform_initialization": False} if skip_init else {}))
    if skip_init:
        _mark_tensor_parallel(model)
    return ModelShard(adapter, spec, layout, groups, model)


def _mark_tensor_parallel(model) -> None:
    """Set `tensor_model_parallel` / `partition_dim` / `partition_stride` on the weights of Megatron's local
    tensor-parallel layers, as `_initialize_affine_weight_cpu` does: vocab and column dim 0, row dim 1, stride 2
    for a gated MLP's fc1 (megatron/core/transformer/mlp.py), else 1. Checked equal to what the init sets, for
    every parameter, at TP2xEP2 on Qwen3-MoE and Mixtral."""
    from megatron.core.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear,
                                                      VocabParallelEmbedding, set_tensor_model_parallel_attributes)
    from megatron.core.transformer.mlp import MLP

    glu_fc1 = {id(m.linear_fc1) for m in model.modules()
               if isinstance(m, MLP) and m.config.gated_linear_unit and not m.config.use_kitchen}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if weight is None or hasattr(weight, "tensor_model_parallel"):
            continue
        if isinstance(module, (VocabParallelEmbedding, ColumnParallelLinear)):
            set_tensor_model_parallel_attributes(weight, True, 0, 2 if id(module) in glu_fc1 else 1)
        elif isinstance(module, RowParallelLinear):
            set_tensor_model_parallel_attributes(weight, True, 1, 1)


def _default_scheduler_state() -> dict:
    """The LR-schedule state a fresh Learner with the default LearnerConfig saves at step 0 (what
    `load_learner` expects in common_state.json); built with Megatron's scheduler over a stand-in optimizer
    because a conversion has no optimizer."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # megatron: imported when used

    o = LearnerConfig().optimizer
    decay = max(1, o.warmup_steps + 1)  # a converter "run" has total_steps=1, as Learner(total_steps=1)
    sched = OptimizerParamScheduler(
        SimpleNamespace(param_groups=[{}]), init_lr=0.0 if o.warmup_steps else o.lr, max_lr=o.lr,
        min_lr=o.min_lr, lr_warmup_steps=o.warmup_steps, lr_decay_steps=decay, lr_decay_style=o.schedule,
        start_wd=o.weight_decay, end_wd=o.weight_decay, wd_incr_steps=decay, wd_incr_style="constant")
    return sched.state_dict()


def save_model_only(model, path: Path) -> None:
    """Write a step-0, model-only checkpoint of `model` into the new directory `path` (every rank calls;
    `path` must not exist). Same files as `learner/checkpoint.py:save_learner` at step 0, less the RNG states."""
    from megatron.core import dist_checkpointing  # megatron: imported when used

    megatron_ckpt_queue.apply()  # the writer's results queue in this process (no server process to start)
    path = Path(path)
    if dist.get_rank() == 0:
        path.mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save({"model": sharded_state_dict(model)}, str(path))
    if dist.get_rank() == 0:
        write_common_state(path, {"step": 0, "scheduler": _default_scheduler_state(), "extra": {},
                                  "world_size": dist.get_world_size()})
        (path / DONE).write_text("ok\n")
    dist.barrier()


def load_model_only(model, path: Path) -> None:
    """Load the model part of a torch_dist checkpoint (saved at any layout) into `model`. Its pickles are read
    through the allowlists of `safe_load.py` (`patches/torch_dist_safe_load.py`); the conversion's checks
    (`checks.py:check_torch_dist_files`) have read each of them that way before."""
    from megatron.core import dist_checkpointing  # megatron: imported when used

    torch_dist_safe_load.apply()
    state = dist_checkpointing.load({"model": sharded_state_dict(model)}, str(path))
    load_sharded(model, state["model"])


def sharded_shapes(model) -> dict[str, tuple[tuple[int, ...] | None, str]]:
    """torch_dist key -> (global shape, dtype name) of every tensor this rank's `model` saves or loads (the keys
    and stacking of Megatron's sharded state dict: fused layer norms, experts stacked on a leading axis). The
    shape is None where Megatron allows a checkpoint's shape to differ."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    state = sharded_state_dict(model)
    apply_factories(state)  # e.g. the gated MLP's fc1, saved as two halves of one key
    return {t.key: (None if t.allow_shape_mismatch else tuple(t.global_shape), str(t.dtype).removeprefix("torch."))
            for t in nested_values(state) if isinstance(t, ShardedTensor)}


def dir_bytes(path: Path) -> int:
    """Total size of the files under `path`."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
