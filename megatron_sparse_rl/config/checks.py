"""The validation helpers every config dataclass's `__post_init__` uses (`check`, `require`, and `require_range` with
the upper bounds of the config's counts below), `require_finite`, which `RunConfig` applies to every float of the
whole config, and `positive` / `finite`, the argparse types of command-line numbers (benchmarks, tools)."""
from __future__ import annotations

import dataclasses
import math

# Upper bounds of the config's counts: far above what any run uses, low enough that a typo (10**12 turns, samples
# or steps) is refused at load instead of sizing a loop, a batch or an allocation.
MAX_TOKENS = 1 << 24
"""16,777,216: the most tokens of a sequence, a response, a prompt, an episode or a KV budget (above the longest
context of released models, Llama 4 Scout's 10,485,760 positions)."""
MAX_SAMPLES = 1024
"""The most samples per prompt (rollout.sampling.n, trainer.eval_samples), engine re-scorings per sequence and
optimizer updates per rollout."""
MAX_BATCH = 1 << 20
"""1,048,576: the most prompts, examples or sequences of one step or one micro-batch."""
MAX_STEPS = 10_000_000
"""The most steps of a run or stage, and the longest interval counted in steps."""
MAX_RECORDS = 1 << 24
"""16,777,216: the most problems a built-in task generates (they are all held in memory)."""
MAX_RANKS = 1 << 16
"""65,536: the most nodes of a job, and the largest parallel degree."""
MAX_SEED = 2**32 - 1
"""The largest seed (numpy's limit; torch and Megatron add rank offsets to it)."""


def check(cond: bool, msg: str) -> None:
    """Raise ValueError(msg) unless `cond`."""
    if not cond:
        raise ValueError(msg)


def require(ok: bool, path: str, rule: str, got: object) -> None:
    """Raise ValueError("<dotted path> <rule> (got <value>)") unless `ok`."""
    if not ok:
        raise ValueError(f"{path} {rule} (got {got!r})")


def require_range(value: int, path: str, low: int, high: int) -> None:
    """Raise ValueError("<dotted path> must be in [<low>, <high>] (got <value>)") unless low <= value <= high."""
    if not low <= value <= high:
        raise ValueError(f"{path} must be in [{low}, {high}] (got {value!r})")


def require_finite(cfg: object, path: str = "", allowed: frozenset[str] = frozenset()) -> None:
    """Raise ValueError("<dotted path> must be finite (got inf)") for the first float of dataclass `cfg` (its
    sections, lists and mappings included) that is inf or nan, unless its path is in `allowed`."""
    if dataclasses.is_dataclass(cfg):
        items = [(f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg)]
    elif isinstance(cfg, (tuple, list)):
        items = [(f"[{i}]", v) for i, v in enumerate(cfg)]
    elif isinstance(cfg, dict):
        items = [(str(k), v) for k, v in cfg.items()]
    else:
        return
    for name, value in items:
        where = f"{path}{name}" if name.startswith("[") or not path else f"{path}.{name}"
        if isinstance(value, float) and not math.isfinite(value) and where not in allowed:
            raise ValueError(f"{where} must be finite (got {value})")
        require_finite(value, where, allowed)


def positive(kind=int):
    """An argparse `type=` that parses `kind` and refuses values <= 0, inf and nan with a clear message."""
    import argparse

    def parse(text: str):
        value = kind(text)
        if not value > 0 or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number > 0 (got {text})")
        return value
    return parse


def finite(text: str) -> float:
    """An argparse `type=` for a float that must be finite (inf and nan refused)."""
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number (got {text!r})") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number (got {text})")
    return value
