"""The two validation helpers every config dataclass's `__post_init__` uses."""
from __future__ import annotations


def check(cond: bool, msg: str) -> None:
    """Raise ValueError(msg) unless `cond`."""
    if not cond:
        raise ValueError(msg)


def require(ok: bool, path: str, rule: str, got: object) -> None:
    """Raise ValueError("<dotted path> <rule> (got <value>)") unless `ok`."""
    if not ok:
        raise ValueError(f"{path} {rule} (got {got!r})")
