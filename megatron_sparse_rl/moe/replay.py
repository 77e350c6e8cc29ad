"""`ModelRouting`: record / replay MoE routes through Megatron-Core's own `RouterReplay`, owned by one model.

Megatron-Core 0.16.1 (`TransformerConfig.moe_enable_routing_replay=True`) gives every `TopKRouter` a
`RouterReplay` and appends it to the class-level list `RouterReplay.global_router_replay_instances`, which
is never cleared: after a model rebuild in the same process the list holds stale routers, and the static
helpers (`set_replay_data`) either fail or feed the dead model (verl PR #7340: replay silently a no-op).
Here the routers are found in the model object itself, the class list is cleared and re-bound to exactly
this model's instances (in layer order), and actions are set per instance, never through the list.

On replay Megatron gathers the probabilities of the replayed experts from the CURRENT router scores
(`scores.gather(1, indices)`), so the router keeps its gradient. Activation recompute re-runs the router
inside the backward pass: the pre-hook detects that and switches the instance to REPLAY_BACKWARD, which
pops the targets in forward order (FIFO), so recompute reproduces the forward's routes.

Every replayed router call is verified after the fact: the routing map Megatron produced must select
exactly the target experts (`applied_tokens / expected_tokens` is the `replay_applied_fraction`).

    routing = ModelRouting(model, aux_loss="replayed")
    routing.start("replay")                      # or "record" / "observe"
    routing.set_micro_batch([t0, t1, ...])       # per local MoE layer: long [router tokens, topk]
    ... model forward / backward ...
    routing.stop()
"""
from __future__ import annotations

from typing import Literal

import torch

from megatron_sparse_rl.moe.storage import RoutingError

Phase = Literal["off", "record", "replay", "observe"]


def _in_backward() -> bool:
    """True while autograd's engine runs a backward pass (activation recompute happens there)."""
    return torch._C._current_graph_task_id() != -1


