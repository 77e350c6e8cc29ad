"""megatron_sparse_rl: RL post-training for large Mixture-of-Experts LLMs.

Megatron-Core learners train with GRPO-family and GSPO losses; vLLM engines generate rollouts with a
sparse, fixed-budget KV cache; off-policy corrections keep training stable. Importing this package
imports neither vLLM nor Transformer Engine (see `_optional.py`).
"""
__version__ = "0.1.0"
