"""The DSA indexer's own training loss in RL (`model.dsa_indexer_loss_coeff`): Megatron-Core 0.16.1's KL loss of
DeepSeek Sparse Attention's lightning indexer, its gradient scale, and its per-step value `indexer/kl_loss`.

What Megatron computes (`experimental_attention_variant/dsa.py`, `DSAttention.forward`, in training with grad
enabled): per DSA layer and micro-batch, `compute_dsa_indexer_loss` takes the main attention's dense causal softmax of
every head (query and key detached, fp32), sums it over the heads and L1-normalises it per query (the target p), the
indexer's softmax over its scores (q) with the causal mask, and returns `coeff * mean over (rows, queries) of
sum_t p log(p / q)` (`dsa_indexer_use_sparse_loss` = False here: all earlier tokens, not only the selected ones).
The indexer reads detached hidden states and q latent, so this loss trains the indexer's parameters only.
`DSAIndexerLossAutoScaler` hangs it on the attention output: its backward adds `main_loss_backward_scale` (a
class-wide tensor, 1.0 unless set; Megatron-Core's schedule does not set it) as the loss's gradient.

What this module adds (`IndexerLoss`, owned by the Learner, only when the coefficient is > 0):
- the scale: before each train_step `begin(micro_batches)` sets the auto-scaler's scale to 1 / (micro-batches of
  this rank x data-parallel size), so the step's indexer loss is coeff x the MEAN of the micro-batches' KL over all
  data-parallel ranks (the learner's main loss is summed over micro-batches and ranks, already normalised; without
  the scale the indexer's gradient would grow with the micro-batch count);
- the value: `finish()` reads Megatron's tracker (`DSAIndexerLossLoggingHelper.tracker["values"]`, coeff x KL
  summed per layer over the step's calls) and returns `indexer/kl_loss`: the KL (nats, before the coefficient)
  averaged over the DSA layers and, per layer, over the forward calls that added it (counted by a forward pre-hook
  under DSAttention's own condition, training with grad enabled: with activation recompute that is the backward's
  recompute forward, the first one runs without grad), global over the data-parallel (and pipeline) ranks.

No CUDA shim is needed on CPU: `save_loss_to_tracker` allocates the tracker on `torch.cuda.current_device()`, which
`patches/megatron_cpu.py` (`patch_current_device`) answers with the CPU. Megatron's `track_indexer_metrics` /
`reduce_loss_in_tracker` are not called: they reduce over parallel_state's global groups and write to TensorBoard /
W&B; the tracker's values are read here instead, and emptied at every `begin`.
Context parallelism (parallel.cp > 1): each rank's DSA attention computes the KL of its own query rows and gathers
the rows, so every rank of the group tracks the whole KL (models/dsa_context.py); `before_micro_batch` hands the
attention the micro-batch's width before the learner's padding to 2 x cp chunks, which the mean leaves out.
Known limits: the KL's mean includes a micro-batch's right-padding positions (Megatron's loss takes no padding mask;
rows of one micro-batch are padded to its longest row); the tracker and the auto-scaler's scale are class-wide
(one learner with the loss per process).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

MEGATRON_VERSION = "0.16.1"


def _dsa():
    """Megatron's dsa module, checked for the version and the names this module relies on."""
    import megatron.core
    from megatron.core.transformer.experimental_attention_variant import dsa

    if megatron.core.__version__ != MEGATRON_VERSION:
        raise RuntimeError(f"the DSA indexer loss was written for megatron-core {MEGATRON_VERSION}, found "
                           f"{megatron.core.__version__}; install megatron-core=={MEGATRON_VERSION}")
    helper, scaler = getattr(dsa, "DSAIndexerLossLoggingHelper", None), getattr(dsa, "DSAIndexerLossAutoScaler", None)
    if not (isinstance(getattr(helper, "tracker", None), dict) and hasattr(scaler, "set_loss_scale")
            and hasattr(dsa, "DSAttention")):
        raise RuntimeError("megatron.core.transformer.experimental_attention_variant.dsa lacks "
                           "DSAIndexerLossLoggingHelper.tracker / DSAIndexerLossAutoScaler.set_loss_scale / "
                           f"DSAttention, which the DSA indexer loss reads (written for megatron-core "
                           f"{MEGATRON_VERSION})")
    return dsa