def find_routers(model: torch.nn.Module) -> list:
    """This model's Megatron TopKRouters, ordered by layer number."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    return sorted(routers, key=lambda r: r.layer_number)


class ModelRouting:
    """Route recording/replay for one Megatron model (see module docstring).

    Args:
        model: the GPTModel (or a wrapper such as DDP) built with `moe_enable_routing_replay=True`.
        aux_loss: load-balancing loss while replaying: "off" (disabled) or "replayed" (computed on the
            replayed routing map, with gradients through the current scores).
    """

    def __init__(self, model: torch.nn.Module, *, aux_loss: Literal["off", "replayed"] = "off"):
        from megatron.core.transformer.moe.router_replay import RouterReplay

        if aux_loss not in ("off", "replayed"):
            raise ValueError(f"aux_loss must be 'off' or 'replayed' (got {aux_loss!r})")
        routers = find_routers(model)
        if not routers:
            raise RoutingError("routing replay: the model has no MoE routers")
        cfg = routers[0].config
        if not cfg.moe_enable_routing_replay or any(r.router_replay is None for r in routers):
            raise RoutingError("routing replay: the model was built without "
                               "TransformerConfig.moe_enable_routing_replay=True (its routers have no RouterReplay)")
        if cfg.moe_router_fusion:
            raise RoutingError("routing replay: moe_router_fusion=True bypasses RouterReplay; disable it")
        if routers[0].routing_type == "sinkhorn":
            raise RoutingError("routing replay: sinkhorn load balancing bypasses RouterReplay")
        if cfg.moe_expert_capacity_factor is not None:
            raise RoutingError("routing replay: token dropping (moe_expert_capacity_factor) would drop replayed "
                               "routes; unset it")
        self.routers = routers
        self.layers = tuple(int(r.layer_number) - 1 for r in routers)  # 0-based model layer index
        self.topk = int(cfg.moe_router_topk)
        self.num_experts = int(cfg.num_moe_experts)
        self.aux_loss = aux_loss
        # Megatron's class-level list: drop every stale instance, keep exactly this model's routers.
        RouterReplay.clear_global_router_replay_instances()
        RouterReplay.global_router_replay_instances.extend(r.router_replay for r in routers)
        self.phase: Phase = "off"
        self._targets: list[torch.Tensor] | None = None
        self._current: dict[int, torch.Tensor] = {}
        self._micro_batch = -1
        self.recorded: list[list[torch.Tensor]] = []
        self.observed: list[list[torch.Tensor]] = []
        self.applied_tokens = 0
        self.expected_tokens = 0
        self._handles = []
        for j, r in enumerate(routers):
            self._handles.append(r.register_forward_pre_hook(self._make_pre_hook(j)))
            self._handles.append(r.register_forward_hook(self._make_post_hook(j)))

    # ---- phase control ------------------------------------------------------------------------------
    def start(self, phase: Phase) -> None:
        """Begin a phase; clears the per-phase buffers and counters."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if phase not in ("off", "record", "replay", "observe"):
            raise ValueError(f"phase must be off, record, replay or observe (got {phase!r})")
        self.phase = phase
        self.recorded, self.observed = [], []
        self.applied_tokens = self.expected_tokens = 0
        self._micro_batch = -1
        self._targets = None
        for r in self.routers:
            r.router_replay.clear_indices()
            r.router_replay.set_router_replay_action(RouterReplayAction.RECORD) if phase == "record" \
                else r.router_replay.clear_router_replay_action()
            self._set_aux_override(r, phase == "replay")

    def stop(self) -> None:
        """End the phase: routers compute their own top-k again; replay lists are emptied."""
        for r in self.routers:
            r.router_replay.clear_indices()
            r.router_replay.clear_router_replay_action()
            self._set_aux_override(r, False)
        self.phase = "off"
        self._targets = None

    def set_micro_batch(self, targets: list[torch.Tensor] | None, micro_batch: int | None = None) -> None:
        """Called before each micro-batch forward. In replay: `targets[j]` (long [router tokens, topk]) for
        local MoE layer j; in record/observe: None. `micro_batch`: the micro-batch's number in the call (None: the
        next one). An interleaved pipeline runs each micro-batch once per model chunk, not in one go: every chunk's
        forward names its micro-batch, so each layer records into that micro-batch's row."""
        if self.phase == "replay":
            if targets is None or len(targets) != len(self.routers):
                got = "none" if targets is None else len(targets)
                raise RoutingError(f"routing replay: {got} route tensors for the {len(self.routers)} MoE layers "
                                   f"{list(self.layers)} of this rank")
        self._targets = targets
        self._micro_batch = self._micro_batch + 1 if micro_batch is None else micro_batch
        while len(self.recorded) <= self._micro_batch:
            self.recorded.append([None] * len(self.routers))
            self.observed.append([None] * len(self.routers))

    def close(self) -> None:
        """Remove the hooks (the model keeps working with its own routing)."""
        self.stop()
        for h in self._handles:
            h.remove()
        self._handles = []

    @property
    def applied_fraction(self) -> float:
        """Fraction of router tokens whose routing map equals the replayed target (1.0 when nothing ran)."""
        return self.applied_tokens / self.expected_tokens if self.expected_tokens else 1.0

    # ---- hooks -------------------------------------------------------------------------------------
    def _make_pre_hook(self, j: int):
        def pre_hook(router, args):
            from megatron.core.transformer.moe.router_replay import RouterReplayAction

            if self.phase == "observe" or (self.phase == "replay" and not _in_backward()):
                if self._micro_batch < 0:
                    raise RoutingError(f"layer {self.layers[j]}: router ran before set_micro_batch "
                                       "(call set_micro_batch before every micro-batch forward)")
            if self.phase == "replay":
                rr = router.router_replay
                tokens = args[0].shape[0] * args[0].shape[1]
                if _in_backward():  # activation recompute: Megatron pops the forward's targets in order
                    if not rr.replay_backward_list:
                        raise RoutingError(f"layer {self.layers[j]}: activation recompute found no replayed routes")
                    target = rr.replay_backward_list[0]
                    rr.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
                else:
                    target = self._targets[j]
                    if target is None or target.dim() != 2 or target.shape != (tokens, self.topk):
                        shape = None if target is None else tuple(target.shape)
                        raise RoutingError(f"layer {self.layers[j]}: replay routes of shape {shape} for micro-batch "
                                           f"{self._micro_batch}, the router sees [{tokens}, {self.topk}]")
                    rr.set_target_indices(target)
                    rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
                self._current[j] = target
            if self.phase in ("observe", "replay") and not _in_backward() and self.observing:
                self.observed[self._micro_batch][j] = self._natural_topk(router, args[0])
        return pre_hook

    observing = False  # replay also computes the router's own top-k for statistics when True

    def _make_post_hook(self, j: int):
        def post_hook(router, args, output):
            _, routing_map = output
            if self.phase == "record" and not _in_backward():
                self.recorded[self._micro_batch][j] = router.router_replay.get_recorded_indices().detach().cpu()
            elif self.phase == "replay":
                target = self._current[j].to(routing_map.device).long()
                hit = routing_map.gather(1, target).all(dim=1) & (routing_map.sum(dim=1) == self.topk)
                self.applied_tokens += int(hit.sum())
                self.expected_tokens += int(routing_map.shape[0])
        return post_hook

    @torch.no_grad()
    def _natural_topk(self, router, hidden: torch.Tensor) -> torch.Tensor:
        """The experts this router would choose itself (Megatron's own top-k function, no replay)."""
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

        c = router.config
        logits = router.gating(hidden).view(-1, c.num_moe_experts)
        _, routing_map = topk_routing_with_score_function(
            logits, self.topk, use_pre_softmax=c.moe_router_pre_softmax, num_groups=c.moe_router_num_groups,
            group_topk=c.moe_router_group_topk, scaling_factor=c.moe_router_topk_scaling_factor,
            score_function=router.score_function, expert_bias=router.expert_bias, fused=False)
        return routing_map.nonzero()[:, 1].view(-1, self.topk).cpu()

    # ---- aux loss under replay ---------------------------------------------------------------------
    def _set_aux_override(self, router, on: bool) -> None:
        """Instance-level overrides (this model only) of the aux-loss path while replaying."""
        names = ("is_aux_loss_enabled", "_apply_aux_loss", "_apply_seq_aux_loss", "_apply_global_aux_loss")
        for name in names:
            router.__dict__.pop(name, None)
        if not on:
            return
        if self.aux_loss == "off":
            router.__dict__["is_aux_loss_enabled"] = lambda: False
            return
        j = self.routers.index(router)
        for name in names[1:]:
            original = getattr(router, name)

            def on_replayed_map(probs, scores, routing_map, *rest, _orig=original, **kw):
                # Megatron computes the aux loss on its own fresh top-k; use the map the experts really ran
                target = self._current[j].to(routing_map.device).long()
                replayed = torch.zeros_like(routing_map).scatter(1, target, True)
                return _orig(probs, scores, replayed, *rest, **kw)
            router.__dict__[name] = on_replayed_map
