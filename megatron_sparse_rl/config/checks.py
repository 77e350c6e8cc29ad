"""The two validation helpers every config dataclass's `__post_init__` uses, `require_finite`, which `RunConfig`
applies to every float of the whole config, and `positive` / `finite`, the argparse types of command-line numbers
(benchmarks, tools)."""
from __future__ import annotations

import dataclasses
import math


def check(cond: bool, msg: str) -> None:
    """Raise ValueError(msg) unless `cond`."""
    if not cond:
        raise ValueError(msg)


def require(ok: bool, path: str, rule: str, got: object) -> None:
    """Raise ValueError("<dotted path> <rule> (got <value>)") unless `ok`."""
    if not ok:
        raise ValueError(f"{path} {rule} (got {got!r})")


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
