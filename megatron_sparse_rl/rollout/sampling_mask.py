"""Keep-sampling-mask record (DeepSeek-V3.2, arXiv 2512.02556): for every sampled token, the token ids the
sampler could have drawn (what survived top-k / top-p and any -inf logit processor), so the learner can
renormalise pi_theta and pi_old over the same support as the sampler's mu.

`SamplingSupport` is the record one RolloutBatch carries (`batch.features.sampling_mask`); `SamplingMaskCapture`
records it inside a RolloutEngine's in-process vLLM worker: a forward pre-hook on the model notes, per
engine step, which request owns which rows and at which position each row's next token will be sampled,
and a wrapper around the runner's `Sampler.sample` reads the support of every row from vLLM's processed
logprobs (finite = kept; rollout.logprobs_mode must be "processed"). After `generate`, each response token
gets the support recorded at its position, checked against the token the engine returned; a gap or a
mismatch raises naming the sequence and position.

    engine = RolloutEngine(model_dir, cfg, extensions=[SamplingMaskCapture()])  # rollout.record_sampling_mask
    batch = engine.generate(prompts, sampling)     # batch.features.sampling_mask: SamplingSupport
    learner.forward_logprobs(tokens, extras=ForwardExtras(sampling_support=batch.features.sampling_mask))

Across the turns of an episode (`turn_fields`, rollout/multi_turn.py) each row's record is a one-row SamplingSupport
over the episode's first prompt: the earlier turns' record, then count 0 (no sampler: the full vocabulary) for the
environment's tokens since, then this turn's sampled tokens. The sampler only runs on new tokens, so prefix caching
changes nothing here.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_sparse_rl import vllm_access
from megatron_sparse_rl.rollout.step_capture import StepCapture


class SamplingMaskError(RuntimeError):
    """The sampling-support record is missing or disagrees with the sampled tokens."""


@dataclass(frozen=True)
class SamplingSupport:
    """Per row of a RolloutBatch, the sampler's support at every response token.

    prompt_lens: int64 [B]; response token j of row i is scored at learner column prompt_lens[i] - 1 + j.
    counts:      per row int32 [R_i]: kept ids at response token j; 0 = no truncation (the full vocabulary).
    ids:         per row int32 [sum(counts)]: the kept ids, token after token, ascending within a token.
    """

    prompt_lens: torch.Tensor
    counts: tuple[torch.Tensor, ...]
    ids: tuple[torch.Tensor, ...]

    def __post_init__(self):
        if not (len(self.prompt_lens) == len(self.counts) == len(self.ids)):
            raise ValueError(f"SamplingSupport rows disagree: prompt_lens {len(self.prompt_lens)}, counts "
                             f"{len(self.counts)}, ids {len(self.ids)}")
        for i, (c, ids) in enumerate(zip(self.counts, self.ids)):
            if int(c.sum()) != len(ids):
                raise ValueError(f"SamplingSupport row {i}: counts sum to {int(c.sum())} but {len(ids)} ids are stored")

    def __len__(self) -> int:
        return len(self.counts)

    @property
    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() + i.numel() * i.element_size() for c, i in zip(self.counts, self.ids))

    @staticmethod
    def concat(parts: list["SamplingSupport"]) -> "SamplingSupport":
        """The rows of `parts` in order."""
        return SamplingSupport(prompt_lens=torch.cat([p.prompt_lens for p in parts]),
                               counts=sum((p.counts for p in parts), ()), ids=sum((p.ids for p in parts), ()))

    def select(self, index) -> "SamplingSupport":
        idx = torch.as_tensor(index, dtype=torch.long).tolist()
        return SamplingSupport(prompt_lens=self.prompt_lens[idx], counts=tuple(self.counts[i] for i in idx),
                               ids=tuple(self.ids[i] for i in idx))

    def local_mask(self, rows, length: int, vocab_start: int, vocab_end: int) -> torch.Tensor:
        """bool [len(rows), length, vocab_end - vocab_start]: True where the learner may put probability mass at
        each column of rows `rows` (a learner micro-batch), for the vocabulary slice [vocab_start, vocab_end) a
        tensor-parallel rank holds. Columns without a record (prompt, padding, untruncated tokens) allow all."""
        rows = torch.as_tensor(rows, dtype=torch.long).tolist()
        mask = torch.ones(len(rows), length, vocab_end - vocab_start, dtype=torch.bool)
        for k, r in enumerate(rows):
            counts, ids = self.counts[r], self.ids[r].long()
            truncated = torch.nonzero(counts > 0).squeeze(1)
            if len(truncated) == 0:
                continue
            first = int(self.prompt_lens[r]) - 1
            if first + len(counts) > length:
                raise ValueError(f"sampling support row {r}: {len(counts)} response tokens after a {first + 1}-token "
                                 f"prompt do not fit {length} learner columns")
            mask[k, first + truncated] = False
            token = torch.repeat_interleave(torch.arange(len(counts)), counts.long())
            here = (ids >= vocab_start) & (ids < vocab_end)
            mask[k, first + token[here], ids[here] - vocab_start] = True
        return mask


class SamplingMaskCapture(StepCapture):
    """Sampling-support capture bound to one RolloutEngine's in-process worker (see module docstring)."""

    provides = "sampling_mask"
    field = "sampling_mask"
    features = ("step", "sampling_mask")
    error = SamplingMaskError
    follows_turns = True

    def __init__(self):
        super().__init__()
        self._sampler = None
        # self._seen: internal request id -> position -> (sampled token id, int32 kept ids or None for the full
        # vocabulary)

    # ---- worker side (runs in the engine's process) -------------------------------------------------
    def _install_hooks(self, runner) -> None:
        sampler, logprobs_mode = vllm_access.sampler(runner)
        if sampler is None:
            raise SamplingMaskError("sampling-mask capture: the engine's model runner has no vLLM Sampler")
        if logprobs_mode != "processed_logprobs":
            raise SamplingMaskError(f"sampling-mask capture needs processed logprobs (rollout.logprobs_mode="
                                    f"processed); the engine's sampler uses {logprobs_mode!r}")
        self._sampler = sampler
        vllm_access.wrap_sample(sampler, self._on_sample)

    def _remove_hooks(self) -> None:
        if self._sampler is not None:
            vllm_access.unwrap_sample(self._sampler)
            self._sampler = None

    def _on_step(self, step: vllm_access.StepContext) -> None:
        # each request's next token is sampled at (its last scheduled position) + 1
        last = torch.tensor(step.starts[1:]) - 1
        self._step = dict(req_ids=step.req_ids, next_pos=[int(p) + 1 for p in step.positions[last].cpu()])

    def _on_sample(self, sampled: torch.Tensor, processed: torch.Tensor | None) -> None:
        if not self.active:
            return
        step, self._step = self._step, None
        if step is None:
            raise SamplingMaskError("sampling-mask capture: the sampler ran without a model forward before it")
        if processed is None:
            raise SamplingMaskError("sampling-mask capture: vLLM returned no processed logprobs for a sampling step")
        finite = torch.isfinite(processed[:len(step["req_ids"])]).cpu()
        tokens = sampled.reshape(-1).cpu().tolist()
        full = finite.shape[1]
        counts = finite.sum(dim=1).tolist()
        for r, (req, pos) in enumerate(zip(step["req_ids"], step["next_pos"])):
            kept = None if counts[r] == full else torch.nonzero(finite[r]).squeeze(1).to(torch.int32)
            self._seen[req][pos] = (int(tokens[r]), kept)

    # ---- driver side -------------------------------------------------------------------------------
    def collect(self, outputs, prompts: list[list[int]]) -> SamplingSupport:
        """Stop capturing; the support at every response token of vLLM's `outputs`, in RolloutBatch order."""
        self.active = False
        by_key = self._by_sample()
        prompt_lens, counts, ids = [], [], []
        for out, prompt in zip(outputs, prompts):
            for c in sorted(out.outputs, key=lambda c: c.index):
                row = len(counts)
                req = by_key.get((out.request_id, c.index))
                if req is None and len(c.token_ids):
                    raise SamplingMaskError(f"sequence {row}: no sampling support captured (request "
                                            f"{out.request_id}, sample {c.index})")
                n, kept = self._sequence_support(row, len(prompt), list(c.token_ids), self._seen.get(req, {}))
                prompt_lens.append(len(prompt))
                counts.append(n)
                ids.append(kept)
        self._seen.clear()
        return SamplingSupport(prompt_lens=torch.tensor(prompt_lens, dtype=torch.long), counts=tuple(counts),
                               ids=tuple(ids))

    def turn_fields(self, outputs, prompts: list[list[int]], earlier: list[dict]) -> list[dict]:
        """Stop capturing; per row (one sample per prompt) {"sampling_mask": one-row SamplingSupport of the
        episode's response so far}, continuing the row's earlier record (module docstring)."""
        this = self.collect(outputs, prompts)
        fields = []
        for row, before in enumerate(earlier):
            old = before.get(self.field)
            if old is None:
                fields.append({self.field: this.select([row])})
                continue
            first, done = int(old.prompt_lens[0]), len(old.counts[0])
            gap = len(prompts[row]) - first - done  # the environment's tokens since the last turn
            if gap < 0:
                raise SamplingMaskError(f"sequence {row}: the earlier turn's support covers {done} response tokens "
                                        f"after a {first}-token prompt, more than this turn's {len(prompts[row])}-"
                                        "token prompt holds")
            counts = torch.cat([old.counts[0], torch.zeros(gap, dtype=torch.int32), this.counts[row]])
            fields.append({self.field: SamplingSupport(prompt_lens=old.prompt_lens.clone(), counts=(counts,),
                                                       ids=(torch.cat([old.ids[0], this.ids[row]]),))})
        return fields

    @staticmethod
    def _sequence_support(row: int, prompt_len: int, response: list[int], seen: dict):
        counts, kept_ids = [], []
        for j, tok in enumerate(response):
            pos = prompt_len + j
            if pos not in seen:
                raise SamplingMaskError(f"sequence {row}: no sampling support recorded at position {pos}")
            sampled, kept = seen[pos]
            if sampled != tok:
                raise SamplingMaskError(f"sequence {row}: position {pos} was sampled as token {sampled}, the "
                                        f"response has {tok}")
            if kept is None:
                counts.append(0)
                continue
            if not bool((kept == tok).any()):
                raise SamplingMaskError(f"sequence {row}: the token {tok} sampled at position {pos} is outside its "
                                        f"recorded support ({len(kept)} ids)")
            counts.append(len(kept))
            kept_ids.append(kept)
        ids = torch.cat(kept_ids) if kept_ids else torch.zeros(0, dtype=torch.int32)
        return torch.tensor(counts, dtype=torch.int32), ids
