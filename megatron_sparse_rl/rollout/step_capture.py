"""`StepCapture`: the base of the captures that record, inside a RolloutEngine's in-process vLLM worker, what
each engine step did for each request (R3 routes: rollout/routes.py; sampler support: rollout/sampling_mask.py).

A capture attaches to an engine (`engine.<slot>` = the capture, which `RolloutEngine.generate` arms with
`begin` and reads with `collect`), installs its vLLM hooks in the worker, and sees every model forward of an
armed generation as a `vllm_access.StepContext` (request ids, row offsets, token ids, positions) in
`_on_step`. What it files is keyed by vLLM's internal request id and position; `_by_sample` maps those ids
to (output request id, sample index) for `collect`.
"""
from __future__ import annotations

from collections import defaultdict

from megatron_sparse_rl import vllm_access


class StepCapture:
    """See the module docstring. Subclasses set `slot`, `features`, `error` and implement `_install_hooks`,
    `_remove_hooks`, `_on_step` and `collect`."""

    slot = ""  # the RolloutEngine attribute generate() reads
    features: tuple[str, ...] = ("step",)  # what of vLLM's internals the capture relies on (vllm_access.FEATURES)
    error: type[Exception] = RuntimeError

    def __init__(self):
        self.active = False
        self._engine = None
        self._runner = None
        self._handle = None
        self._step = None
        # internal request id -> position -> what the subclass files there
        self._seen: dict[str, dict] = defaultdict(dict)

    @classmethod
    def attach(cls, engine) -> "StepCapture":
        vllm_access.check(features=cls.features)
        capture = cls()
        engine.apply_worker(capture._install)
        setattr(engine, cls.slot, capture)
        capture._engine = engine
        return capture

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._remove_hooks()
        if getattr(self._engine, self.slot, None) is self:
            setattr(self._engine, self.slot, None)

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
    def _by_sample(self) -> dict[tuple[str, int], str]:
        return requests_by_sample(self._seen, self.error)


def requests_by_sample(req_ids, error: type[Exception]) -> dict[tuple[str, int], str]:
    """{(vLLM output request id, sample index): internal request id} for the internal ids seen in a step."""
    by_key = {}
    for req in req_ids:
        key = vllm_access.request_key(req)
        if key is None:
            raise error(f"cannot parse vLLM request id {req!r}")
        by_key[key] = req
    return by_key
