"""`LearnerRouting`: a Learner's MoE routing state, between the Learner and `moe/` (R2/R3 routing replay,
route recording, statistics).

The Learner builds it when constructed with `routing=RoutingConfig(...)` (its model then carries Megatron's
RouterReplay) and owns it; a call asks for replay or recording through `ForwardExtras.routes`
(learner/extras.py `RouteRequest`), and the learner starts the request before its forward, feeds every
micro-batch's routes to the routers, and ends it after, returning a `RoutingResult`. Routes are kept per
SEQUENCE in layout-independent form (`moe.RouteStore`: all MoE layers, full sequence); this module translates
them to what each rank's routers see: the micro-batch's rows, the rank's context-parallel positions (its two
of the 2 x cp chunks) and within them its sequence-parallel chunk (TP + SP), the rank's pipeline stage's layers, flattened [positions, rows] as Megatron does. Recording does
the reverse (all-gather over TP under SP, over CP into sequence order, over PP for the layers).

What the RL step's forwards ask for follows `routing.mode` (`old_forward`, `after_old_forward`, `update`):

    routing, routes = learner.routing, batch.features.routed_experts  # None without routing replay / route capture
    request = routing.old_forward(routes)                        # R2: record; R3: replay the engine's routes
    out = learner.forward_logprobs(tokens, lengths=lengths, extras=ForwardExtras(routes=request))
    old = routing.after_old_forward(out.get("routing"), routes)  # old.routes: what updates replay
    metrics = learner.train_step(tokens, loss_fn, lengths=lengths,       # a mini-batch: .select(rows) of both
                                 extras=ForwardExtras(routes=routing.update(old.routes, old.learner_routes)))
    # metrics["routing/replay_applied_fraction"] == 1, "routing/drift_mean" (pi_old -> pi_theta); old.metrics:
    # flip rates, flipped tokens, entropy...
    other = routing.counterfactual(routes)                       # routing.attribute_mismatch: the other routes

A sequence of n tokens has routes for its n - 1 input positions.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_sparse_rl.config.routing import RoutingConfig
from megatron_sparse_rl.learner.extras import RouteRequest
from megatron_sparse_rl.moe.indexer_storage import IndexerRecord
from megatron_sparse_rl.moe.replay import ModelRouting
from megatron_sparse_rl.moe.stats import drift_metrics, routing_metrics
from megatron_sparse_rl.moe.storage import RouteStore, RoutingError, token_hash
from megatron_sparse_rl.parallel.context import cp_positions, gather_sequence


@dataclass(frozen=True)
class RoutingResult:
    """What one call's routing produced: `routes` (the replayed ones, or the recorded ones), the learner's own
    `learner_routes` (when recorded) and `metrics` (routing/replay_applied_fraction, statistics)."""

    routes: RouteStore | None = None
    learner_routes: RouteStore | None = None
    metrics: dict = field(default_factory=dict)
    indexer: IndexerRecord | None = None
    """DSA models under routing.indexer_replay = R2: the old forward's recorded indexer top-k per row
    (learner/indexer_replay.py `IndexerResult.record`), which every update replays; else None."""


class LearnerRouting:
    def __init__(self, model: torch.nn.Module, layout, groups, cfg: RoutingConfig):
        self.cfg, self.layout, self.groups = cfg, layout, groups
        self.model = ModelRouting(model, aux_loss=cfg.aux_loss)
        self.all_layers = self._all_layers()
        # the request in progress (set by begin, cleared by stop: one learner call)
        self._request: RouteRequest | None = None
        self._tokens: torch.Tensor | None = None
        self._lengths: torch.Tensor | None = None
        self._rows: torch.Tensor | None = None  # replay: per-row full routes [B, L, layers, k]
        self._mb_rows: list[torch.Tensor] = []
        self._mb_widths: list[int] = []  # what each micro-batch of the last call ran

    def _all_layers(self) -> tuple[int, ...]:
        local = list(self.model.layers)
        if self.layout.pp == 1:
            return tuple(local)
        parts = [None] * self.layout.pp
        dist.all_gather_object(parts, local, group=self.groups.pp)
        return tuple(sorted(x for p in parts for x in p))

    # ---- what the RL step's forwards ask for (routing.mode) ---------------------------------------
    def old_forward(self, rollout_routes: RouteStore | None) -> RouteRequest | None:
        """The old-logprob forward's request. R3: replay `rollout_routes` (the engine's, required), recording
        the learner's own beside them for statistics (routing.record_stats); R2: record the learner's routes
        (the updates replay them); off: record them for statistics only (routing.record_stats), else None."""
        mode = self.cfg.mode
        if mode == "R3":
            if rollout_routes is None:
                raise RoutingError("routing.mode=R3 but the rollout batch has no routes (routed_experts missing)")
            return RouteRequest(replay=rollout_routes, record=self.cfg.record_stats)
        if mode == "off" and not self.cfg.record_stats:
            return None
        return RouteRequest(record=True)

    def after_old_forward(self, result: RoutingResult | None, rollout_routes: RouteStore | None) -> RoutingResult:
        """The old forward's outcome for the step: `routes` the updates replay (None when mode is off) and the
        metrics (routing.record_stats): the learner's expert load and, when the engine's routes exist, the flip
        rates of the learner's routes against them, summed over the data-parallel ranks (every rank calls this).
        Under R3 the learner's routes are its routers' own top-k on the inputs the replayed forward gave them.
        `learner_routes` (pi_old's own routes) is what the updates' drift compares with (`update`)."""
        if result is None:
            return RoutingResult()
        metrics = dict(result.metrics)
        if self.cfg.record_stats and result.learner_routes is not None:
            metrics.update(routing_metrics(result.learner_routes, rollout_routes, group=self.groups.dp))
        routes = result.routes if self.cfg.mode != "off" else None
        return RoutingResult(routes=routes, learner_routes=result.learner_routes, metrics=metrics)

    @property
    def old_forward_replays_engine(self) -> bool:
        """Whether the old-logprob forward runs the engine's routes (R3) rather than the learner's own."""
        return self.cfg.mode == "R3"

    def counterfactual(self, rollout_routes: RouteStore | None) -> RouteRequest | None:
        """The request of routing.attribute_mismatch's extra forward over the old forward's tokens, routed the
        other way: off/R2 (the old forward routed itself) replay the engine's routes; R3 (it replayed them):
        None, the learner routes itself."""
        if self.old_forward_replays_engine:
            return None
        if rollout_routes is None:
            raise RoutingError("routing.attribute_mismatch replays the engine's routes, but the rollout batch has "
                               "none (routed_experts missing: is routing.capture_rollout_routes on?)")
        return RouteRequest(replay=rollout_routes)

    def without_old_forward(self, rollout_routes: RouteStore | None) -> RoutingResult:
        """The step's outcome when pi_old comes from the engine (no learner old forward): R3 replays the engine's
        routes in the updates; R2 cannot (its routes are recorded in that forward); off: nothing."""
        if self.cfg.mode == "R2":
            raise RoutingError("routing.mode=R2 records its routes in the learner's old-policy forward, which "
                               "algorithm.old_logprobs = engine/engine_mean skips; use R3")
        if self.cfg.mode == "R3" and rollout_routes is None:
            raise RoutingError("routing.mode=R3 but the rollout batch has no routes (routed_experts missing)")
        return RoutingResult(routes=rollout_routes if self.cfg.mode == "R3" else None)

    def update(self, routes: RouteStore | None, old_own: RouteStore | None = None) -> RouteRequest | None:
        """An update's request for its rows: replay `routes` (R2/R3; required; mode off: nothing). With
        routing.record_stats and `old_own` (the old forward's own routes of the same rows, `after_old_forward`'s
        learner_routes) it also records the update's own routes and compares them with `old_own`: the expert drift
        pi_old -> pi_theta (routing/drift/...). Own routes: under replay the routers' top-k beside the replayed map
        (on the replayed forward's inputs, as R3's old forward observes them); off: the routes the update ran."""
        drift = old_own if self.cfg.record_stats else None
        if self.cfg.mode == "off":
            return RouteRequest(record=True, compare_with=drift) if drift is not None else None
        if routes is None:
            raise RoutingError(f"routing.mode={self.cfg.mode}: no routes to replay in the update")
        return RouteRequest(replay=routes, record=drift is not None, compare_with=drift)

    # ---- one learner call (driven by the Learner) ---------------------------------------------------
    def begin(self, tokens: torch.Tensor, lengths: torch.Tensor | None, request: RouteRequest) -> None:
        """Start `request` for a call over `tokens` ([B, S] this rank's rows; `lengths` the call's, used when
        the request has none). Raises RoutingError before any forward when replay routes are missing,
        misshapen or for other tokens."""
        lengths = self._check_lengths(tokens, request.lengths if request.lengths is not None else lengths)
        if request.replay is not None:
            self._rows = self._check_and_expand(request.replay, tokens, lengths)
            self.model.observing = request.record
        self._request, self._tokens, self._lengths = request, tokens, lengths
        self._mb_rows, self._mb_widths = [], []
        self.model.start("replay" if request.replay is not None else "record")

    def before_micro_batch(self, index: torch.Tensor, inputs: torch.Tensor, micro_batch: int | None = None) -> None:
        """Called by the learner before each micro-batch forward of a routed call; `micro_batch`: its number in the
        call (an interleaved pipeline forwards micro-batch m once per model chunk: the first time starts it)."""
        width = inputs.shape[1]  # a micro-batch may run fewer positions than the batch (learner trims it)
        if micro_batch is None or micro_batch == len(self._mb_rows):
            self._mb_rows.append(index.clone())
            self._mb_widths.append(width)
        targets = None
        if self.model.phase == "replay":
            full = self._rows[index][:, :width]  # [b, L, all layers, k]
            if full.shape[1] < width:  # sequence-parallel padding positions: any valid experts
                pad = self._pad_routes(full.shape[0], width - full.shape[1])
                full = torch.cat([full, pad], dim=1)
            cols = [self.all_layers.index(layer) for layer in self.model.layers]
            local = full[:, :, cols][:, self._positions(width)]  # [b, L_local, local layers, k]
            local = local.permute(1, 0, 2, 3).reshape(-1, len(cols), self.model.topk)
            targets = [local[:, j].contiguous().to(inputs.device) for j in range(len(cols))]
        self.model.set_micro_batch(targets, micro_batch)

    def finish(self) -> RoutingResult:
        """End the call's request after its forward (and backward): the recorded routes (the learner's own,
        also under replay with `record`), the replay verification (RoutingError when any router token did not
        run the replayed experts) and, with the request's `compare_with`, the drift of the call's own routes from
        those (routing/drift/..., counts summed over the data-parallel ranks). The step's other statistics are
        `after_old_forward`'s."""
        request, tokens, lengths = self._request, self._tokens, self._lengths
        replay = request.replay is not None
        try:
            own = None
            if not replay or request.record:
                own = self._assemble(self.model.observed if replay else self.model.recorded)
            applied = self.model.applied_fraction
        finally:
            self.stop()
        metrics = {}
        if replay:
            if applied != 1.0:
                raise RoutingError(f"routing replay applied to only {applied:.4f} of router tokens (must be 1)")
            metrics["routing/replay_applied_fraction"] = applied
        learner_routes = self._store(own, tokens, lengths, "learner") if own is not None else None
        if request.compare_with is not None:
            metrics.update(drift_metrics(request.compare_with, learner_routes, group=self.groups.dp))
        return RoutingResult(routes=request.replay if replay else learner_routes, learner_routes=learner_routes,
                             metrics=metrics)

    def stop(self) -> None:
        """The routers route themselves again (also when a call fails half-way); a no-op between calls."""
        if self._request is None:
            return
        self.model.observing = False
        self.model.stop()
        self._request = self._tokens = self._lengths = self._rows = None

    # ---- checks and layout -------------------------------------------------------------------------
    def _positions(self, width: int) -> torch.Tensor:
        """The positions of a `width`-wide micro-batch this rank's routers see: its context-parallel chunks, and of
        those its sequence-parallel share."""
        held = cp_positions(width, self.layout.cp, self.groups.cp_rank) if self.layout.cp > 1 else torch.arange(width)
        if not self.layout.sequence_parallel or self.layout.tp == 1:
            return held
        chunk = len(held) // self.layout.tp
        return held[self.groups.tp_rank * chunk:(self.groups.tp_rank + 1) * chunk]

    def _pad_routes(self, rows: int, width: int) -> torch.Tensor:
        k = self.model.topk
        return torch.arange(k).expand(rows, width, len(self.all_layers), k).clone()

    @staticmethod
    def _check_lengths(tokens: torch.Tensor, lengths) -> torch.Tensor:
        if lengths is None:
            return torch.full((tokens.shape[0],), tokens.shape[1], dtype=torch.long)
        lengths = torch.as_tensor(lengths, dtype=torch.long).reshape(-1)
        if lengths.numel() != tokens.shape[0] or bool((lengths < 2).any()) or bool((lengths > tokens.shape[1]).any()):
            raise RoutingError(f"lengths must hold one value in [2, {tokens.shape[1]}] per row "
                               f"(got {lengths.tolist()[:8]} for {tokens.shape[0]} rows)")
        return lengths

    def _check_and_expand(self, routes: RouteStore, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        if len(routes) != tokens.shape[0]:
            raise RoutingError(f"routing replay: {len(routes)} route sequences for a batch of {tokens.shape[0]} rows")
        for layer in self.all_layers:
            if layer not in routes.layers:
                raise RoutingError(f"layer {layer}: no routes (the routes hold layers {list(routes.layers)})")
        if routes.topk != self.model.topk or routes.num_experts != self.model.num_experts:
            raise RoutingError(f"layer {routes.layers[0]}: routes have top-k {routes.topk} of {routes.num_experts} "
                               f"experts, the model routes top-{self.model.topk} of {self.model.num_experts}")
        width = tokens.shape[1] - 1
        cols = [routes.layers.index(layer) for layer in self.all_layers]
        out = self._pad_routes(tokens.shape[0], width)
        for i in range(tokens.shape[0]):
            need, seq = int(lengths[i]) - 1, routes.sequence(i)
            if seq.shape[0] != need:
                raise RoutingError(f"sequence {i}: routes for {seq.shape[0]} tokens, the sequence has {need} input "
                                   f"positions (length {int(lengths[i])})")
            if token_hash(tokens[i, :need]) != int(routes.token_hash[i]):
                raise RoutingError(f"sequence {i}: the routes belong to different tokens (token hash mismatch)")
            out[i, :need] = seq[:, cols].long()
        return out

    def _assemble(self, per_mb: list[list[torch.Tensor]]) -> torch.Tensor:
        """Per-micro-batch, per-local-layer router indices -> per-row full routes [B, L, all layers, k]."""
        k, tp = self.model.topk, self.layout.tp
        rows_total = sum(len(r) for r in self._mb_rows)
        out = torch.zeros(rows_total, max(self._mb_widths), len(self.all_layers), k, dtype=torch.long)
        for rows, width, layers in zip(self._mb_rows, self._mb_widths, per_mb):
            for j, t in enumerate(layers):
                if t is None:
                    raise RoutingError(f"layer {self.model.layers[j]}: no routes were recorded for a micro-batch")
            local = torch.stack(layers, dim=1).view(-1, len(rows), len(layers), k)  # [L_local, b, layers, k]
            if self.layout.sequence_parallel and tp > 1:
                parts = [torch.empty_like(local) for _ in range(tp)]
                dist.all_gather(parts, local.contiguous(), group=self.groups.tp)
                local = torch.cat(parts, dim=0)
            if self.layout.cp > 1:  # this rank's chunks -> every position in sequence order
                local = gather_sequence(local, self.groups.cp, 0)
            if self.layout.pp > 1:
                parts = [None] * self.layout.pp
                dist.all_gather_object(parts, (list(self.model.layers), local), group=self.groups.pp)
                by_layer = {lay: p[1][:, :, i] for p in parts for i, lay in enumerate(p[0])}
                local = torch.stack([by_layer[lay] for lay in self.all_layers], dim=2)
            out[rows, :width] = local.permute(1, 0, 2, 3)
        return out

    def _store(self, per_row: torch.Tensor, tokens, lengths, source: str) -> RouteStore:
        seqs = [per_row[i, :int(n) - 1] for i, n in enumerate(lengths)]
        toks = [tokens[i, :int(n) - 1] for i, n in enumerate(lengths)]
        return RouteStore.from_sequences(seqs, toks, num_experts=self.model.num_experts, layers=self.all_layers,
                                         source=source)

    def close(self) -> None:
        """Remove the router hooks (the model keeps working with its own routing)."""
        self.model.close()
