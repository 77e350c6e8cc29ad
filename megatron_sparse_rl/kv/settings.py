"""The sparse-KV settings as they travel inside vLLM: `additional_config[CONFIG_KEY]` of the VllmConfig.

vLLM hands its config to the engine core (scheduler) and to every worker, in this process or in others,
so both sides read the same `SparseKVSettings` from there; no globals or environment switches.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

CONFIG_KEY = "msrl_sparse_kv"


@dataclass(frozen=True, slots=True)
class SparseKVSettings:
    """A plain-data copy of `KVConfig` (policy != "none")."""

    policy: str
    budget: int
    window: int
    interval: int
    sinks: int
    pooling: str
    kernel: int
    rkv_lambda: float
    rkv_threshold: float
    record_keep: bool
    admission_control: bool

    @classmethod
    def from_kv_config(cls, kv_cfg) -> "SparseKVSettings":
        return cls(**{f.name: getattr(kv_cfg, f.name) for f in dataclasses.fields(cls)})

    def to_additional_config(self) -> dict:
        return {CONFIG_KEY: dataclasses.asdict(self)}

    @classmethod
    def from_vllm_config(cls, vllm_config) -> "SparseKVSettings | None":
        extra = getattr(vllm_config, "additional_config", None) or {}
        raw = extra.get(CONFIG_KEY) if isinstance(extra, dict) else None
        return None if raw is None else cls(**raw)
