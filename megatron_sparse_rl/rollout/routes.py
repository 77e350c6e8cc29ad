"""R3 route capture on the rollout engine: the experts vLLM actually used for every token it processed.

vLLM's own routed-experts output needs Model Runner V2 + Triton (GPU). On CPU we bind a capture callback to
every MoE router (`BaseRouter.set_capture_fn`: called by vLLM with the top-k ids right after it computes
them and right before the experts run, the same point vLLM's GPU capturer uses), plus a forward pre-hook
on the model that notes, per engine step, which request owns which rows of the flat token batch (from the
model runner's `input_batch.req_ids` and `query_start_loc`) and the token ids and positions of those rows.

After `generate`, every output row (prompt + response) gets the routes of its n - 1 input positions,
checked against the tokens the engine fed at each position; a gap or a mismatch raises naming the
sequence and position. Routes are packed into a `moe.RouteStore` (uint8 when experts <= 256).

    capture = EngineRouteCapture.attach(engine)   # engine.route_capture = capture
    batch = engine.generate(prompts, sampling)    # batch.routed_experts: RouteStore, one sequence per row
    capture.detach()
"""
from __future__ import annotations

import re
from collections import defaultdict
from functools import partial

import torch

from moe.storage import RouteStore, RoutingError

# vLLM (0.32) internal request ids: "<external>-<8 hex>", children of n > 1: "<index>_<external>-<8 hex>".
_INTERNAL_ID = re.compile(r"^(?:(\d+)_)?(.+)-[0-9a-f]{8}$")


def requests_by_sample(req_ids, error: type[Exception]) -> dict[tuple[str, int], str]:
    """{(vLLM output request id, sample index): internal request id} for the internal ids seen in a step."""
    by_key = {}
    for req in req_ids:
        m = _INTERNAL_ID.match(req)
        if m is None:
            raise error(f"cannot parse vLLM request id {req!r}")
        by_key[(m.group(2), int(m.group(1) or 0))] = req
    return by_key


def moe_runners(model) -> list:
    """The vLLM model's MoE runners, by layer id (raises if it has none)."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    moe = sorted((m for m in model.modules() if isinstance(m, MoERunner)), key=lambda m: m.layer_id)
    if not moe:
        raise RoutingError("route capture: the engine's model has no MoE layers")
    return moe


class EngineRouteCapture:
    """Route capture bound to one RolloutEngine's in-process worker (see module docstring)."""

    def __init__(self):
        self.active = False
        self.layers: tuple[int, ...] = ()
        self.num_experts = 0
        self._runner = None
        self._handles = []
        self._routers = []
        self._step = None
        # internal request id -> position -> (token id, int16 [layers, k])
        self._seen: dict[str, dict[int, tuple[int, torch.Tensor]]] = defaultdict(dict)

    @classmethod
    def attach(cls, engine) -> "EngineRouteCapture":
        capture = cls()
        engine.apply_worker(capture._install)
        engine.route_capture = capture
        capture._engine = engine
        return capture

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        for r in self._routers:
            r.set_capture_fn(None)
        self._handles, self._routers = [], []
        if getattr(self._engine, "route_capture", None) is self:
            self._engine.route_capture = None

    # ---- worker side (runs in the engine's process) -------------------------------------------------
    def _install(self, worker) -> None:
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        runner = worker.model_runner
        model = runner.get_model()
        moe = moe_runners(model)
        for m in moe:
            if m.is_monolithic or not isinstance(m.router, BaseRouter):
                raise RoutingError(f"route capture: layer {m.layer_id} uses a monolithic MoE kernel / router "
                                   f"{type(m.router).__name__} that cannot report its top-k")
        self.layers = tuple(int(m.layer_id) for m in moe)
        self.num_experts = int(moe[0].router.global_num_experts)
        self._runner = runner
        for j, m in enumerate(moe):
            m.router.set_capture_fn(partial(self._on_topk, j))
            self._routers.append(m.router)
        self._handles.append(model.register_forward_pre_hook(self._on_forward, with_kwargs=True))

    def _on_forward(self, module, args, kwargs) -> None:
        if not self.active:
            return
        self._flush()
        runner = self._runner
        num_reqs = runner.input_batch.num_reqs
        starts = runner.query_start_loc.cpu[:num_reqs + 1].tolist()
        self._step = dict(
            req_ids=list(runner.input_batch.req_ids[:num_reqs]), starts=starts,
            input_ids=kwargs["input_ids"][:starts[-1]].cpu().clone(),
            positions=kwargs["positions"][:starts[-1]].cpu().clone(),
            topk=[None] * len(self.layers))

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
    def begin(self) -> None:
        """Start capturing (RolloutEngine.generate calls this)."""
        self._seen.clear()
        self._step = None
        self.active = True

    def collect(self, outputs, prompts: list[list[int]]) -> RouteStore:
        """Stop capturing; routes of every (prompt, response) row of vLLM's `outputs`, in RolloutBatch order."""
        self._flush()
        self.active = False
        by_key = requests_by_sample(self._seen, RoutingError)
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
