"""The two validation helpers every config dataclass's `__post_init__` uses, and `positive`, the argparse type
of the command-line numbers that must be > 0 (benchmarks, tools)."""
from __future__ import annotations


def check(cond: bool, msg: str) -> None:
    """Raise ValueError(msg) unless `cond`."""
    if not cond:
        raise ValueError(msg)


def require(ok: bool, path: str, rule: str, got: object) -> None:
    """Raise ValueError("<dotted path> <rule> (got <value>)") unless `ok`."""
    if not ok:
        raise ValueError(f"{path} {rule} (got {got!r})")


def positive(kind=int):
    """An argparse `type=` that parses `kind` and refuses values <= 0 with a clear message."""
    import argparse

    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0 (got {text})")
        return value
    return parse
