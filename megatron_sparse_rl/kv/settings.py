"""The sparse-KV settings as they travel inside vLLM: `additional_config[CONFIG_KEY]` of the VllmConfig.

vLLM hands its config to the engine core (scheduler) and to every worker, in this process or in others,
so both sides read the same `SparseKVSettings` from there; no globals or environment switches. The fields,
defaults and checks are `KVConfig`'s (`rollout.kv`), the one KV schema: nothing is restated here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from megatron_sparse_rl.config.rollout import KVBudgetScheduleConfig, KVConfig

CONFIG_KEY = "msrl_sparse_kv"


@dataclass(kw_only=True, frozen=True, slots=True)
class SparseKVSettings(KVConfig):
    """`KVConfig` (policy != "none") as plain data in vLLM's config, rebuilt and re-checked on each side."""

    @classmethod
    def from_kv_config(cls, kv_cfg: KVConfig) -> "SparseKVSettings":
        return cls(**{f.name: getattr(kv_cfg, f.name) for f in dataclasses.fields(KVConfig)})

    def to_additional_config(self) -> dict:
        return {CONFIG_KEY: dataclasses.asdict(self)}

    @classmethod
    def from_vllm_config(cls, vllm_config) -> "SparseKVSettings | None":
        extra = getattr(vllm_config, "additional_config", None) or {}
        raw = extra.get(CONFIG_KEY) if isinstance(extra, dict) else None
        if raw is None:
            return None
        schedule = KVBudgetScheduleConfig(**raw.get("budget_schedule", {}))  # asdict made the section a dict
        return cls(**{**raw, "budget_schedule": schedule})
