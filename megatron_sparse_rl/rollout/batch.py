"""`RolloutBatch`: the typed record one rollout step hands to reward, learner and corrections.

Rows are samples (n per prompt, consecutive, sharing a group id). Sequences are stored right-padded:
prompt ids [B, P] with `prompt_lens`, response ids [B, R] with a boolean `response_mask`, and the
sampler's `rollout_logprobs` [B, R] (0 where masked). Reward, learner and corrections read these names.
`sequences()` gives the concatenated prompt + response form a learner forward takes.
"""
from __future__ import annotations

from dataclasses import MISSING, Field, dataclass, field, fields, replace
from enum import Enum
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # the records' own modules, named here for their types only
    from megatron_sparse_rl.moe.storage import RouteStore
    from megatron_sparse_rl.rollout.indexer_capture import EngineIndexerRows
    from megatron_sparse_rl.rollout.sampling_mask import SamplingSupport


def pad_rows(rows: list[list[int]] | list[list[float]], pad: float, dtype: torch.dtype) -> torch.Tensor:
    """Right-pad ragged rows into a [len(rows), max_len] tensor (max_len >= 1 keeps shapes 2-D)."""
    width = max([len(r) for r in rows] + [1])
    out = torch.full((len(rows), width), pad, dtype=dtype)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=dtype)
    return out


class Join(Enum):
    """How `RolloutBatch.concat` (and `FeatureRecords.concat`) joins one field of several batches. Every field names
    its kind (`_joined`), so a new field cannot be left out of the concat. An optional field is None in all parts or
    set in all."""

    ROWS = "rows"
    """[B, ...] tensors concatenated along the rows; a tuple of B entries (or other sequence) concatenated."""
    PROMPT = "prompt"
    """[B, P] right-padded after `prompt_lens`: each row cut to its length and re-padded to the longest."""
    RESPONSE = "response"
    """[B, ..., R] right-padded after the response lengths (last axis): re-padded to the longest response."""
    OWN = "own"
    """An object with its own `concat(parts)` and `select(index)` (RouteStore, SamplingSupport: packed per sequence;
    FeatureRecords)."""
    SUMMED = "summed"
    """A dict describing the sampling call, not rows: summed key by key; None if any part lacks it."""


def _joined(how: Join, *, default: Any = MISSING, default_factory: Any = MISSING, pad_id: bool = False):
    """A `RolloutBatch` (or `FeatureRecords`) field joined as `how`; `pad_id`: re-padded with the pad token (else zero
    or False)."""
    return field(default=default, default_factory=default_factory, metadata={"join": how, "pad_id": pad_id})


@dataclass(kw_only=True, frozen=True, slots=True)
class FeatureRecords:
    """What the engine's extensions (rollout/extension.py) record of each row, for the features that ride on it; each
    record None when its feature is off. `RolloutBatch.features` holds one; the keys an extension's `batch_fields`
    and `turn_fields` return are these field names."""

    sampling_mask: SamplingSupport | None = _joined(Join.OWN, default=None)
    """The sampler's support (ids kept by top-k/top-p) at every response token (keep-sampling-mask)."""
    routed_experts: RouteStore | None = _joined(Join.OWN, default=None)
    """The engine's routes (R3): uint8/uint16 [tokens, layers, topk] packed per sequence."""
    indexer_record: EngineIndexerRows | None = _joined(Join.OWN, default=None)
    """The engine's DSA indexer choices (routing.indexer_replay = R3): per row [n - 1, DSA layers, index_topk]
    positions."""
    kv_keep: tuple[Any, ...] | None = _joined(Join.ROWS, default=None)
    """The sparse-KV keep decisions: one kv/record.py `KVKeepRecord` per row (typed Any: kv/ sits above rollout/, so
    this module does not import it, not even for type checking)."""

    def select(self, index: torch.Tensor) -> "FeatureRecords":
        """The records of the rows in `index` (int64)."""
        return FeatureRecords(**{f.name: _selected(self, f, index) for f in fields(self)})

    @classmethod
    def concat(cls, parts: list["FeatureRecords"]) -> "FeatureRecords":
        """The records of `parts`' rows in order, each joined as its `Join` says."""
        return cls(**_joined_fields(cls, parts, {}, pad_id=0))


