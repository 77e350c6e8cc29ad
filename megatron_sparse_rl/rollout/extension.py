"""`EngineExtension`: a feature that rides on a `RolloutEngine` without the engine knowing it.

Sparse KV (kv/engine_extension.py `SparseKV`), R3 route capture (rollout/routes.py `EngineRouteCapture`,
rollout/routes_vllm.py `VLLMRouteOutput`) and the keep-sampling-mask record (rollout/sampling_mask.py
`SamplingMaskCapture`) are extensions built where the run is set up and handed to the engine at construction:

    engine = RolloutEngine(model_dir, cfg, extensions=[SparseKV(), EngineRouteCapture()])

The engine calls the hooks below in this order: `vllm_features` and `engine_args` before vLLM starts,
`on_started` once it runs, and per `generate` `begin` then `batch_fields` (per turn of a multi-turn episode,
`RolloutEngine.sample_turns`, `begin` then `turn_fields`: only an extension that `follows_turns`); `after_rescore`
after re-scoring requests ran, `on_prefix_reset` when the engine empties vLLM's prefix cache, and `detach` when the
feature is taken off again. Every hook does nothing unless overridden.
"""
from __future__ import annotations

from typing import Any


class EngineExtension:
    """The hooks a RolloutEngine calls on each of its extensions (see the module docstring)."""

    provides = ""
    """What of the rollout config this extension serves ("sparse_kv": rollout.kv.policy, "sampling_mask":
    rollout.record_sampling_mask, "routes"); the engine refuses a config that asks for one nobody provides."""

    def vllm_features(self, mla: bool) -> tuple[str, ...]:
        """vLLM internals (vllm_access.FEATURES) checked at engine start, before and after the model loads."""
        return ()

    def engine_args(self, cfg) -> dict[str, Any]:
        """Arguments added to vLLM's `LLM(...)` for the resolved rollout config `cfg`."""
        return {}

    def on_started(self, engine) -> None:
        """The engine's vLLM runs: install what the feature needs in its worker."""

    def begin(self) -> None:
        """A `generate` is about to run its requests."""

    def batch_fields(self, outputs, prompts: list[list[int]], samples: list[tuple[str, int]]) -> dict[str, Any]:
        """`FeatureRecords` fields (rollout/batch.py: the batch's `features`) for the rows of vLLM's `outputs` (in
        batch order; `samples` holds each row's (output request id, sample index))."""
        return {}

    follows_turns = False
    """Whether `turn_fields` keeps the feature's record across an episode's turns (else sample_turns refuses it)."""

    def turn_fields(self, outputs, prompts: list[list[int]], earlier: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Per row of vLLM's `outputs` (one sample per prompt, the whole episode so far as the prompt): the record
        of the sequence so far (prompt + this turn's tokens), continuing `earlier` (that row's record after the
        previous turn; empty on the first)."""
        raise NotImplementedError(f"{type(self).__name__} does not follow an episode across turns")

    def on_prefix_reset(self) -> None:
        """The engine emptied vLLM's prefix cache (new weights): its cached prefixes are computed again."""

    def after_rescore(self) -> None:
        """Re-scoring requests ran (their results are not rows of any batch)."""

    def detach(self) -> None:
        """Undo `on_started` (the engine stops calling this extension)."""
