"""Non-finite values stop a run: a loss or gradient norm that is inf or nan, or learner weights that are.

    require_finite({"loss": 0.3, "grad norm": nan}, "RL step 3")     # NonFiniteError naming the step and quantity
    nonfinite_parameters(learner.model)                              # ["decoder.layers.0...weight: nan", ...]
    require_finite_weights(learner, "checkpoint")                    # collective: every rank raises, or none

The step checks read values the step has already brought to the host (its metrics), so they add no device
synchronisation; the weight check runs only where weights leave the learner for good (a checkpoint, hf_final)
and in the sync probe once its comparison failed.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from megatron_sparse_rl.config.loader import ConfigError


class NonFiniteError(ConfigError):
    """Training produced an inf or nan (the run diverged: usually a learning rate too large for the model); the
    message names the step and the quantity. `msrl train` prints it as `error: ...` and exits 2, without a
    traceback, having checkpointed and exported nothing after it."""


def _spelled(value: float) -> str:
    return "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"


def require_finite(values: dict[str, float], where: str) -> None:
    """Raise NonFiniteError naming `where` (e.g. "RL step 3") and every quantity of `values` that is not finite."""
    bad = [f"{name} is {_spelled(v)}" for name, v in values.items() if not math.isfinite(v)]
    if bad:
        raise NonFiniteError(
            f"{where}: {' and '.join(bad)}; the run stops here without checkpointing or exporting the weights this "
            "step produced (checkpoints saved before it are kept). The training diverged: lower the learning rate "
            "(learner.optimizer.lr, trainer.sft.lr)")


def nonfinite_parameters(model: torch.nn.Module, limit: int = 3) -> list[str]:
    """'name: nan' (or inf) for up to `limit` of this rank's parameters holding a non-finite value."""
    found = []
    for name, param in model.named_parameters():
        data = param.detach()
        if not torch.isfinite(data).all():
            found.append(f"{name}: {'nan' if torch.isnan(data).any() else 'inf'}")
            if len(found) == limit:
                break
    return found


def weights_message(found: list[str]) -> str:
    return f"the learner's weights are not finite ({', '.join(found)})"


def require_finite_weights(learner, what: str, group=None) -> None:
    """Raise NonFiniteError on every rank of `group` (default: the whole world) when any rank's learner weights
    are not finite, before `what` ("checkpoint", "hf_final") writes them."""
    found = nonfinite_parameters(learner.model)
    device = next(learner.model.parameters()).device  # nccl reduces device tensors, gloo host ones
    flag = torch.tensor([1.0 if found else 0.0], device=device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if flag.item():
        detail = weights_message(found) if found else "the learner's weights are not finite on another rank"
        raise NonFiniteError(f"{detail}: refusing to write them as a {what}. The training diverged: lower the "
                             "learning rate (learner.optimizer.lr, trainer.sft.lr)")
