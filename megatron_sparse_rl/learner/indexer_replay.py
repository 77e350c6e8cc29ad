"""Indexer replay: routing replay for DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5) on the learner.

Every DSA layer's lightning indexer picks, per query, the `index_topk` earlier tokens its attention reads. As MoE
routers flip between pi_old and pi_theta, so do these choices. R2 for attention: the old-logprob forward records
each layer's top-k per query, and every update's forward attends exactly those tokens instead of the indexer's
fresh top-k (the indexer still runs: its fresh choice is what `indexer/flip_rate` compares with).

    indexer = learner.indexer                                    # None: the model has no DSA layer
    out = learner.forward_logprobs(tokens, lengths=lengths, extras=ForwardExtras(indexer=indexer.old_forward()))
    recorded = out["indexer"].record                             # IndexerRecord: indices + each row's token hash
    recorded.positions()                                         # int64 [B, S-1, DSA layers, index_topk]
    metrics = learner.train_step(tokens, loss_fn, lengths=lengths,
                                 extras=ForwardExtras(indexer=indexer.update(recorded)))
    # metrics["indexer/flip_rate"], ["indexer/agreement"], ["indexer/replay_applied_fraction"] (and per layer)

Indices are stored per row and query position, each query's entries clamped to <= its position (the indexer's
picks above it are -inf-score fillers the causal mask drops whatever they are), so a row's indices replay in a
micro-batch of any width. `ModelIndexer` wraps each `DSAIndexer.forward_with_scores` of one model (the method
DSAttention calls) for as long as it is open; between calls it returns the indexer's own choice unchanged. A
record carries the crc32 of each row's real tokens (moe/storage.py `token_hash`, as `RouteStore` does): a replay on
other tokens, or on indices of the wrong shape, is refused before the forward. `indexer/replay_applied_fraction` is
measured where the attention reads the selection: the sparse attention DSAttention calls (models/dsa_attention.py
`ENTRY`, in place of Megatron's `unfused_dsa_fn`, under either kernel choice) shows its `topk_indices` to the pending
observer, which compares them with the replayed ones.
R3 (`old_forward(engine_record)`): the old forward replays the engine's indices (rollout/indexer_capture.py, a
GPU engine; never run here) and records the learner's own beside them; the updates replay the engine's.
Context parallelism (parallel.cp > 1): each rank's indexers pick, per query row it holds, over every key position
(models/dsa_context.py); the replayed indices are cut to this rank's rows (positions the learner pads after the
record select themselves) and the fresh ones and the applied flags are gathered back into sequence order, so every
rank of the group returns the whole record and the same metrics.
Pipeline stages (even or not): a record's columns are the model's DSA layers in order; each stage replays and records
its own columns (those after the DSA layers of the earlier stages) and the stages join their columns over the pipeline
group when a call finishes, so every rank returns the whole record and the same metrics.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_sparse_rl.models import dsa_attention
from megatron_sparse_rl.moe.indexer_storage import (
    IndexerRecord, IndexerReplayError, _rows, pack_positions, row_hashes, unpack_positions,
)
from megatron_sparse_rl.parallel.context import cp_positions, gather_sequence, split_sequence

MEGATRON_VERSION = dsa_attention.MEGATRON_VERSION  # the release whose DSA modules this wraps


@dataclass(kw_only=True, frozen=True, slots=True)
class IndexerRequest:
    """What the DSA indexers do in one learner call (rows = the call's rows)."""

    replay: IndexerRecord | None = None
    """Per row, query position and DSA layer the tokens to attend (a recorded `IndexerResult.record` of the same
    tokens); used instead of the indexer's fresh top-k. Measured: `indexer/replay_applied_fraction`."""
    record: bool = False
    """Return the indexer's own (fresh) top-k of the call (`IndexerResult.record`); under replay, its choice
    beside the replayed one. Needed by `compare_with`."""
    compare_with: IndexerRecord | None = None
    """A record to compare the call's fresh choice with: `indexer/flip_rate` (the share of real queries whose
    selected set differs) and `indexer/agreement` (the mean share of the recorded tokens the fresh choice also
    selects), each also per layer (`.../layer_<i>`)."""

    def __post_init__(self):
        if self.replay is None and not self.record:
            raise ValueError("IndexerRequest asks for nothing: give indices to replay or record=True")
        if self.compare_with is not None and not self.record:
            raise ValueError("IndexerRequest.compare_with compares the call's fresh indices: it needs record=True")

    def select(self, index) -> IndexerRequest:
        """The request for rows `index` of the call's rows."""
        rows = _rows(index)
        return IndexerRequest(replay=None if self.replay is None else self.replay.select(rows), record=self.record,
                              compare_with=None if self.compare_with is None else self.compare_with.select(rows))


@dataclass(frozen=True)
class IndexerResult:
    """One call's outcome: the fresh top-k `record` (when recorded) and `metrics` (flip rate and agreement with
    compare_with, applied fraction with replay)."""

    record: IndexerRecord | None = None
    metrics: dict = field(default_factory=dict)


def clamp_causal(indices: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """[b, S, k] top-k indices with every entry above its query position replaced by the position itself (the
    causal mask drops those entries, and for such queries every earlier token is selected anyway). `rows` [S]: the
    queries' positions (a context-parallel rank's); None: 0..S-1."""
    pos = (torch.arange(indices.shape[1]) if rows is None else rows).to(indices.device).view(1, -1, 1)
    return torch.where(indices > pos, pos, indices)


def _token_sets(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [..., S, width] membership sets of [..., S, k] indices `a` and `b` (duplicates collapse)."""
    width = int(max(a.max(), b.max())) + 1
    return tuple(torch.zeros(*x.shape[:-1], width, dtype=torch.bool).scatter_(-1, x.long(), True) for x in (a, b))


def selected_sets_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bool [..., S]: whether the token sets of [..., S, k] indices `a` and `b` differ at each query, after
    `clamp_causal` (duplicates collapse: a set, not a list)."""
    sa, sb = _token_sets(a, b)
    return (sa != sb).any(-1)


def _real_queries(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """bool [B, width]: the real queries (the first n - 1 positions of a row of n tokens)."""
    return torch.arange(width).view(1, -1) < (lengths.view(-1, 1) - 1)


def _per_layer(name: str, counts: torch.Tensor, layers: tuple[int, ...], group) -> dict[str, float]:
    """`name` (the mean over layers) and `name/layer_<i>` from per-layer sums counts[:-1] over counts[-1] real
    queries, the counts summed over `group` (data-parallel ranks) first."""
    counts = counts.double()
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    total = max(float(counts[-1]), 1.0)
    metrics = {f"{name}/layer_{layer}": float(counts[j]) / total for j, layer in enumerate(layers)}
    metrics[name] = float(counts[:-1].sum()) / (total * len(layers))
    return metrics


def flip_rate_metrics(old: torch.Tensor, new: torch.Tensor, lengths: torch.Tensor, layers: tuple[int, ...],
                      group=None) -> dict[str, float]:
    """Over the real queries of [B, S-1, layers, k] indices `old` (pi_old's) and `new` (pi_theta's), counts summed
    over `group`: `indexer/flip_rate` (share of queries whose selected set differs) and `indexer/agreement` (mean
    share of old's selected tokens that new also selects), each also per layer (`.../layer_<i>`)."""
    real = _real_queries(lengths, old.shape[1]).unsqueeze(1)  # [B, 1, S-1]
    sa, sb = _token_sets(old.permute(0, 2, 1, 3), new.permute(0, 2, 1, 3))  # [B, layers, S-1, width]
    differ = (sa != sb).any(-1) & real
    overlap = ((sa & sb).sum(-1).double() / sa.sum(-1).clamp(min=1).double()) * real
    n = real.sum().double().view(1)
    return {**_per_layer("indexer/flip_rate", torch.cat([differ.sum((0, 2)).double(), n]), layers, group),
            **_per_layer("indexer/agreement", torch.cat([overlap.sum((0, 2)), n]), layers, group)}


def applied_metrics(applied: torch.Tensor, lengths: torch.Tensor, layers: tuple[int, ...],
                    group=None) -> dict[str, float]:
    """`indexer/replay_applied_fraction` (and per layer): the share of real queries whose attention read exactly the
    replayed token set, from bool [B, S-1, layers] `applied`, counts summed over `group`."""
    real = _real_queries(lengths, applied.shape[1]).unsqueeze(-1)
    n = real.sum().double().view(1)
    counts = torch.cat([(applied & real).sum((0, 1)).double(), n])
    return _per_layer("indexer/replay_applied_fraction", counts, layers, group)


class ModelIndexer:
    """The DSA indexers of one model, wrapped while open: per micro-batch, replay the given indices and/or keep the
    fresh ones (`set_micro_batch`); idle, every indexer returns its own choice. Under replay, `applied[j]` (bool
    [b, S]) says per query whether layer j's sparse attention read exactly the replayed set. With `cp_group`
    (context parallelism) each rank's indexers see its query rows (parallel/context.py `cp_positions`), replay the
    targets of those rows, and `fresh` / `applied` are gathered over the group into sequence order."""

    def __init__(self, model: torch.nn.Module, cp_group=None):
        from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexer

        if not hasattr(DSAIndexer, "forward_with_scores"):
            raise ImportError(f"DSAIndexer.forward_with_scores is missing: indexer replay was written for "
                              f"Megatron-Core {MEGATRON_VERSION}")
        self._entry = dsa_attention.install()
        self.cp_group = cp_group
        self.indexers = [m for m in model.modules() if isinstance(m, DSAIndexer)]
        self.topk = self.indexers[0].index_topk if self.indexers else 0
        self._targets: list[torch.Tensor] | None = None
        self._keep = False
        self.fresh: list[torch.Tensor | None] = [None] * len(self.indexers)
        self.applied: list[torch.Tensor | None] = [None] * len(self.indexers)
        for j, module in enumerate(self.indexers):
            module.forward_with_scores = self._wrap(j, module.forward_with_scores)

    def _wrap(self, j: int, call):
        def forward_with_scores(*args, **kwargs):
            scores, indices = call(*args, **kwargs)
            if self._keep:  # a recompute overwrites with the same values
                rows = self._rows(indices.shape[1])
                self.fresh[j] = self._sequence(self._padded(clamp_causal(indices.detach(), rows), rows))
            if self._targets is None:
                return scores, indices
            target = self._targets[j].to(indices.device)
            self._entry.pending = lambda attended: self._attended(j, attended, target)
            return scores, target
        return forward_with_scores

    def _attended(self, j: int, attended: torch.Tensor, target: torch.Tensor) -> None:
        rows = self._rows(attended.shape[1])
        same = ~selected_sets_differ(clamp_causal(attended.detach(), rows).cpu(), target.cpu())
        self.applied[j] = self._sequence(same.to(torch.uint8)).bool()

    def _rows(self, held: int) -> torch.Tensor | None:
        """The positions of this rank's `held` query rows: None (0..held-1) without context parallelism."""
        if self.cp_group is None:
            return None
        cp = self.cp_group.size()
        return cp_positions(held * cp, cp, self.cp_group.rank())

    def _sequence(self, local: torch.Tensor) -> torch.Tensor:
        """[b, this rank's rows, ...] -> [b, every position, ...] in sequence order (unchanged without CP)."""
        return local if self.cp_group is None else gather_sequence(local, self.cp_group, 1)

    def _padded(self, indices: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[b, S, k'] -> [b, S, topk]: a micro-batch narrower than topk picks k' = S; the extra entries repeat the
        query position (already selected; `rows` as in `clamp_causal`)."""
        short = self.topk - indices.shape[-1]
        if short <= 0:
            return indices
        pos = (torch.arange(indices.shape[1]) if rows is None else rows).to(indices.device).view(1, -1, 1)
        return torch.cat([indices, pos.expand(indices.shape[0], -1, short)], dim=-1)

    def set_micro_batch(self, targets: list[torch.Tensor] | None, keep: bool) -> None:
        """The next micro-batch's replayed indices per layer ([b, width, topk] each; None: the fresh top-k) and
        whether to keep the fresh choice."""
        self._targets, self._keep = targets, keep
        self.fresh = [None] * len(self.indexers)
        self.applied = [None] * len(self.indexers)
        self._entry.pending = None

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
        if mode not in ("none", "R2", "R3"):
            raise ValueError(f"routing.indexer_replay must be 'none', 'R2' or 'R3' on the learner (got {mode!r})")
        self.layout, self.groups, self.mode = layout, groups, mode
        self.cp_group = groups.cp if getattr(layout, "cp", 1) > 1 else None
        self.model = ModelIndexer(model, self.cp_group)
        # the record's columns: every DSA layer of the model in order; this stage's j-th indexer is column _first + j
        self._first, total = self._stage_columns()
        self.layers = tuple(range(total))
        self._request: IndexerRequest | None = None
        self._lengths: torch.Tensor | None = None
        self._tokens: torch.Tensor | None = None
        self._parts: list[tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor | None]]] = []
        self._pending: torch.Tensor | None = None
        self._shape: tuple[int, int] = (0, 0)

    def _stage_columns(self) -> tuple[int, int]:
        """(this stage's first column, the model's DSA layers): the counts of the earlier stages' indexers."""
        local = len(self.model.indexers)
        if self.layout.pp == 1:
            return 0, local
        counts: list = [None] * self.layout.pp
        dist.all_gather_object(counts, local, group=self.groups.pp)
        return sum(counts[:self.groups.pp_rank]), sum(counts)

    def _join_stages(self, local: torch.Tensor) -> torch.Tensor:
        """[..., this stage's DSA layers, ...] (layers on dim 2) -> every stage's, in order (collective over pp)."""
        if self.layout.pp == 1:
            return local
        parts: list = [None] * self.layout.pp
        dist.all_gather_object(parts, local, group=self.groups.pp)
        return torch.cat(parts, dim=2)

    # ---- what the RL step's forwards ask for (routing.indexer_replay) ------------------------------
    def old_forward(self, engine: IndexerRecord | None = None) -> IndexerRequest | None:
        """R2: record the old-logprob forward's indices; R3: replay `engine` (the rollout engine's indices in the
        call's layout, required), recording the learner's own choice and comparing it with the engine's; none:
        nothing."""
        if self.mode == "R3":
            if engine is None:
                raise IndexerReplayError("routing.indexer_replay=R3 but the rollout batch has no engine indices "
                                         "(RolloutBatch.features.indexer_record missing: is the engine's capture on?)")
            return IndexerRequest(replay=engine, record=True, compare_with=engine)
        return IndexerRequest(record=True) if self.mode == "R2" else None

    def after_old_forward(self, result: IndexerResult, engine: IndexerRecord | None) -> tuple[IndexerRecord, dict]:
        """(what the updates replay: R2 the old forward's record, R3 the engine's; the old forward's metrics: under
        R3 the learner's own choice against the engine's at pi_old, named indexer/engine_flip_rate,
        indexer/engine_agreement, indexer/engine_replay_applied_fraction, each also per layer)."""
        if self.mode != "R3":
            return result.record, {}
        return engine, {k.replace("indexer/", "indexer/engine_", 1): v for k, v in result.metrics.items()}

    def update(self, recorded: IndexerRecord | None) -> IndexerRequest | None:
        """R2/R3: replay `recorded` (`after_old_forward`'s record of the update's rows: R2 the old forward's, R3 the
        engine's), comparing the update's fresh choice with it (indexer/flip_rate, indexer/agreement); none:
        nothing."""
        if self.mode == "none":
            return None
        if recorded is None:
            raise IndexerReplayError(f"routing.indexer_replay={self.mode}: no recorded indices to replay")
        return IndexerRequest(replay=recorded, record=True, compare_with=recorded)

    # ---- one learner call ------------------------------------------------------------------------
    def begin(self, tokens: torch.Tensor, lengths: torch.Tensor | None, request: IndexerRequest) -> None:
        """Check `request` against the call (before any forward: shapes, and that each record belongs to the
        call's tokens) and start it."""
        rows, width = tokens.shape[0], tokens.shape[1] - 1
        lengths = (torch.full((rows,), width + 1, dtype=torch.long) if lengths is None
                   else torch.as_tensor(lengths, dtype=torch.long).reshape(-1))
        want = (rows, width, len(self.layers), self.model.topk)
        hashes = None
        for name in ("replay", "compare_with"):
            x = getattr(request, name)
            if x is None:
                continue
            if tuple(x.indices.shape) != want or x.indices.dtype.is_floating_point:
                raise IndexerReplayError(f"IndexerRequest.{name} must be integer [rows, seq-1, DSA layers, "
                                         f"index_topk] = {list(want)} (got {x.indices.dtype} "
                                         f"{list(x.indices.shape)})")
            hashes = row_hashes(tokens, lengths) if hashes is None else hashes
            wrong = (x.token_hash != hashes).nonzero().flatten().tolist()
            if wrong:
                raise IndexerReplayError(f"IndexerRequest.{name} was recorded for other tokens: rows {wrong[:8]} "
                                         f"of {rows} do not match the call's tokens (token hash)")
        self._request, self._shape, self._lengths = request, (rows, width), lengths
        self._tokens = tokens if request.record else None
        self._parts, self._pending = [], None

    def before_micro_batch(self, index: torch.Tensor, inputs: torch.Tensor) -> None:
        """Before each micro-batch forward: that micro-batch's replayed indices, and keep its fresh ones."""
        self._collect()
        targets = None
        if self._request.replay is not None:
            rows = self._held(unpack_positions(self._request.replay.indices[index, :inputs.shape[1]]), inputs.shape[1])
            targets = [rows[:, :, self._first + j].contiguous() for j in range(len(self.model.indexers))]
        self._pending = index.clone()
        self.model.set_micro_batch(targets, keep=self._request.record)

    def _held(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """Replayed [b, w, layers, k] of a micro-batch of `width` input positions -> the query rows this rank runs:
        at context parallelism the positions the learner pads after the record (w < width; each selects itself)
        and this rank's chunks of them."""
        if self.cp_group is None:
            return rows
        if rows.shape[1] < width:
            pad = torch.arange(rows.shape[1], width).view(1, -1, 1, 1).expand(rows.shape[0], -1, *rows.shape[2:])
            rows = torch.cat([rows, pad.to(rows.dtype)], dim=1)
        return split_sequence(rows, self.cp_group, 1)

    def _collect(self) -> None:
        if self._pending is not None:
            if self._request.record and any(f is None for f in self.model.fresh):
                raise IndexerReplayError("a DSA layer recorded no indices for a micro-batch")
            self._parts.append((self._pending, list(self.model.fresh), list(self.model.applied)))
        self._pending = None

    def finish(self) -> IndexerResult:
        """End the call: the fresh top-k (record); with compare_with, the flip rates and agreement; with replay,
        the applied fraction (all global over the data-parallel ranks: every rank's call must ask the same)."""
        request, lengths = self._request, self._lengths
        try:
            self._collect()
            record = self._assemble() if request.record else None
            applied = self._assemble_applied() if request.replay is not None else None
        finally:
            self.stop()
        group = self.groups.dp if self.groups is not None else None
        metrics = {}
        if request.compare_with is not None:
            metrics.update(flip_rate_metrics(request.compare_with.positions(), record.positions(), lengths,
                                             self.layers, group=group))
        if applied is not None:
            metrics.update(applied_metrics(applied, lengths, self.layers, group=group))
        return IndexerResult(record=record, metrics=metrics)

    def _assemble(self) -> IndexerRecord:
        rows, width = self._shape
        pos = torch.arange(width).view(1, -1, 1, 1)
        out = pos.expand(rows, width, len(self.model.indexers), self.model.topk).clone()
        for index, fresh, _ in self._parts:
            if fresh:
                mb = torch.stack([f.cpu() for f in fresh], dim=2)[:, :width]  # [b, w, this stage's layers, k]
                out[index, :mb.shape[1]] = mb.long()
        out = self._join_stages(out)
        return IndexerRecord(pack_positions(out, width), row_hashes(self._tokens, self._lengths))

    def _assemble_applied(self) -> torch.Tensor:
        """bool [B, S-1, layers]: queries whose attention read the replayed set (False where no attention call
        was observed)."""
        rows, width = self._shape
        out = torch.zeros(rows, width, len(self.model.indexers), dtype=torch.bool)
        for index, _, applied in self._parts:
            for j, a in enumerate(applied):
                if a is not None:
                    out[index, :min(a.shape[1], width), j] = a[:, :width]
        return self._join_stages(out)

    def stop(self) -> None:
        """The indexers select themselves again (also when a call fails half-way)."""
        self.model.set_micro_batch(None, keep=False)
        self._request, self._pending, self._parts, self._tokens = None, None, [], None

    def close(self) -> None:
        self.model.close()
