"""A run checked against its model: the cross-component checks (validate.py: degrees against the world, the model's
shape against the layout and the engines), the runtime values a run leaves to its model (resolve.py) and the run
summary `msrl validate` prints (summary.py). Config (megatron_sparse_rl/config/) stays a leaf; this folder reads the
model through models/.

    from megatron_sparse_rl.config import load_config
    from megatron_sparse_rl.validation import validate
    run = load_config("configs/tiny_moe.yaml", overrides=["learner.optimizer.lr=3e-5"])
    spec = validate(run, world_size=1)     # ModelSpec, or None when the model's config.json is not here
"""
from megatron_sparse_rl.validation.validate import validate

__all__ = ["validate"]