def indexer_loss_config(spec, coeff: float) -> dict:
    """The TransformerConfig keywords that turn the loss on: {"dsa_indexer_loss_coeff": coeff} for a DSA model
    (the adapter's default is 0.0 = off), {} at 0; a coefficient > 0 on a model without an indexer is refused."""
    from megatron_sparse_rl.models.dsa import indexer_loss_problem

    if not (isinstance(coeff, (int, float)) and not isinstance(coeff, bool) and coeff >= 0):
        raise ValueError(f"model.dsa_indexer_loss_coeff must be a number >= 0 (got {coeff!r})")
    problem = indexer_loss_problem(spec, coeff)
    if problem:
        raise ValueError(problem)
    return {"dsa_indexer_loss_coeff": float(coeff)} if coeff else {}


class IndexerLoss:
    """One learner's DSA indexer loss bookkeeping (module docstring): gradient scale per step and the step's KL."""

    def __init__(self, model, config, groups, dp: int, pp: int):
        self._dsa = _dsa()
        self.coeff = float(config.dsa_indexer_loss_coeff)
        if not self.coeff > 0:
            raise ValueError(f"IndexerLoss needs dsa_indexer_loss_coeff > 0 on the TransformerConfig "
                             f"(got {config.dsa_indexer_loss_coeff})")
        self.groups, self.dp, self.pp = groups, dp, pp
        self.num_layers = config.num_layers
        self.calls = torch.zeros(self.num_layers, dtype=torch.float64)
        self.device = next(model.parameters()).device  # where the collectives run (gloo: CPU, nccl: the GPU)
        self._positions: int | None = None
        self._hooks = [m.register_forward_pre_hook(self._count, with_kwargs=True) for m in model.modules()
                       if isinstance(m, self._dsa.DSAttention)]
        if not self._hooks:
            raise ValueError("dsa_indexer_loss_coeff > 0 but the model has no DSAttention layer")

    def _count(self, module, args, kwargs):
        if module.training and torch.is_grad_enabled():  # the condition under which DSAttention adds the loss
            self.calls[module.layer_number - 1] += 1
        if getattr(module, "cp_group", None) is not None and self._positions is not None:
            return args, {**kwargs, "indexer_loss_positions": self._positions}  # models/dsa_attention.py, cp > 1
        return None

    def before_micro_batch(self, positions: int) -> None:
        """Before each micro-batch forward: its input positions before the context-parallel padding (the KL's mean
        at cp > 1 covers those, as at cp 1). A backward's recompute forward reads the same value: without a
        pipeline each micro-batch's backward follows its forward, and with one every micro-batch has one width."""
        self._positions = positions

    def begin(self, micro_batches: int) -> None:
        """Before a train_step of `micro_batches` micro-batches on this rank: empty the tracker and the call counts,
        set the gradient scale to 1 / (micro_batches x data-parallel size)."""
        self._dsa.DSAIndexerLossLoggingHelper.tracker.clear()
        self.calls.zero_()
        self._dsa.DSAIndexerLossAutoScaler.set_loss_scale(torch.tensor(1.0 / (micro_batches * self.dp)))

    def finish(self) -> dict[str, float]:
        """After the train_step's backward: {"indexer/kl_loss": mean KL over layers}, global over the ranks."""
        tracker = self._dsa.DSAIndexerLossLoggingHelper.tracker
        values = tracker.get("values")
        summed = torch.zeros(2, self.num_layers, dtype=torch.float64)
        if values is not None:
            summed[0] = values.detach().to("cpu", torch.float64) / self.coeff
        summed[1] = self.calls
        summed = summed.to(self.device)
        for group, size in ((self.groups.pp, self.pp), (self.groups.dp, self.dp)):
            if size > 1:
                dist.all_reduce(summed, group=group)
        tracker.clear()
        summed = summed.cpu()
        ran = summed[1] > 0
        if not bool(ran.any()):
            return {}
        return {"indexer/kl_loss": float((summed[0][ran] / summed[1][ran]).mean())}
