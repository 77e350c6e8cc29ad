"""Optional and heavy dependencies: cached presence checks and a `require` that says what to install.

Nothing here imports the optional package unless asked; `import megatron_sparse_rl` stays light.
"""
from __future__ import annotations

import functools
import importlib.util


@functools.cache
def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def has_vllm() -> bool:
    return _has("vllm")


def has_te() -> bool:
    return _has("transformer_engine")


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def require(module: str, feature: str, hint: str) -> None:
    """Raise an ImportError naming the feature that needs `module` and how to install it."""
    if not _has(module):
        raise ImportError(f"{feature} needs the '{module}' package, which is not installed. {hint}")
