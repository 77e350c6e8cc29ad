"""A train step's loss_fn metrics summed over its micro-batches, on the host.

A loss_fn returns (loss, metrics): each metric a number or a tensor, or a dict or dataclass of them (such as
algorithms/objective.py `ObjectiveSums`, which adds with its own `+`). The learner moves them to host floats once per
micro-batch (its pipeline stages exchange them as Python objects) and adds them key by key.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch


def summed_on_host(items: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The micro-batches' metrics added key by key, each on the host (`on_host`)."""
    out: dict[str, Any] = {}
    for item in items:
        for k, v in item.items():
            v = on_host(v)
            out[k] = v if k not in out else out[k] + v
    return out


def on_host(value):
    """A loss_fn metric as host numbers: a tensor or number as a float; a dict or dataclass of them, item by item."""
    if isinstance(value, (torch.Tensor, int, float)):
        return float(value)
    if isinstance(value, dict):
        return {k: on_host(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: on_host(getattr(value, f.name))
                                             for f in dataclasses.fields(value) if f.init})
    raise TypeError(f"a loss_fn metric must be a number, a tensor, or a dict or dataclass of them "
                    f"(got {type(value).__name__})")
