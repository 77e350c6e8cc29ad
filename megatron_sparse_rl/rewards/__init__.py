"""Verifiers: exact answer and math equivalence, a registry keyed by `reward.kind`, batch scoring."""
from megatron_sparse_rl.rewards.exact import exact_answer, extract_answer, numeric_answer
from megatron_sparse_rl.rewards.math_equiv import has_math_verify, math_verify_equal
from megatron_sparse_rl.rewards.registry import REWARDS, make_scorer, reward_fn, score

__all__ = ["REWARDS", "exact_answer", "extract_answer", "has_math_verify", "make_scorer", "math_verify_equal",
           "numeric_answer", "reward_fn", "score"]
