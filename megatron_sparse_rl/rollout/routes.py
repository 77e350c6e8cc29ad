"""R3 route capture on the rollout engine: the experts vLLM actually used for every token it processed.

vLLM's own routed-experts output needs Model Runner V2 + Triton (GPU). On CPU we bind a capture callback to
every MoE router (`BaseRouter.set_capture_fn`: called by vLLM with the top-k ids right after it computes
them and right before the experts run, the same point vLLM's GPU capturer uses), plus a forward pre-hook
on the model that notes, per engine step, which request owns which rows of the flat token batch and the token
ids and positions of those rows (`vllm_access.StepContext`, through the shared `StepCapture` base).
The ids are LOGICAL expert ids (vLLM calls the callback before any expert-placement / EPLB remapping) and are
whatever the router selected, whatever its scoring: softmax top-k, or DeepSeek-V3 / Kimi-K2's sigmoid scores plus
`e_score_correction_bias` with group-limited top-k (vLLM's CPURouter; tests/e2e/test_rollout_mla.py checks them
against transformers' DeepseekV3TopkRouter). Only MoE layers have a router: dense layers (DeepSeek's first
`first_k_dense_replace`) are not recorded, and shared experts, which every token uses, are not part of a route.

After `generate`, every output row (prompt + response) gets the routes of its n - 1 input positions,
checked against the tokens the engine fed at each position; a gap or a mismatch raises naming the
sequence and position. Routes are packed into a `moe.RouteStore` (uint8 when experts <= 256).

    engine = RolloutEngine(model_dir, cfg, extensions=[EngineRouteCapture()])
    batch = engine.generate(prompts, sampling)    # batch.routed_experts: RouteStore, one sequence per row
"""
from __future__ import annotations

from functools import partial

import torch

from megatron_sparse_rl import vllm_access
from megatron_sparse_rl.moe.storage import RouteStore, RoutingError
from megatron_sparse_rl.rollout.step_capture import StepCapture


def moe_layers(model) -> list[vllm_access.MoELayer]:
    """The vLLM model's MoE layers, by layer id (raises if it has none)."""
    moe = vllm_access.moe_layers(model)
    if not moe:
        raise RoutingError("route capture: the engine's model has no MoE layers")
    return moe


def moe_layout(model) -> tuple[tuple[int, ...], int]:
    """(layer ids of the vLLM model's MoE layers, routed expert count)."""
    return _layout(moe_layers(model))


def _layout(moe: list[vllm_access.MoELayer]) -> tuple[tuple[int, ...], int]:
    return tuple(m.layer_id for m in moe), moe[0].num_experts


class EngineRouteCapture(StepCapture):
    """Route capture bound to one RolloutEngine's in-process worker (see module docstring)."""

    provides = "routes"
    field = "routed_experts"
    features = ("step", "moe")
    error = RoutingError

    def __init__(self):
        super().__init__()
        self.layers: tuple[int, ...] = ()
        self.num_experts = 0
        self._moe: list = []
        # self._seen: internal request id -> position -> (token id, int16 [layers, k])

    # ---- worker side (runs in the engine's process) -------------------------------------------------
    def _install_hooks(self, runner) -> None:
        moe = moe_layers(vllm_access.model(runner))
        for m in moe:
            if not m.reports_topk:
                raise RoutingError(f"route capture: layer {m.layer_id} uses a monolithic MoE kernel / router "
                                   f"{m.router_name} that cannot report its top-k")
        self.layers, self.num_experts = _layout(moe)
        for j, m in enumerate(moe):
            vllm_access.set_route_callback(m, partial(self._on_topk, j))
            self._moe.append(m)

    def _remove_hooks(self) -> None:
        for m in self._moe:
            vllm_access.set_route_callback(m, None)
        self._moe = []

    def _on_step(self, step: vllm_access.StepContext) -> None:
        self._flush()
        self._step = dict(req_ids=step.req_ids, starts=step.starts, input_ids=step.input_ids.cpu().clone(),
                          positions=step.positions.cpu().clone(), topk=[None] * len(self.layers))

    def _on_topk(self, j: int, topk_ids: torch.Tensor) -> None:
        if self.active and self._step is not None:
            n = self._step["starts"][-1]
            self._step["topk"][j] = topk_ids[:n].to(torch.int16).cpu().clone()

    def _flush(self) -> None:
        """File the finished step's routes under each request's positions."""
        step, self._step = self._step, None
        if step is None:
            return
        missing = [self.layers[j] for j, t in enumerate(step["topk"]) if t is None]
        if missing:
            raise RoutingError(f"route capture: layers {missing} reported no routes for an engine step")
        routes = torch.stack(step["topk"], dim=1)  # [tokens, layers, k]
        for r, req in enumerate(step["req_ids"]):
            seen = self._seen[req]
            for t in range(step["starts"][r], step["starts"][r + 1]):
                seen[int(step["positions"][t])] = (int(step["input_ids"][t]), routes[t])

    # ---- driver side -------------------------------------------------------------------------------
    def collect(self, outputs, prompts: list[list[int]]) -> RouteStore:
        """Stop capturing; routes of every (prompt, response) row of vLLM's `outputs`, in RolloutBatch order."""
        self._flush()
        self.active = False
        by_key = self._by_sample()
        routes, tokens = [], []
        for out, prompt in zip(outputs, prompts):
            for c in sorted(out.outputs, key=lambda c: c.index):
                row = len(routes)
                seq = list(prompt) + list(c.token_ids)
                req = by_key.get((out.request_id, c.index))
                if req is None:
                    raise RoutingError(f"sequence {row}: no routes captured (request {out.request_id}, sample {c.index})")
                routes.append(self._sequence_routes(row, seq, self._seen[req]))
                tokens.append(seq[:-1])
        self._seen.clear()
        return RouteStore.from_sequences(routes, tokens, num_experts=self.num_experts, layers=self.layers,
                                         source="engine")

    def _sequence_routes(self, row: int, seq: list[int], seen: dict) -> torch.Tensor:
        out = []
        for pos in range(len(seq) - 1):
            if pos not in seen:
                raise RoutingError(f"sequence {row}: the engine never routed position {pos}")
            tok, r = seen[pos]
            if tok != seq[pos]:
                raise RoutingError(f"sequence {row}: position {pos} was routed for token {tok}, the sequence has "
                                   f"{seq[pos]}")
            out.append(r)
        return torch.stack(out) if out else torch.zeros(0, len(self.layers), 1, dtype=torch.int16)
