"""Indexer replay: routing replay for DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5) on the learner.

Every DSA layer's lightning indexer picks, per query, the `index_topk` earlier tokens its attention reads. As MoE
routers flip between pi_old and pi_theta, so do these choices. R2 for attention: the old-logprob forward records
each layer's top-k per query, and every update's forward attends exactly those tokens instead of the indexer's
fresh top-k (the indexer still runs: its fresh choice is what `indexer/flip_rate` compares with).

    indexer = learner.indexer                                    # None: the model has no DSA layer
    out = learner.forward_logprobs(tokens, lengths=lengths, extras=ForwardExtras(indexer=indexer.old_forward()))
    recorded = out["indexer"].indices                            # int16/int32 [B, S-1, DSA layers, index_topk]
    metrics = learner.train_step(tokens, loss_fn, lengths=lengths,
                                 extras=ForwardExtras(indexer=indexer.update(recorded)))
    # metrics["indexer/flip_rate"], metrics["indexer/flip_rate/layer_<i>"]

Indices are stored per row and query position, each query's entries clamped to <= its position (the indexer's
picks above it are -inf-score fillers the causal mask drops whatever they are), so a row's indices replay in a
micro-batch of any width. `ModelIndexer` wraps each `DSAIndexer.forward_with_scores` of one model (the method
DSAttention calls) for as long as it is open; between calls it returns the indexer's own choice unchanged.
Not here: R3 (the engine's indices: vLLM's DSA runs on GPU only and no engine side records them), pipeline
parallelism (a stage sees only its layers; the learner refuses the request at pp > 1).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

MEGATRON_VERSION = "0.16.1"


class IndexerReplayError(RuntimeError):
    """Indices missing, misshapen, or for another batch; or a request the learner cannot serve."""


def _rows(index) -> torch.Tensor:
    return torch.as_tensor(index, dtype=torch.long).reshape(-1)


@dataclass(kw_only=True, frozen=True, slots=True)
class IndexerRequest:
    """What the DSA indexers do in one learner call (rows = the call's rows)."""

    replay: torch.Tensor | None = None
    """int [B, S-1, DSA layers, index_topk]: per row, query position and DSA layer the tokens to attend (a
    recorded `IndexerResult.indices`); used instead of the indexer's fresh top-k."""
    record: bool = False
    """Return the indexer's own (fresh) top-k of the call (`IndexerResult.indices`); under replay, its choice
    beside the replayed one. Needed by `compare_with`."""
    compare_with: torch.Tensor | None = None
    """Indices to compare the call's fresh choice with (same layout as `replay`): `indexer/flip_rate` and per
    layer `indexer/flip_rate/layer_<i>`, the share of real queries whose selected set differs."""

    def __post_init__(self):
        if self.replay is None and not self.record:
            raise ValueError("IndexerRequest asks for nothing: give indices to replay or record=True")
        if self.compare_with is not None and not self.record:
            raise ValueError("IndexerRequest.compare_with compares the call's fresh indices: it needs record=True")

    def select(self, index) -> IndexerRequest:
        """The request for rows `index` of the call's rows."""
        rows = _rows(index)
        return IndexerRequest(replay=None if self.replay is None else self.replay[rows], record=self.record,
                              compare_with=None if self.compare_with is None else self.compare_with[rows])


@dataclass(frozen=True)
class IndexerResult:
    """One call's outcome: the fresh `indices` (when recorded) and `metrics` (flip rates with compare_with)."""

    indices: torch.Tensor | None = None
    metrics: dict = field(default_factory=dict)


def clamp_causal(indices: torch.Tensor) -> torch.Tensor:
    """[b, S, k] top-k indices with every entry above its query position replaced by the position itself (the
    causal mask drops those entries, and for such queries every earlier token is selected anyway)."""
    pos = torch.arange(indices.shape[1], device=indices.device).view(1, -1, 1)
    return torch.where(indices > pos, pos, indices)


def selected_sets_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bool [..., S]: whether the token sets of [..., S, k] indices `a` and `b` differ at each query, after
    `clamp_causal` (duplicates collapse: a set, not a list)."""
    width = int(max(a.max(), b.max())) + 1
    sets = [torch.zeros(*x.shape[:-1], width, dtype=torch.bool).scatter_(-1, x.long(), True) for x in (a, b)]
    return (sets[0] != sets[1]).any(-1)


def flip_rate_metrics(old: torch.Tensor, new: torch.Tensor, lengths: torch.Tensor, layers: tuple[int, ...],
                      group=None) -> dict[str, float]:
    """`indexer/flip_rate` and `indexer/flip_rate/layer_<i>` over the real queries (the first n - 1 positions of a
    row of n tokens) of [B, S-1, layers, k] indices `old` (pi_old's) and `new` (pi_theta's), counts summed over
    `group` (data-parallel ranks)."""
    real = torch.arange(old.shape[1]).view(1, -1) < (lengths.view(-1, 1) - 1)  # [B, S-1]
    differ = selected_sets_differ(old.permute(0, 2, 1, 3), new.permute(0, 2, 1, 3))  # [B, layers, S-1]
    counts = torch.cat([(differ & real.unsqueeze(1)).sum((0, 2)).double(), real.sum().double().view(1)])
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    total = max(float(counts[-1]), 1.0)
    metrics = {f"indexer/flip_rate/layer_{layer}": float(counts[j]) / total for j, layer in enumerate(layers)}
    metrics["indexer/flip_rate"] = float(counts[:-1].sum()) / (total * len(layers))
    return metrics


class ModelIndexer:
    """The DSA indexers of one model, wrapped while open: per micro-batch, replay the given indices and/or keep the
    fresh ones (`set_micro_batch`); idle, every indexer returns its own choice."""

    def __init__(self, model: torch.nn.Module):
        from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer

        if not hasattr(DSAIndexer, "forward_with_scores"):
            raise ImportError(f"DSAIndexer.forward_with_scores is missing: indexer replay was written for "
                              f"Megatron-Core {MEGATRON_VERSION}")
        self.indexers = [m for m in model.modules() if isinstance(m, DSAIndexer)]
        self.topk = self.indexers[0].index_topk if self.indexers else 0
        self._targets: list[torch.Tensor] | None = None
        self._keep = False
        self.fresh: list[torch.Tensor | None] = [None] * len(self.indexers)
        for j, module in enumerate(self.indexers):
            module.forward_with_scores = self._wrap(j, module.forward_with_scores)

    def _wrap(self, j: int, call):
        def forward_with_scores(*args, **kwargs):
            scores, indices = call(*args, **kwargs)
            if self._keep:  # a recompute overwrites with the same values
                self.fresh[j] = self._padded(clamp_causal(indices.detach()))
            if self._targets is None:
                return scores, indices
            return scores, self._targets[j].to(indices.device)
        return forward_with_scores

    def _padded(self, indices: torch.Tensor) -> torch.Tensor:
        """[b, S, k'] -> [b, S, topk]: a micro-batch narrower than topk picks k' = S; the extra entries repeat the
        query position (already selected)."""
        short = self.topk - indices.shape[-1]
        if short <= 0:
            return indices
        pos = torch.arange(indices.shape[1], device=indices.device).view(1, -1, 1)
        return torch.cat([indices, pos.expand(indices.shape[0], -1, short)], dim=-1)

    def set_micro_batch(self, targets: list[torch.Tensor] | None, keep: bool) -> None:
        """The next micro-batch's replayed indices per layer ([b, width, topk] each; None: the fresh top-k) and
        whether to keep the fresh choice."""
        self._targets, self._keep = targets, keep
        self.fresh = [None] * len(self.indexers)

    def close(self) -> None:
        """Unwrap the indexers (they select themselves again)."""
        for module in self.indexers:
            module.__dict__.pop("forward_with_scores", None)
        self.indexers = []


class LearnerIndexer:
    """A Learner's indexer replay state (built when its model has DSA layers): the RL step's requests per
    `routing.indexer_replay` (`old_forward`, `update`) and one call's bookkeeping (`begin`, `before_micro_batch`,
    `finish`, `stop`), driven by the Learner."""

    def __init__(self, model: torch.nn.Module, layout, groups, mode: str = "none"):
        if mode not in ("none", "R2"):
            raise ValueError(f"routing.indexer_replay must be 'none' or 'R2' on the learner (got {mode!r})")
        self.layout, self.groups, self.mode = layout, groups, mode
        self.model = ModelIndexer(model)
        self.layers = tuple(range(len(self.model.indexers)))
        self._request: IndexerRequest | None = None
        self._lengths: torch.Tensor | None = None
        self._parts: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        self._pending: torch.Tensor | None = None
        self._shape: tuple[int, int] = (0, 0)

    # ---- what the RL step's forwards ask for (routing.indexer_replay) ------------------------------
    def old_forward(self) -> IndexerRequest | None:
        """R2: record the old-logprob forward's indices; none: nothing."""
        return IndexerRequest(record=True) if self.mode == "R2" else None

    def update(self, recorded: torch.Tensor | None) -> IndexerRequest | None:
        """R2: replay `recorded` (the old forward's `IndexerResult.indices` of the update's rows), comparing the
        update's fresh choice with it (indexer/flip_rate); none: nothing."""
        if self.mode == "none":
            return None
        if recorded is None:
            raise IndexerReplayError(f"routing.indexer_replay={self.mode}: no recorded indices to replay")
        return IndexerRequest(replay=recorded, record=True, compare_with=recorded)

    # ---- one learner call ------------------------------------------------------------------------
    def begin(self, tokens: torch.Tensor, lengths: torch.Tensor | None, request: IndexerRequest) -> None:
        """Check `request` against the call (before any forward) and start it."""
        if self.layout.pp > 1:
            raise IndexerReplayError(f"indexer replay/recording runs with parallel.pp = 1 (got {self.layout.pp}): a "
                                     "pipeline stage holds only its own DSA layers")
        rows, width = tokens.shape[0], tokens.shape[1] - 1
        want = (rows, width, len(self.layers), self.model.topk)
        for name in ("replay", "compare_with"):
            x = getattr(request, name)
            if x is not None and (tuple(x.shape) != want or x.dtype.is_floating_point):
                raise IndexerReplayError(f"IndexerRequest.{name} must be integer [rows, seq-1, DSA layers, "
                                         f"index_topk] = {list(want)} (got {x.dtype} {list(x.shape)})")
        self._request, self._shape = request, (rows, width)
        self._lengths = (torch.full((rows,), width + 1, dtype=torch.long) if lengths is None
                         else torch.as_tensor(lengths, dtype=torch.long).reshape(-1))
        self._parts, self._pending = [], None

    def before_micro_batch(self, index: torch.Tensor, inputs: torch.Tensor) -> None:
        """Before each micro-batch forward: that micro-batch's replayed indices, and keep its fresh ones."""
        self._collect()
        targets = None
        if self._request.replay is not None:
            width = inputs.shape[1]
            rows = self._request.replay[index, :width].long()  # [b, width, layers, k]
            targets = [rows[:, :, j].contiguous() for j in range(len(self.layers))]
        self._pending = index.clone()
        self.model.set_micro_batch(targets, keep=self._request.record)

    def _collect(self) -> None:
        if self._pending is not None and self._request.record:
            if any(f is None for f in self.model.fresh):
                raise IndexerReplayError("a DSA layer recorded no indices for a micro-batch")
            self._parts.append((self._pending, list(self.model.fresh)))
        self._pending = None

    def finish(self) -> IndexerResult:
        """End the call: the fresh indices (record) and, with compare_with, the flip rates (global over the
        data-parallel ranks: every rank's call must have compare_with)."""
        request = self._request
        try:
            self._collect()
            indices = self._assemble() if request.record else None
        finally:
            self.stop()
        metrics = {}
        if request.compare_with is not None:
            metrics = flip_rate_metrics(request.compare_with, indices, self._lengths, self.layers,
                                        group=self.groups.dp if self.groups is not None else None)
        return IndexerResult(indices=indices, metrics=metrics)

    def _assemble(self) -> torch.Tensor:
        rows, width = self._shape
        dtype = torch.int16 if width < 2 ** 15 else torch.int32
        pos = torch.arange(width).view(1, -1, 1, 1)
        out = pos.expand(rows, width, len(self.layers), self.model.topk).to(dtype).clone()
        for index, fresh in self._parts:
            mb = torch.stack([f.cpu() for f in fresh], dim=2)  # [b, w, layers, k]
            out[index, :mb.shape[1]] = mb.to(dtype)
        return out

    def stop(self) -> None:
        """The indexers select themselves again (also when a call fails half-way)."""
        self.model.set_micro_batch(None, keep=False)
        self._request, self._pending, self._parts = None, None, []

    def close(self) -> None:
        self.model.close()
