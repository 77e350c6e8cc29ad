"""DeepSeek Sparse Attention at context parallelism (parallel.cp > 1): the indexer's keys and the KL loss over every
context-parallel rank's positions.

Megatron-Core 0.16.1's DSA computes everything on the positions a rank holds: its `DSAIndexer` scores the rank's
queries against the rank's own keys (`_compute_index_scores`, top-k over them) and `compute_dsa_indexer_loss` masks
query i against key i. Under the load-balanced split (parallel/context.py: rank r holds chunks r and 2cp - 1 - r of
2 x cp) a query must see every earlier key of the sequence, wherever it is held:
- `ContextParallelIndexer` (the indexer of our DSA spec, models/dsa_layers.py; at cp 1 exactly Megatron's) all-gathers
  its keys (after rope, at their global positions, and the Hadamard rotation) over the context-parallel group into
  sequence order before scoring (`GatherSequence`, whose backward sums the keys' gradients over the group: every
  rank's queries scored every rank's keys), and takes the top-k over the whole sequence (Megatron takes
  min(index_topk, local length));
- `context_parallel_indexer_kl`: Megatron's dense KL loss (target: the main attention's causal softmax summed over
  heads and normalised; the indexer's softmax) for this rank's query rows against every key, per row, then gathered
  into sequence order so every rank returns the same mean, with the gradient of its own rows only
  (`GatherSequence(..., reduce=False)`); the mean covers the first `positions` positions of each row (the micro-batch
  width cp 1 runs: the learner's padding to 2 x cp chunks is left out), so the value equals cp 1's.
The sparse attention over the gathered K/V and the causal mask of the rank's global positions are in
models/dsa_attention.py (`SDPADSAttention`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sparse_rl.parallel.context import GatherSequence, blocked_keys


def _dsa_indexer():
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer

    return DSAIndexer


class ContextParallelIndexer(_dsa_indexer()):
    """Megatron's `DSAIndexer` (same constructor and parameters) whose scores read every context-parallel rank's keys
    (module docstring); at context_parallel_size 1 it is Megatron's."""

    def __init__(self, config, submodules, pg_collection=None):
        super().__init__(config, submodules, pg_collection=pg_collection)
        self.cp_group = self.pg_collection.cp if config.context_parallel_size > 1 else None

    def _compute_index_scores(self, q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """q [sq, b, heads, d], weights [sq, b, heads], k [sq, b, d] of this rank -> [b, sq, every key position]."""
        if self.cp_group is not None:
            k = GatherSequence.apply(k, self.cp_group, 0, True)
        return super()._compute_index_scores(q, weights, k)

    def forward_with_scores(self, x, qr, mask=None, packed_seq_params=None):
        """Megatron's, whose top-k at cp > 1 is over every key position (min(index_topk, sequence length))."""
        scores, indices = super().forward_with_scores(x, qr, mask, packed_seq_params)
        k = min(self.index_topk, scores.shape[-1])
        if self.cp_group is not None and indices.shape[-1] < k:
            indices = scores.topk(k, dim=-1)[1]
        return scores, indices


def context_parallel_indexer_kl(index_scores: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                                softmax_scale: float, rows: torch.Tensor, positions: int | None, cp_group,
                                tp_group) -> torch.Tensor:
    """Megatron's `compute_dsa_indexer_loss` (dense, before the coefficient) at cp > 1 (module docstring):
    index_scores [b, sq, sk] (masked), query [sq, b, heads, d] of this rank's global positions `rows` [sq], key
    [sk, b, heads, d] of every position (both detached) -> the KL mean over (batch, first `positions` positions;
    None: all), the same on every rank of `cp_group`."""
    sk = key.shape[0]
    scores = torch.einsum("sbhd,tbhd->bhst", query.float(), key.float()) * softmax_scale
    scores = scores.masked_fill(blocked_keys(rows, sk), float("-inf"))
    target = torch.softmax(scores, dim=-1, dtype=torch.float32).sum(dim=1)  # [b, sq, sk]
    if tp_group is not None and tp_group.size() > 1:  # heads are split over TP (as Megatron: no autograd here)
        dist.all_reduce(target, group=tp_group)
    target = target / target.sum(dim=-1, keepdim=True)
    index = torch.softmax(index_scores, dim=-1, dtype=torch.float32)
    kl = (target * (torch.log(target + 1e-10) - torch.log(index + 1e-10))).sum(dim=-1)  # [b, sq]
    kl = GatherSequence.apply(kl, cp_group, 1, False)  # [b, every position], sequence order
    return kl[:, :positions].mean()
