"""`StepCapture`: the base of the captures that record, inside a RolloutEngine's in-process vLLM worker, what
each engine step did for each request (R3 routes: rollout/routes.py; sampler support: rollout/sampling_mask.py).

A capture is an engine extension (rollout/extension.py) handed to the engine at construction: once vLLM runs it
installs its vLLM hooks in the worker (`on_started`), `RolloutEngine.generate` arms it with `begin` and reads it
with `batch_fields` (its `collect`), and it sees every model forward of an armed generation as a `vllm_access.StepContext` (request ids, row offsets, token ids, positions) in
`_on_step`. What it files is keyed by vLLM's internal request id and position; `_by_sample` maps those ids
to (output request id, sample index) for `collect`.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from megatron_sparse_rl import vllm_access
from megatron_sparse_rl.rollout.extension import EngineExtension


class StepCapture(EngineExtension):
    """See the module docstring. Subclasses set `provides`, `field`, `features`, `error` and implement
    `_install_hooks`, `_remove_hooks`, `_on_step` and `collect`."""

    field = ""  # the FeatureRecords field (rollout/batch.py) `collect` fills
    features: tuple[str, ...] = ("step",)  # what of vLLM's internals the capture relies on (vllm_access.FEATURES)
    error: type[Exception] = RuntimeError

    def __init__(self):
        self.active = False
        self._runner = None
        self._handle = None
        self._step = None
        # internal request id -> position -> what the subclass files there
        self._seen: dict[str, dict] = defaultdict(dict)

    def on_started(self, engine) -> None:
        vllm_access.check(features=self.features)
        engine.apply_worker(self._install)

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._remove_hooks()

    def begin(self) -> None:
        """Start capturing (RolloutEngine.generate calls this)."""
        self._seen.clear()
        self._step = None
        self.active = True

    # ---- worker side (runs in the engine's process) -------------------------------------------------
    def _install(self, worker) -> None:
        vllm_access.check_worker(worker, self.features)
        self._runner = vllm_access.model_runner(worker)
        self._install_hooks(self._runner)
        self._handle = vllm_access.on_model_forward(self._runner, self._on_forward)

    def _on_forward(self, module, args, kwargs) -> None:
        if self.active:
            self._on_step(vllm_access.step_context(self._runner, kwargs))

    def _install_hooks(self, runner) -> None:
        """Install the capture's own vLLM hooks (before the model-forward hook)."""

    def _remove_hooks(self) -> None:
        """Undo `_install_hooks`."""

    def _on_step(self, step: vllm_access.StepContext) -> None:
        raise NotImplementedError

    # ---- driver side -------------------------------------------------------------------------------
    def collect(self, outputs, prompts: list[list[int]]):
        """Stop capturing; the record of every (prompt, response) row of vLLM's `outputs`, in RolloutBatch order."""
        raise NotImplementedError

    def batch_fields(self, outputs, prompts, samples) -> dict:
        return {self.field: self.collect(outputs, prompts)}

    def _by_sample(self) -> dict[tuple[str, int], str]:
        return requests_by_sample(self._seen, self.error)

    def _file(self, step: dict, per_token) -> None:
        """File row t of `per_token` (one entry per token of the step) under its request and position, with the
        token id the engine fed there: `_seen[req][position] = (token id, per_token[t])`."""
        for r, req in enumerate(step["req_ids"]):
            seen = self._seen[req]
            for t in range(step["starts"][r], step["starts"][r + 1]):
                seen[int(step["positions"][t])] = (int(step["input_ids"][t]), per_token[t])

    def _rows_seen(self, outputs, prompts: list[list[int]], what: str) -> tuple[list[list[int]], list[dict]]:
        """Stop capturing; per (prompt, response) row of vLLM's `outputs`, in RolloutBatch order, its token ids and
        what was filed for its request (a row without any raises `error`, naming `what` was missing)."""
        self.active = False
        by_key = self._by_sample()
        seqs, seens = [], []
        for out, prompt in zip(outputs, prompts):
            for c in sorted(out.outputs, key=lambda c: c.index):
                req = by_key.get((out.request_id, c.index))
                if req is None:
                    raise self.error(f"sequence {len(seqs)}: no {what} captured (request {out.request_id}, "
                                     f"sample {c.index})")
                seqs.append(list(prompt) + list(c.token_ids))
                seens.append(self._seen[req])
        return seqs, seens


class LayerStepCapture(StepCapture):
    """A StepCapture that records one tensor per captured layer and engine step, rows = the step's flat tokens (R3
    routes, DSA indexer choices): `_on_step` starts a step's record, a layer's hook calls `_keep_layer`, and the next
    step (or `collect`) files it per request and position. Subclasses set `layers` and `no_rows` (what the message
    says a layer that gave nothing for a step did, e.g. "route capture: ... reported no routes")."""

    no_rows: tuple[str, str] = ("", "")
    layers: tuple[int, ...] = ()

    def _on_step(self, step: vllm_access.StepContext) -> None:
        self._flush()
        self._step = dict(req_ids=step.req_ids, starts=step.starts, input_ids=step.input_ids.cpu().clone(),
                          positions=step.positions.cpu().clone(), rows=[None] * len(self.layers))

    def _keep_layer(self, j: int, rows: torch.Tensor, dtype: torch.dtype) -> None:
        """Layer j's rows of the step in progress: the first (the step's token count) of `rows`, as `dtype`, copied
        at once (the engine may reuse the buffer)."""
        if self.active and self._step is not None:
            n = self._step["starts"][-1]
            self._step["rows"][j] = rows[:n].to(dtype).cpu().clone()

    def _flush(self) -> None:
        """File the finished step's rows [tokens, layers, ...] under each request's positions."""
        step, self._step = self._step, None
        if step is None:
            return
        missing = [self.layers[j] for j, t in enumerate(step["rows"]) if t is None]
        if missing:
            what, did = self.no_rows
            raise self.error(f"{what}: layers {missing} {did} for an engine step")
        self._file(step, torch.stack(step["rows"], dim=1))


def requests_by_sample(req_ids, error: type[Exception]) -> dict[tuple[str, int], str]:
    """{(vLLM output request id, sample index): internal request id} for the internal ids seen in a step."""
    by_key = {}
    for req in req_ids:
        key = vllm_access.request_key(req)
        if key is None:
            raise error(f"cannot parse vLLM request id {req!r}")
        by_key[key] = req
    return by_key
