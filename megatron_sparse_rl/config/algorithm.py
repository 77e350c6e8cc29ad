"""Configuration of the RL algorithms (section `algorithm`): advantages, policy loss, corrections, KL.

Every class is a frozen, keyword-only dataclass with a docstring under each field; the project's
strict YAML loader builds them from nested dicts, and each `__post_init__` rejects a bad value with
the dotted path of the field, the rule and the value. Defaults follow shared/references.md.
The math lives in `megatron_sparse_rl.algorithms`; this module imports nothing from it.
"""
from dataclasses import dataclass, field
from typing import Literal, get_args
from megatron_sparse_rl.config.checks import MAX_SAMPLES
from megatron_sparse_rl.config.checks import require as _require
from megatron_sparse_rl.config.checks import require_range as _range

LossName = Literal["grpo", "dapo", "dual_clip", "gspo", "gspo_token", "cispo"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
KLEstimator = Literal["k1", "k2", "k3"]
AdvantageEstimator = Literal["grpo", "rloo"]
OldLogprobsSource = Literal["learner", "engine", "engine_mean"]
TISRatio = Literal["pi_old", "pi_theta"]
# Losses whose token gradient is w_t r_t A grad log pi_theta on unclipped tokens, so that tis.ratio = pi_theta's
# factor w_t = min(rho_t, C / sg(r_t)) makes the IS weight w_t r_t = min(pi_theta/mu, C).
PPO_TOKEN_LOSSES = ("grpo", "dapo", "dual_clip")

# (clip_low, clip_high) used when the config leaves them unset; references.md: PPO/GRPO 0.2/0.2,
# DAPO clip-higher 0.28, GSPO 3e-4/4e-4. CISPO (MiniMax-M1) puts no lower bound on its IS weight
# (low 1.0 -> bound 0); its upper 0.28 is our choice, not a published default.
DEFAULT_CLIPS: dict[str, tuple[float, float]] = {
    "grpo": (0.2, 0.2),
    "dapo": (0.2, 0.28),
    "dual_clip": (0.2, 0.2),
    "gspo": (3e-4, 4e-4),
    "gspo_token": (3e-4, 4e-4),
    "cispo": (1.0, 0.28),
}


def _require_choice(value: str, choices: tuple, path: str) -> None:
    _require(value in choices, path, f"must be one of {list(choices)}", value)


def _require_bounds(low: float, high: float, path: str, low_name: str, high_name: str) -> None:
    _require(low > 0, f"{path}.{low_name}", "must be > 0", low)
    if low > high:
        raise ValueError(f"{path}.{low_name} must be <= {path}.{high_name} (got {low!r} > {high!r})")


@dataclass(kw_only=True, frozen=True, slots=True)
class AdvantageConfig:
    """How rewards of a prompt's group of samples become advantages."""

    estimator: AdvantageEstimator = "grpo"
    """grpo: (R - mean_G R) / (std_G R + eps); rloo: R minus the mean of the other samples of the group."""
    scale_by_std: bool = True
    """grpo only: divide by the group std; false gives Dr.GRPO's mean-centred advantages."""
    std_unbiased: bool = True
    """grpo only: use the (n - 1) group std (as DeepSeekMath/TRL) instead of the population std."""
    eps: float = 1e-6
    """grpo only: added to the std before dividing."""

    def __post_init__(self) -> None:
        _require_choice(self.estimator, get_args(AdvantageEstimator), "algorithm.advantage.estimator")
        _require(self.eps > 0, "algorithm.advantage.eps", "must be > 0", self.eps)


@dataclass(kw_only=True, frozen=True, slots=True)
class LossConfig:
    """The policy loss: which surrogate, its clip range and how token terms are averaged."""

    name: LossName = "grpo"
    """Registry name: grpo, dapo (clip-higher), dual_clip, gspo, gspo_token, cispo."""
    clip_low: float | None = None
    """Lower clip: the ratio is kept >= 1 - clip_low; unset means the loss's default (DEFAULT_CLIPS)."""
    clip_high: float | None = None
    """Upper clip: the ratio is kept <= 1 + clip_high; unset means the loss's default (DEFAULT_CLIPS)."""
    dual_clip_c: float = 3.0
    """dual_clip only: for negative advantages the token loss is capped at -c * A."""
    aggregation: Aggregation = "token_mean"
    """token_mean, seq_mean_token_mean (Sparse-RL, GSPO) or seq_mean_token_sum (Dr.GRPO-like)."""
    dropped_tokens_in_denominator: bool = False
    """Whether the response tokens a rollout-time correction drops (mis, icepop, geo_rs, veto, sparse_rl,
    batch_skip) still count in the loss's denominators: the normaliser (token or sequence count) and, with
    seq_mean_token_mean, each sequence's token count. false: they leave them (the kept tokens carry the whole
    mean). true: they stay, adding 0 to the numerator (slime's and miles' convention, and verl's for IcePop; see
    docs/from_verl_slime.md). Tokens with non-finite logprobs and preempted sparse-KV samples leave either way."""

    def __post_init__(self) -> None:
        _require_choice(self.name, get_args(LossName), "algorithm.loss.name")
        _require_choice(self.aggregation, get_args(Aggregation), "algorithm.loss.aggregation")
        if self.clip_low is not None:
            _require(self.clip_low >= 0, "algorithm.loss.clip_low", "must be >= 0", self.clip_low)
            _require(self.clip_low <= 1, "algorithm.loss.clip_low", "must be <= 1", self.clip_low)
        if self.clip_high is not None:
            _require(self.clip_high >= 0, "algorithm.loss.clip_high", "must be >= 0", self.clip_high)
        _require(self.dual_clip_c > 1, "algorithm.loss.dual_clip_c", "must be > 1", self.dual_clip_c)
        _require(isinstance(self.dropped_tokens_in_denominator, bool), "algorithm.loss.dropped_tokens_in_denominator",
                 "must be true or false", self.dropped_tokens_in_denominator)

    def clip_bounds(self, name: str | None = None) -> tuple[float, float]:
        """(clip_low, clip_high); unset values come from the defaults of loss `name` (default: self.name)."""
        low, high = DEFAULT_CLIPS[self.name if name is None else name]
        return (low if self.clip_low is None else self.clip_low,
                high if self.clip_high is None else self.clip_high)


@dataclass(kw_only=True, frozen=True, slots=True)
class TISConfig:
    """Truncated importance sampling: weight min(rho, cap) per token or per sequence."""

    enabled: bool = False
    """Apply this correction."""
    level: Literal["token", "sequence"] = "token"
    """token: rho_t; sequence: prod_t rho_t (one weight for the whole response)."""
    cap: float = 2.0
    """Truncation C (references.md: 2; Sparse-RL 1.5; Qwen MiniRL 5)."""
    ratio: TISRatio = "pi_old"
    """Which policy's probability over mu is truncated. pi_old: w_t = min(pi_old/mu, C), fixed at rollout time.
    pi_theta (MiniRL, token level and a PPO-clip loss only): the IS weight is sg[min(pi_theta/mu, C)] with the
    current pi_theta, evaluated in every update's loss: w_t = min(rho_t, C / sg(r_t)), so that the loss's r_t
    times w_t is min(pi_theta/mu, C). The two differ only where the cap binds (equal on-policy, where r_t = 1)."""

    def __post_init__(self) -> None:
        _require_choice(self.level, ("token", "sequence"), "algorithm.corrections.tis.level")
        _require(self.cap > 0, "algorithm.corrections.tis.cap", "must be > 0", self.cap)
        _require_choice(self.ratio, get_args(TISRatio), "algorithm.corrections.tis.ratio")
        if self.ratio == "pi_theta" and self.level != "token":
            raise ValueError("algorithm.corrections.tis.ratio = 'pi_theta' needs algorithm.corrections.tis.level = "
                             f"'token' (got {self.level!r})")


@dataclass(kw_only=True, frozen=True, slots=True)
class MISConfig:
    """Masked importance sampling / rejection: drop tokens or sequences whose rho leaves [low, high]."""

    enabled: bool = False
    """Apply this correction."""
    level: Literal["token", "sequence"] = "token"
    """token: test rho_t; sequence: test prod_t rho_t and drop the whole response."""
    low: float = 0.5
    """Keep iff low <= rho <= high."""
    high: float = 2.0
    """Keep iff low <= rho <= high."""
    reweight: bool = False
    """Also weight kept tokens by rho (masked IS); false is pure rejection (weight 1)."""

    def __post_init__(self) -> None:
        _require_choice(self.level, ("token", "sequence"), "algorithm.corrections.mis.level")
        _require_bounds(self.low, self.high, "algorithm.corrections.mis", "low", "high")


@dataclass(kw_only=True, frozen=True, slots=True)
class GeoRSConfig:
    """Geometric rejection (Geo-RS): drop a sequence whose exp(mean_t log rho_t) leaves [low, high]."""

    enabled: bool = False
    """Apply this correction."""
    low: float = 0.999
    """Keep iff low <= geometric-mean rho <= high (tight bounds, references.md)."""
    high: float = 1.001
    """Keep iff low <= geometric-mean rho <= high."""

    def __post_init__(self) -> None:
        _require_bounds(self.low, self.high, "algorithm.corrections.geo_rs", "low", "high")


@dataclass(kw_only=True, frozen=True, slots=True)
class VetoConfig:
    """Veto: drop a whole sequence if any of its tokens has rho_t < threshold."""

    enabled: bool = False
    """Apply this correction."""
    threshold: float = 1e-4
    """C_veto (references.md: 1e-4 .. 1e-6)."""

    def __post_init__(self) -> None:
        _require(self.threshold > 0, "algorithm.corrections.veto.threshold", "must be > 0", self.threshold)


@dataclass(kw_only=True, frozen=True, slots=True)
class IcePopConfig:
    """IcePop (Ring-1T): token factor rho_t inside [alpha, beta], 0 (masked) outside."""

    enabled: bool = False
    """Apply this correction."""
    alpha: float = 0.5
    """Lower bound on rho_t."""
    beta: float = 5.0
    """Upper bound on rho_t."""

    def __post_init__(self) -> None:
        _require_bounds(self.alpha, self.beta, "algorithm.corrections.icepop", "alpha", "beta")


@dataclass(kw_only=True, frozen=True, slots=True)
class OPSMConfig:
    """Off-policy sequence masking (DeepSeek-V3.2): drop negative-advantage sequences that drifted."""

    enabled: bool = False
    """Apply this correction."""
    delta: float = 0.5
    """Mask sequence i when A_i < 0 and mean_t (log mu - log pi_theta) > delta."""

    def __post_init__(self) -> None:
        _require(self.delta >= 0, "algorithm.corrections.opsm.delta", "must be >= 0", self.delta)


@dataclass(kw_only=True, frozen=True, slots=True)
class SparseRLConfig:
    """Sparse-RL: reject sequences the dense policy would not produce, reweight the rest."""

    enabled: bool = False
    """Apply this correction."""
    eps: float = 1e-4
    """A sequence gets weight 0 if any valid token has xi_t < eps."""
    weight_cap: float = 1.5
    """w_t = min(xi_t, weight_cap)."""
    normalize: bool = True
    """Rescale the weights to mean 1 over the valid (kept) tokens of the batch."""
    log_clamp: float = 20.0
    """xi_t = exp(clamp(log pi_old - log mu, -log_clamp, log_clamp))."""
    token_reject: bool = False
    """Also drop single tokens with xi_t outside [token_low, token_high]."""
    token_low: float = 0.5
    """Lower edge of the token band (token_reject only)."""
    token_high: float = 1.5
    """Upper edge of the token band (token_reject only)."""

    def __post_init__(self) -> None:
        path = "algorithm.corrections.sparse_rl"
        _require(self.eps > 0, f"{path}.eps", "must be > 0", self.eps)
        _require(self.weight_cap > 0, f"{path}.weight_cap", "must be > 0", self.weight_cap)
        _require(self.log_clamp > 0, f"{path}.log_clamp", "must be > 0", self.log_clamp)
        _require_bounds(self.token_low, self.token_high, path, "token_low", "token_high")


@dataclass(kw_only=True, frozen=True, slots=True)
class BatchSkipConfig:
    """Skip the whole update when the batch's k1 mismatch mean(log mu - log pi_old) is too large."""

    enabled: bool = False
    """Apply this rule (every token of a skipped batch is dropped)."""
    max_k1: float = 0.1
    """Skip when k1 > max_k1 (references.md, rl-collapse)."""

    def __post_init__(self) -> None:
        _require(self.max_k1 >= 0, "algorithm.corrections.batch_skip.max_k1", "must be >= 0", self.max_k1)


@dataclass(kw_only=True, frozen=True, slots=True)
class CorrectionsConfig:
    """Corrections for sampler (mu) != learner (pi_old); the enabled ones compose (weights multiply)."""

    tis: TISConfig = field(default_factory=TISConfig)
    """Truncated importance sampling."""
    mis: MISConfig = field(default_factory=MISConfig)
    """Masked importance sampling / rejection (token or sequence)."""
    geo_rs: GeoRSConfig = field(default_factory=GeoRSConfig)
    """Geometric-mean sequence rejection."""
    veto: VetoConfig = field(default_factory=VetoConfig)
    """Catastrophic-token veto."""
    icepop: IcePopConfig = field(default_factory=IcePopConfig)
    """IcePop token masking."""
    opsm: OPSMConfig = field(default_factory=OPSMConfig)
    """Off-policy sequence masking."""
    sparse_rl: SparseRLConfig = field(default_factory=SparseRLConfig)
    """Sparse-RL rejection and reweighting."""
    batch_skip: BatchSkipConfig = field(default_factory=BatchSkipConfig)
    """Batch skip on the k1 mismatch."""


@dataclass(kw_only=True, frozen=True, slots=True)
class KLConfig:
    """KL-to-reference penalty added to the policy loss (coef 0 disables it)."""

    coef: float = 0.0
    """Weight of the KL term; 0 turns it off (no reference forward needed)."""
    estimator: KLEstimator = "k3"
    """k1 = log(p/q), k2 = (log(p/q))^2 / 2, k3 = q/p - log(q/p) - 1 (low variance, >= 0)."""
    use_unbiased: bool = False
    """Use the off-policy unbiased estimator (pi_theta/pi_old) * k3 (DeepSeek-V3.2) instead."""
    clamp: float | None = None
    """k3 only: cap each token's KL estimate at this value (with use_unbiased, the product (pi_theta/pi_old) * k3);
    a capped token adds the constant `clamp` and no gradient. null: no cap (the estimate is unbounded above, so a
    token far from the reference keeps pulling back). 10 is verl's low_var_kl/k3 and slime's/miles' low_var_kl."""
    correction_weights: bool = True
    """Multiply each token's KL estimate by its rollout-time correction weight (tis, icepop, mis reweight,
    sparse_rl: the same w_t as the policy term), which makes it an estimate under pi_old although the tokens were
    sampled from mu. false: unweighted (verl, slime and miles put no correction weight on their KL terms)."""

    def __post_init__(self) -> None:
        _require(self.coef >= 0, "algorithm.kl.coef", "must be >= 0", self.coef)
        _require_choice(self.estimator, get_args(KLEstimator), "algorithm.kl.estimator")
        if self.clamp is not None:
            _require(self.clamp > 0, "algorithm.kl.clamp", "must be null (no cap) or > 0", self.clamp)
            if self.estimator != "k3":
                raise ValueError("algorithm.kl.clamp caps the k3 estimate only: it needs algorithm.kl.estimator = "
                                 f"'k3' (got {self.estimator!r}), or clamp = null")
        _require(isinstance(self.correction_weights, bool), "algorithm.kl.correction_weights", "must be true or false",
                 self.correction_weights)


@dataclass(kw_only=True, frozen=True, slots=True)
class AlgorithmConfig:
    """Root of the `algorithm` section."""

    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    """Advantage estimator."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Policy loss."""
    corrections: CorrectionsConfig = field(default_factory=CorrectionsConfig)
    """Sampler/learner mismatch corrections."""
    kl: KLConfig = field(default_factory=KLConfig)
    """KL-to-reference penalty."""
    keep_sampling_mask: bool = False
    """Renormalise pi_theta and pi_old over the token ids that survived top-p/top-k at sampling (the
    support rollout.record_sampling_mask records), so they share mu's support."""
    old_logprobs: OldLogprobsSource = "learner"
    """Where pi_old (the PPO ratio's denominator, the corrections' numerator) comes from. learner: the learner's
    dense recompute (one extra forward per step); engine: the sampler's own logprobs mu (no recompute; then
    rho = 1 and the mu-vs-pi_old corrections have nothing to correct); engine_mean: the mean in probability
    space of `old_logprobs_samples` engine re-scorings of each sampled sequence (prompt logprobs, same weights,
    dense attention, batched in the engine; KAT-Coder's estimator for MoE inference noise)."""
    old_logprobs_samples: int = 4
    """engine_mean only: re-scorings per sequence (n >= 1; n = 1 is one dense engine re-scoring)."""

    def __post_init__(self) -> None:
        _require_choice(self.old_logprobs, get_args(OldLogprobsSource), "algorithm.old_logprobs")
        _require(self.old_logprobs_samples >= 1, "algorithm.old_logprobs_samples", "must be >= 1",
                 self.old_logprobs_samples)
        _range(self.old_logprobs_samples, "algorithm.old_logprobs_samples", 1, MAX_SAMPLES)
        tis = self.corrections.tis
        if tis.enabled and tis.ratio == "pi_theta" and self.loss.name not in PPO_TOKEN_LOSSES:
            raise ValueError("algorithm.corrections.tis.ratio = 'pi_theta' needs a loss whose gradient carries the "
                             f"token ratio r_t: algorithm.loss.name one of {list(PPO_TOKEN_LOSSES)} "
                             f"(got {self.loss.name!r})")
