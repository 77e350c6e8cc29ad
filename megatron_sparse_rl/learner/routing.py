"""`LearnerRouting`: glue between a `Learner` and `moe/` (R2/R3 routing replay, route recording, statistics).

The learner must be built with `routing_replay=True` (TransformerConfig.moe_enable_routing_replay). Routes
are kept per SEQUENCE in layout-independent form (`moe.RouteStore`: all MoE layers, full sequence); this
module translates them to what each rank's routers see: the micro-batch's rows, the rank's sequence-parallel
chunk of positions (TP + SP), the rank's pipeline stage's layers, flattened [positions, rows] as Megatron does.
Recording does the reverse (all-gather over TP under SP, over PP for the layers).

    routing = LearnerRouting(learner, cfg.routing)            # attaches itself as learner.routing
    with routing.old_forward(tokens, lengths, rollout_routes) as ph:   # R2: record; R3: replay engine routes
        old = learner.forward_logprobs(tokens)
    routes = ph.routes                                        # what the updates replay
    with routing.update(tokens, lengths, routes) as ph:       # R2/R3: replay (forward + recompute backward)
        learner.train_step(tokens, loss_fn)
    metrics = {**old_ph.metrics, **ph.metrics}                # routing/replay_applied_fraction == 1, agreement...

`tokens` are this rank's rows [B, S] (right-padded), `lengths` int [B] their real token counts (None: no
padding). A sequence of n tokens has routes for its n - 1 input positions.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_sparse_rl.config.routing import RoutingConfig
from moe.replay import ModelRouting
from moe.stats import routing_metrics
from moe.storage import RouteStore, RoutingError, token_hash


@dataclass
class RoutingPhase:
    """What one phase produced: `routes` (recorded, or the replayed ones) and its `metrics`."""

    routes: RouteStore | None = None
    learner_routes: RouteStore | None = None
    metrics: dict = field(default_factory=dict)


class LearnerRouting:
    def __init__(self, learner, cfg: RoutingConfig):
        self.learner, self.cfg = learner, cfg
        self.layout, self.groups = learner.layout, learner.groups
        self.model = ModelRouting(learner.model, aux_loss=cfg.aux_loss)
        self.all_layers = self._all_layers()
        self._rows: torch.Tensor | None = None  # this phase's per-row full routes [B, L, layers, k]
        self._mb_rows: list[torch.Tensor] = []
        self._mb_widths: list[int] = []
        self._width = 0
        learner.routing = self

    def _all_layers(self) -> tuple[int, ...]:
        local = list(self.model.layers)
        if self.layout.pp == 1:
            return tuple(local)
        parts = [None] * self.layout.pp
        dist.all_gather_object(parts, local, group=self.groups.pp)
        return tuple(sorted(x for p in parts for x in p))

    # ---- the learner hook --------------------------------------------------------------------------
    def before_micro_batch(self, index: torch.Tensor, inputs: torch.Tensor) -> None:
        self._mb_rows.append(index.clone())
        self._width = inputs.shape[1]  # a micro-batch may run fewer positions than the batch (learner trims it)
        self._mb_widths.append(self._width)
        targets = None
        if self.model.phase == "replay":
            full = self._rows[index][:, :self._width]  # [b, L, all layers, k]
            if full.shape[1] < self._width:  # sequence-parallel padding positions: any valid experts
                pad = self._pad_routes(full.shape[0], self._width - full.shape[1])
                full = torch.cat([full, pad], dim=1)
            cols = [self.all_layers.index(layer) for layer in self.model.layers]
            local = full[:, :, cols][:, self._positions(self._width)]  # [b, L_local, local layers, k]
            local = local.permute(1, 0, 2, 3).reshape(-1, len(cols), self.model.topk)
            targets = [local[:, j].contiguous().to(inputs.device) for j in range(len(cols))]
        self.model.set_micro_batch(targets)

    def _positions(self, width: int) -> slice:
        if not self.layout.sequence_parallel or self.layout.tp == 1:
            return slice(0, width)
        chunk = width // self.layout.tp
        return slice(self.groups.tp_rank * chunk, (self.groups.tp_rank + 1) * chunk)

    def _pad_routes(self, rows: int, width: int) -> torch.Tensor:
        k = self.model.topk
        return torch.arange(k).expand(rows, width, len(self.all_layers), k).clone()

    # ---- phases ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def old_forward(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None,
                    rollout_routes: RouteStore | None = None):
        """Around the old-logprob forward. off: natural routes recorded only for statistics (if
        cfg.record_stats); R2: record the learner's routes; R3: replay `rollout_routes` (required)."""
        mode = self.cfg.mode
        if mode == "R3":
            if rollout_routes is None:
                raise RoutingError("routing.mode=R3 but the rollout batch has no routes (routed_experts missing)")
            with self.replaying(rollout_routes, tokens, lengths, observe=self.cfg.record_stats) as ph:
                yield ph
            return
        if mode == "off" and not self.cfg.record_stats:
            yield RoutingPhase()
            return
        with self.recording(tokens, lengths) as ph:
            yield ph
        if rollout_routes is not None and self.cfg.record_stats:
            ph.metrics.update(routing_metrics(ph.learner_routes, rollout_routes))
        if mode == "off":
            ph.routes = None

    @contextlib.contextmanager
    def update(self, tokens: torch.Tensor, lengths: torch.Tensor | None, routes: RouteStore | None):
        """Around an update's train_step: replay `routes` (R2/R3); a no-op when mode is off."""
        if self.cfg.mode == "off":
            yield RoutingPhase()
            return
        if routes is None:
            raise RoutingError(f"routing.mode={self.cfg.mode}: no routes to replay in the update")
        with self.replaying(routes, tokens, lengths, observe=False) as ph:
            yield ph

    @contextlib.contextmanager
    def recording(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None):
        """Record the learner's own routes of `tokens` (ph.routes / ph.learner_routes after the block)."""
        lengths = self._lengths(tokens, lengths)
        ph = RoutingPhase()
        self._begin("record")
        try:
            yield ph
            per_row = self._assemble(self.model.recorded)
        finally:
            self._end()
        ph.routes = ph.learner_routes = self._store(per_row, tokens, lengths, "learner")
        if self.cfg.record_stats:
            ph.metrics.update(routing_metrics(ph.routes, prefix="routing/learner"))

    @contextlib.contextmanager
    def replaying(self, routes: RouteStore, tokens: torch.Tensor, lengths: torch.Tensor | None = None, *,
                  observe: bool = False):
        """Replay `routes` (one sequence per row of `tokens`) in every forward (and recompute) of the block.
        Raises RoutingError before any work when routes are missing, misshapen or for other tokens, and
        after the block when any router token was not routed as replayed."""
        lengths = self._lengths(tokens, lengths)
        self._rows = self._check_and_expand(routes, tokens, lengths)
        ph = RoutingPhase(routes=routes)
        self.model.observing = observe
        self._begin("replay")
        try:
            yield ph
            observed = self._assemble(self.model.observed) if observe else None
            applied = self.model.applied_fraction
        finally:
            self.model.observing = False
            self._end()
        ph.metrics["routing/replay_applied_fraction"] = applied
        if applied != 1.0:
            raise RoutingError(f"routing replay applied to only {applied:.4f} of router tokens (must be 1)")
        if observed is not None:
            ph.learner_routes = self._store(observed, tokens, lengths, "learner")
            ph.metrics.update(routing_metrics(ph.learner_routes, routes))

    def _begin(self, phase: str) -> None:
        self._mb_rows, self._mb_widths = [], []
        self.model.start(phase)

    def _end(self) -> None:
        self.model.stop()
        self._rows = None

    # ---- checks and layout -------------------------------------------------------------------------
    def _lengths(self, tokens: torch.Tensor, lengths) -> torch.Tensor:
        if lengths is None:
            return torch.full((tokens.shape[0],), tokens.shape[1], dtype=torch.long)
        lengths = torch.as_tensor(lengths, dtype=torch.long).reshape(-1)
        if lengths.numel() != tokens.shape[0] or bool((lengths < 2).any()) or bool((lengths > tokens.shape[1]).any()):
            raise RoutingError(f"lengths must hold one value in [2, {tokens.shape[1]}] per row "
                               f"(got {lengths.tolist()[:8]} for {tokens.shape[0]} rows)")
        return lengths

    def _check_and_expand(self, routes: RouteStore, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        if routes is None:
            raise RoutingError("routing replay: no routes given")
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
        self.model.close()
        if getattr(self.learner, "routing", None) is self:
            self.learner.routing = None