@dataclass(kw_only=True, frozen=True, slots=True)
class RolloutBatch:
    """B samples of a rollout step (B = prompts x n). Padded on the right. Frozen: a later stage (rewards, engine
    re-scorings, the KV pool's use) returns a new batch with `dataclasses.replace` (`with_features` for a feature
    record), never writes into this one.

    prompt_ids:       int64 [B, P], pad id after `prompt_lens[i]` tokens.
    prompt_lens:      int64 [B].
    response_ids:     int64 [B, R], pad id where `response_mask` is false.
    response_mask:    bool [B, R], true on generated tokens (EOS included when generated).
    rollout_logprobs: float32 [B, R], logprob of each sampled token under the engine's sampling
                      distribution (see RolloutConfig.logprobs_mode); 0 where masked.
    finish_reasons:   per sample "stop" (EOS or stop string), "length" (max_tokens) or "abort".
    group_ids:        int64 [B]: samples of the same prompt share one id.
    reward:           float32 [B], the reward stage's (a batch `replace`d with it; None until then).
    features:         the engine extensions' records (`FeatureRecords`: sampling_mask, routed_experts, indexer_record,
                      kv_keep), each None when its feature is off.
    rescored_logprobs: float32 [B, n, R], n engine re-scorings of each sampled sequence (prompt logprobs of
                      prompt + response, dense attention; for algorithm.old_logprobs = engine_mean), 0 where
                      masked; or None.
    token_version:    int64 [B, R], the weight version that sampled each response token (RolloutEngine.weight_version;
                      two versions in one row when the weights changed while it ran, asynchronous RL); or None.
    loss_mask:        bool [B, R] or None. Multi-turn episodes (rollout/multi_turn.py): true on the model's own tokens,
                      false on the environment's tokens (tool results, chat markup) that sit in the response between
                      turns; the loss, the corrections and the mismatch metrics read only the tokens it marks
                      (training/learner_batch.py `LearnerBatch`). None: every response token is the model's.
    episode_stats:    sums over the batch's episodes (counts and token totals, per turn too; rollout/multi_turn.py
                      `EPISODE_KEYS`), not per row; None for single-turn rollouts.
    kv_usage:         vLLM's KV block pool while this batch was sampled (not per row): peak_blocks (most blocks
                      in use after any step), pool_blocks (usable blocks), mean_running (requests running per
                      step), preemptions; summed over the engines that sampled it; None when the engine core is
                      not in this process.
    """

    prompt_ids: torch.Tensor = _joined(Join.PROMPT, pad_id=True)
    prompt_lens: torch.Tensor = _joined(Join.ROWS)
    response_ids: torch.Tensor = _joined(Join.RESPONSE, pad_id=True)
    response_mask: torch.Tensor = _joined(Join.RESPONSE)
    rollout_logprobs: torch.Tensor = _joined(Join.RESPONSE)
    finish_reasons: tuple[str, ...] = _joined(Join.ROWS)
    group_ids: torch.Tensor = _joined(Join.ROWS)
    reward: torch.Tensor | None = _joined(Join.ROWS, default=None)
    features: FeatureRecords = _joined(Join.OWN, default_factory=FeatureRecords)
    rescored_logprobs: torch.Tensor | None = _joined(Join.RESPONSE, default=None)
    token_version: torch.Tensor | None = _joined(Join.RESPONSE, default=None)
    kv_usage: dict[str, float] | None = _joined(Join.SUMMED, default=None)
    loss_mask: torch.Tensor | None = _joined(Join.RESPONSE, default=None)
    episode_stats: dict[str, float] | None = _joined(Join.SUMMED, default=None)

    def __post_init__(self) -> None:
        b = self.prompt_ids.shape[0]
        checks = {
            "prompt_lens": (self.prompt_lens.shape, (b,)),
            "response_mask": (self.response_mask.shape, self.response_ids.shape),
            "rollout_logprobs": (self.rollout_logprobs.shape, self.response_ids.shape),
            "group_ids": (self.group_ids.shape, (b,)),
        }
        for name, (got, want) in checks.items():
            if tuple(got) != tuple(want):
                raise ValueError(f"RolloutBatch.{name} must have shape {tuple(want)} (got {tuple(got)})")
        if self.token_version is not None and tuple(self.token_version.shape) != tuple(self.response_ids.shape):
            raise ValueError(f"RolloutBatch.token_version must have shape {tuple(self.response_ids.shape)} "
                             f"(got {tuple(self.token_version.shape)})")
        r = self.rescored_logprobs
        if r is not None and (r.dim() != 3 or r.shape[0] != b or r.shape[2] != self.response_ids.shape[1]):
            raise ValueError(f"RolloutBatch.rescored_logprobs must have shape ({b}, n, "
                             f"{self.response_ids.shape[1]}) (got {tuple(r.shape)})")
        if self.response_ids.shape[0] != b or len(self.finish_reasons) != b:
            raise ValueError(f"RolloutBatch rows disagree: prompt_ids {b}, response_ids "
                             f"{self.response_ids.shape[0]}, finish_reasons {len(self.finish_reasons)}")
        lm = self.loss_mask
        if lm is not None and (tuple(lm.shape) != tuple(self.response_ids.shape) or lm.dtype != torch.bool
                               or bool((lm & ~self.response_mask).any())):
            raise ValueError(f"RolloutBatch.loss_mask must be bool of shape {tuple(self.response_ids.shape)} and true "
                             f"only on response tokens (got {lm.dtype} {tuple(lm.shape)})")
        if self.response_mask.dtype != torch.bool:
            raise ValueError(f"RolloutBatch.response_mask must be bool (got {self.response_mask.dtype})")

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def response_lens(self) -> torch.Tensor:
        """int64 [B]: generated tokens per sample."""
        return self.response_mask.sum(dim=1)

    def responses(self) -> list[list[int]]:
        """Response token ids per sample, unpadded."""
        return [row[m].tolist() for row, m in zip(self.response_ids, self.response_mask)]

    def prompts(self) -> list[list[int]]:
        """Prompt token ids per sample, unpadded."""
        return [row[:n].tolist() for row, n in zip(self.prompt_ids, self.prompt_lens.tolist())]

    def sequences(self, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Prompt + response concatenated, right-padded, for a learner forward.

        Returns (tokens int64 [B, T], attention_mask bool [B, T], response_positions bool [B, T]) where
        response_positions marks the tokens whose logprob the learner scores (the response tokens).
        """
        prompts, responses = self.prompts(), self.responses()
        seqs = [p + r for p, r in zip(prompts, responses)]
        tokens = pad_rows(seqs, pad_id, torch.long)
        lens = torch.tensor([len(s) for s in seqs])
        pos = torch.arange(tokens.shape[1])[None, :]
        attention_mask = pos < lens[:, None]
        response_positions = attention_mask & (pos >= self.prompt_lens[:, None])
        return tokens, attention_mask, response_positions

    def select(self, index: torch.Tensor | list[int]) -> "RolloutBatch":
        """A new batch with the rows in `index` (tensors indexed, tuples/lists picked)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        return RolloutBatch(**{f.name: _selected(self, f, idx) for f in fields(self)})

    def with_features(self, **records: Any) -> "RolloutBatch":
        """A new batch whose `features` has `records` (FeatureRecords field names) in place of its own."""
        return replace(self, features=replace(self.features, **records))

    @classmethod
    def concat(cls, parts: list["RolloutBatch"], pad_id: int) -> "RolloutBatch":
        """The rows of `parts` in order, one batch: each field joined as its `Join` says (ragged fields re-padded to
        the widest part, token ids with `pad_id`). One part is returned as it is."""
        if len(parts) == 1:
            return parts[0]
        lens = {Join.PROMPT: [p.prompt_lens for p in parts], Join.RESPONSE: [p.response_lens for p in parts]}
        return cls(**_joined_fields(cls, parts, lens, pad_id))


def _selected(record: Any, f: Field, idx: torch.Tensor) -> Any:
    """Field `f` of `record` (a RolloutBatch or FeatureRecords) at the rows `idx`."""
    v = getattr(record, f.name)
    if v is None or f.metadata["join"] is Join.SUMMED:  # SUMMED describes the sampling call, not rows
        return v
    if f.metadata["join"] is Join.OWN:
        return v.select(idx)  # RouteStore / EngineIndexerRows / SamplingSupport / FeatureRecords: per sequence
    if isinstance(v, torch.Tensor):
        return v[idx]
    if isinstance(v, tuple):
        return tuple(v[i] for i in idx.tolist())
    raise NotImplementedError(f"{type(record).__name__}.select cannot subset field {f.name!r} yet")


def _joined_fields(cls: type, parts: list, lens: dict[Join, list[torch.Tensor]], pad_id: int) -> dict[str, Any]:
    """Each field of `cls` (a RolloutBatch or FeatureRecords) over `parts`, joined as its `Join` says; `lens`: the
    rows' lengths per ragged kind (PROMPT, RESPONSE)."""
    values = {}
    for f in fields(cls):
        how, got = f.metadata.get("join"), [getattr(p, f.name) for p in parts]
        if how is None:
            raise NotImplementedError(f"{cls.__name__}.{f.name} names no Join: say how concat joins it")
        if how is Join.SUMMED:
            values[f.name] = None if any(v is None for v in got) else {k: sum(v[k] for v in got) for k in got[0]}
        elif all(v is None for v in got):
            values[f.name] = None
        elif any(v is None for v in got):
            raise ValueError(f"{cls.__name__}.concat: some parts carry {f.name} and some do not")
        elif how is Join.OWN:
            values[f.name] = type(got[0]).concat(got)
        elif how is Join.ROWS:
            values[f.name] = torch.cat(got) if isinstance(got[0], torch.Tensor) else sum((tuple(v) for v in got), ())
        else:
            values[f.name] = _repad(got, lens[how], pad_id if f.metadata["pad_id"] else 0)
    return values


def _repad(parts: list[torch.Tensor], lens: list[torch.Tensor], pad: int) -> torch.Tensor:
    """Tensors [b_i, ..., W_i] whose row r holds lens_i[r] entries on the last axis, as one [sum b_i, ..., W] tensor:
    W the longest row (at least 1), `pad` after each row's entries."""
    width = max([int(n.max()) for n in lens if n.numel()] + [1])
    out = []
    for t, n in zip(parts, lens):
        wide = torch.full((*t.shape[:-1], width), pad, dtype=t.dtype)
        w = min(width, t.shape[-1])
        wide[..., :w] = t[..., :w]
        keep = (torch.arange(width)[None, :] < n[:, None]).view(n.shape[0], *[1] * (t.dim() - 2), width)
        out.append(wide.masked_fill(~keep, pad))
    return torch.cat(out)
