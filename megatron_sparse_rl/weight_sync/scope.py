"""What a weight sync sends: the whole model, or, from a LoRA learner to engines that already hold a full set, the
adapted tensors alone (issue 49 item 3, merged sync).

    state = EngineWeightState()                        # one per placement: its engines hold nothing of ours yet
    stats = state.sync(learner, lambda only: send(learner, only=only))   # only: None (all) or the HF names to send

A LoRA learner's base is frozen (model.lora), so once an engine holds the full merged model only the merged tensors
(W + scale x B A) change from sync to sync. The decision is made here and nowhere else:
- the engines hold a full set only after a sync that sent everything (or a later one) returned; a placement starts
  without one (a fresh engine, a restarted process, a resume: each builds a new placement), and a sync that fails
  part-way leaves it without one, so the next sync sends everything again;
- a learner without adapters sends everything at every sync.
`stats.full_bytes` is the bytes of this placement's last full sync (what a sync would move without this rule).

Which tensors: every HF tensor of every HF module an adapted Megatron linear feeds (its weight and its bias: a vLLM
layer reloads whole, and a layer given part of its tensors would be rebuilt with the rest uninitialised), widened
by the engine's own fusions beyond Megatron's (`ENGINE_FUSED`).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from megatron_sparse_rl.weight_sync.buckets import SyncStats

log = logging.getLogger(__name__)

ENGINE_FUSED = (("q_a_proj", "kv_a_proj_with_mqa"),)
"""HF modules of one attention block that vLLM 0.32 loads into one layer while Megatron keeps them apart: DeepSeek's
MLA `fused_qkv_a_proj` = [q_a_proj; kv_a_proj_with_mqa] (vLLM's deepseek_v2.py, when q_lora_rank is set). Megatron's
own fusions (q/k/v in linear_qkv, gate/up in linear_fc1) are one tensor map, sent whole anyway."""


def _module(hf_name: str) -> str:
    return hf_name.rsplit(".", 1)[0]


def adapted_hf_names(tensor_maps, adapted: set[str] | dict) -> frozenset[str]:
    """The HF names a sync must send to an engine holding a full set, for adapters on the Megatron weights
    `adapted` (names, e.g. the learner's `lora_weights`): every tensor of the HF modules those weights map to, and of
    the modules the engine fuses with them (`ENGINE_FUSED`). Empty without adapters."""
    modules = {_module(hf) for tm in tensor_maps if tm.mcore in adapted for hf in tm.hf}
    for group in ENGINE_FUSED:
        for module in list(modules):
            parent, _, leaf = module.rpartition(".")
            if leaf in group:
                modules.update(f"{parent}.{other}" for other in group)
    return frozenset(hf for tm in tensor_maps for hf in tm.hf if _module(hf) in modules)


class EngineWeightState:
    """Whether this placement's engines hold a full set of the learner's weights, and so what its next sync sends."""

    def __init__(self):
        self.full = False
        """The engines hold a full set: a sync that sent everything returned since they started, and every sync
        after it returned too."""
        self.full_bytes = 0
        """The bytes the last full sync moved."""
        self._told = False  # the first partial sync logs what it moved against a full one
        self._adapted: tuple[frozenset[str], frozenset[str]] | None = None  # (adapted weights, their HF names)

    def only(self, learner) -> frozenset[str] | None:
        """The HF names the next sync sends: None (everything) until the engines hold a full set or for a learner
        without adapters; else the adapted tensors (`adapted_hf_names`)."""
        adapted = getattr(learner, "lora_weights", None)
        if not self.full or not adapted:
            return None
        key = frozenset(adapted)
        if self._adapted is None or self._adapted[0] != key:  # worked out once: the adapters stay for the run
            self._adapted = key, adapted_hf_names(learner.adapter.tensor_maps(learner.spec), key)
        return self._adapted[1]

    def sync(self, learner, send: Callable[[frozenset[str] | None], SyncStats]) -> SyncStats:
        """`send(only)` with `only` as decided (`only`); the stats with `full_bytes` set. Every learner rank calls it
        (the decision is the same on each: the same syncs have returned on every rank)."""
        only = self.only(learner)
        self.full = False  # a sync that raises part-way leaves the engines without a full set
        stats = send(only)
        if only is None:
            self.full_bytes = stats.bytes
        elif not self._told:
            self._told = True
            log.info("weight sync: the engines hold a full set, so syncs now send the %d adapted tensors alone (LoRA, "
                     "the base frozen): %.3f MB of a full sync's %.3f MB (%.1f%%)", len(only), stats.bytes / 1e6,
                     self.full_bytes / 1e6, 100 * stats.bytes / max(self.full_bytes, 1))
        self.full = True
        return replace(stats, full_bytes=self.full_bytes)
