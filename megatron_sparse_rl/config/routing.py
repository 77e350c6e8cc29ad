"""Configuration of MoE routing replay (section `routing`): which routes the learner replays, the
load-balancing loss under replay, and routing statistics. Consumed by `learner/routing.py` (LearnerRouting)
and, for R3, by `rollout/routes.py` (route capture on the engine). See docs/routing.md.
"""
from dataclasses import dataclass
from typing import Literal, get_args

RoutingMode = Literal["off", "R2", "R3"]
AuxLossUnderReplay = Literal["off", "replayed"]
EngineRoutes = Literal["auto", "hook", "vllm"]
IndexerReplay = Literal["none", "R2", "R3"]


@dataclass(kw_only=True, frozen=True, slots=True)
class RoutingConfig:
    """MoE routing replay (R2 / R3) and routing-stability statistics."""

    mode: RoutingMode = "off"
    """off: the learner routes every forward itself. R2: the routes of the learner's old-logprob forward are
    recorded and replayed in every update forward (and activation-recompute backward). R3: the rollout
    engine's routes are captured and replayed in the old-logprob forward and every update."""
    aux_loss: AuxLossUnderReplay = "off"
    """Load-balancing aux loss while replaying (only matters when model.moe_aux_loss_coeff > 0): off = not
    computed under replay; replayed = computed on the replayed routing map (the experts that actually ran),
    with gradients through the current router scores."""
    record_stats: bool = True
    """Compute routing metrics every step: per-layer flip rate of rollout vs learner routes, fraction of
    tokens with any flipped expert, expert load entropy, and each update's expert drift from pi_old's routes
    (routing/drift_*; needs the learner's old-logprob forward). Costs one extra router matmul per MoE layer in
    R3's old forward and in every R2/R3 update forward, a host copy of every update's routes, and the route
    capture on the engine."""
    capture_rollout_routes: bool = False
    """Capture the engine's routes even when mode is not R3 (for the flip-rate statistics under off/R2)."""
    attribute_mismatch: bool = False
    """Measure each step how much of the train-inference mismatch routing explains: one extra learner forward
    over the old forward's tokens gives pi_old with the engine's routes replayed (off/R2) or with the learner's
    own routes (R3), so k1/k3 against the sampler's mu are known both ways (`mismatch/k3_engine_routes`,
    `mismatch/k3_learner_routes`, `mismatch/routing_share`; docs/routing.md). Needs the engine's routes (mode R3
    or capture_rollout_routes) and algorithm.old_logprobs = learner; costs one forward per step."""
    engine_routes: EngineRoutes = "auto"
    """How the engine reports the routes it used: vllm = vLLM's own routed-experts output
    (enable_return_routed_experts; runs in its GPU model runner, needs CUDA); hook = a callback on every vLLM
    MoE router (CPU and GPU); auto = vllm with CUDA, else hook."""
    indexer_replay: IndexerReplay = "none"
    """DeepSeek Sparse Attention models only (DeepSeek-V3.2, GLM-5): none = every forward attends its indexer's own
    top-k; R2 = the old-logprob forward records each DSA layer's top-k per query and every update attends exactly
    those (learner/indexer_replay.py; metrics indexer/flip_rate, indexer/agreement,
    indexer/replay_applied_fraction, each also per layer); R3 = the rollout engine's top-k (captured in vLLM by
    rollout/indexer_capture.py) is attended by the old-logprob forward, which also records the learner's own
    choice against it (indexer/engine_flip_rate, ...), and by every update. R3 needs the learner's old forward
    (algorithm.old_logprobs = learner) and a CUDA engine (vLLM serves DSA on GPU only); it has never been run."""

    def __post_init__(self):
        if self.mode not in get_args(RoutingMode):
            raise ValueError(f"routing.mode must be one of {get_args(RoutingMode)} (got {self.mode!r})")
        if self.aux_loss not in get_args(AuxLossUnderReplay):
            raise ValueError(f"routing.aux_loss must be one of {get_args(AuxLossUnderReplay)} (got {self.aux_loss!r})")
        if self.engine_routes not in get_args(EngineRoutes):
            raise ValueError(f"routing.engine_routes must be one of {get_args(EngineRoutes)} "
                             f"(got {self.engine_routes!r})")
        if self.indexer_replay not in get_args(IndexerReplay):
            raise ValueError(f"routing.indexer_replay must be one of {get_args(IndexerReplay)} "
                             f"(got {self.indexer_replay!r})")
        if self.attribute_mismatch and not self.capture:
            raise ValueError(f"routing.attribute_mismatch needs the engine's routes, which routing.mode = "
                             f"{self.mode!r} does not capture: set routing.mode = 'R3' or "
                             "routing.capture_rollout_routes = true")

    @property
    def replay(self) -> bool:
        """Whether the learner model must be built with Megatron's RouterReplay."""
        return self.mode != "off" or self.record_stats or self.attribute_mismatch

    @property
    def capture(self) -> bool:
        """Whether the rollout engine must capture the routes it used."""
        return self.mode == "R3" or self.capture_rollout_routes

    def vllm_routes(self, cuda: bool) -> bool:
        """Whether the engine's routes come from vLLM's own output (else from the router callback)."""
        return self.engine_routes == "vllm" or (self.engine_routes == "auto" and cuda)
