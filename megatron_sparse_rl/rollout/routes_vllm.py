"""R3 routes from vLLM's own routed-experts output (`enable_return_routed_experts`, GPU).

vLLM 0.32 records the top-k expert ids of every token it runs through the model inside its MoE layers
(`RoutedExpertsCapturer`) and returns them, for a finished request, as `CompletionOutput.routed_experts`:
a numpy array [rows, num_hidden_layers, topk], uint8 up to 256 experts else uint16, row t being the
token at position t (prompt first, `SamplingParams.routed_experts_prompt_start` = 0). It needs vLLM's
Model Runner V2 and Triton, so it exists on GPU only; on CPU `rollout/routes.py` (a callback on every MoE
router) records the same thing.

`VLLMRouteOutput` is an engine extension like `EngineRouteCapture` (rollout/extension.py; it also asks vLLM for
`enable_return_routed_experts`), so `RolloutEngine.generate` fills `RolloutBatch.features.routed_experts` with either. A sequence of n tokens (prompt +
response) must come with at least its n - 1 input positions (the last sampled token is never fed back);
fewer rows, a missing array, or an id outside [0, num_experts) raise a RoutingError naming the sequence.
The MoE layers (columns kept) and the expert count are read from the engine's model.

    engine = RolloutEngine(model_dir, cfg, extensions=[VLLMRouteOutput()])  # enable_return_routed_experts=True
    batch = engine.generate(prompts, sampling)                  # batch.features.routed_experts: moe.RouteStore
"""
from __future__ import annotations

import numpy as np
import torch

from megatron_sparse_rl import vllm_access
from megatron_sparse_rl.moe.storage import RouteStore, RoutingError
from megatron_sparse_rl.rollout.extension import EngineExtension
from megatron_sparse_rl.rollout.routes import moe_layout


class VLLMRouteOutput(EngineExtension):
    """Reads vLLM's per-request routed experts into a RouteStore (see the module docstring). The MoE layers and the
    expert count are read from the engine's model when it starts unless given."""

    provides = "routes"
    ARG = "enable_return_routed_experts"

    def __init__(self, layers: tuple[int, ...] | None = None, num_experts: int = 0):
        self.layers, self.num_experts = (), 0
        if layers is not None:
            self._set_layout(layers, num_experts)

    def _set_layout(self, layers: tuple[int, ...], num_experts: int) -> None:
        if not layers:
            raise RoutingError("vLLM route output needs at least one MoE layer")
        self.layers, self.num_experts = tuple(layers), int(num_experts)

    def engine_args(self, cfg) -> dict:
        return {self.ARG: True}

    def on_started(self, engine) -> None:
        if not engine.vllm_args.get(self.ARG):
            raise RoutingError(f"vLLM route output needs an engine started with {self.ARG}=True (hand the "
                               "VLLMRouteOutput to RolloutEngine(..., extensions=[...]) at construction)")
        vllm_access.check(features=("moe",))
        self._set_layout(*engine.apply_model(moe_layout))

    def batch_fields(self, outputs, prompts, samples) -> dict:
        return {"routed_experts": self.collect(outputs, prompts)}

    def collect(self, outputs, prompts: list[list[int]]) -> RouteStore:
        """Routes of every (prompt, response) row of vLLM's `outputs`, in RolloutBatch order."""
        routes, tokens = [], []
        for out, prompt in zip(outputs, prompts):
            for c in sorted(out.outputs, key=lambda c: c.index):
                seq = list(prompt) + list(c.token_ids)
                routes.append(self._sequence_routes(len(routes), len(seq), c.routed_experts))
                tokens.append(seq[:-1])
        return RouteStore.from_sequences(routes, tokens, num_experts=self.num_experts, layers=self.layers,
                                         source="engine")

    def _sequence_routes(self, row: int, n_tokens: int, array) -> torch.Tensor:
        """int16 [n_tokens - 1, len(layers), topk]: the MoE layers' columns of the input positions."""
        if array is None:
            raise RoutingError(f"sequence {row}: vLLM returned no routed experts (was the engine started with "
                               "enable_return_routed_experts and the request finished?)")
        array = np.asarray(array)
        if array.ndim != 3:
            raise RoutingError(f"sequence {row}: vLLM routed experts must be [tokens, layers, topk] "
                               f"(got shape {array.shape})")
        need = n_tokens - 1
        if array.shape[0] < need:
            raise RoutingError(f"sequence {row}: vLLM returned routes for {array.shape[0]} positions, the "
                               f"sequence has {need} input positions")
        if array.shape[1] <= max(self.layers):
            raise RoutingError(f"sequence {row}: vLLM routed experts cover {array.shape[1]} layers, MoE layer "
                               f"{max(self.layers)} is missing")
        picked = torch.from_numpy(array[:need, list(self.layers)].astype(np.int32))
        if picked.numel() and (int(picked.min()) < 0 or int(picked.max()) >= self.num_experts):
            raise RoutingError(f"sequence {row}: vLLM routed expert ids outside [0, {self.num_experts}) "
                               f"(min {int(picked.min())}, max {int(picked.max())})")
        return picked.to(torch.int16)
