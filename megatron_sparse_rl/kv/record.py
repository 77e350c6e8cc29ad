"""`KVKeepRecord`: what the sparse KV cache kept for one sample, and the attention mask that replays it.

One record per sample (`RolloutBatch.features.kv_keep` is a tuple of them, one per row). At compaction c the
engine had stored the KV of true positions 0..lengths[c]-1 (prompt + response so far) minus what earlier
compactions dropped, and kept `kept[c][layer, kv_head]` (ascending TRUE token positions, original RoPE
positions). The query of position t >= lengths[c] (and before the next compaction or turn end) attends to
kept[c] plus the positions lengths[c]..t. `kept` is None when `rollout.kv.record_keep` is false (only the
steps are kept). `preempted`: the request was preempted after a compaction and recomputed densely by vLLM, so
its response mixes two caches; drop or correct such samples.

A multi-turn episode (rollout/multi_turn.py) is one record merged turn by turn (`next_turn`): each turn is one
vLLM request whose prompt is the whole episode so far, prefilled densely, compacted during its decode. Its
compactions are at true positions of the whole sequence already. `turn_ends[k]` is the sequence length after
model turn k: the queries from position turn_ends[k] - 1 on (turn k's last sampled token, the environment's
tokens, the next prompt) were computed by the next turn's dense prefill, so they attend causally to every
earlier position, as do the next turn's decode queries until its first compaction. A single-turn record has no
`turn_ends`. `preempted` is true when any turn was.

One forward cannot replay a whole episode: a position of turn k has two histories in the engine, the sparse one
of turn k's own decode (which scored its token) and the dense one of the next turn's prefill (whose KV the later
turns attended). So the replay is one forward per compacted turn, `attention_mask(seq_len, turn=k)` with only
turn k's compactions (exact for turn k's compressed queries and every query before turn k's first compaction),
plus a causal forward for the dense queries after the last one (`replay_plan`, `batch_replays`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVKeepRecord:
    lengths: tuple[int, ...]
    kept: tuple[torch.Tensor, ...] | None = None
    preempted: bool = False
    turn_ends: tuple[int, ...] = ()

    def __post_init__(self):
        starts = [s for s, _ in self._events()]
        if any(b <= a for a, b in zip(starts, starts[1:])):
            raise ValueError(f"KVKeepRecord: compactions {self.lengths} and turn ends {self.turn_ends} overlap: "
                             "every compaction must fall strictly inside one turn's decode")
        if self.kept is not None and len(self.kept) != len(self.lengths):
            raise ValueError(f"KVKeepRecord: {len(self.kept)} kept sets for {len(self.lengths)} compactions")

    @property
    def num_compactions(self) -> int:
        return len(self.lengths)

    def _events(self) -> list[tuple[int, int | None]]:
        """(first query position, compaction index or None for a turn's dense prefill), by position."""
        events = [(n, c) for c, n in enumerate(self.lengths)] + [(e - 1, None) for e in self.turn_ends]
        return sorted(events, key=lambda ev: (ev[0], ev[1] is not None))

    @staticmethod
    def join_heads(parts: "list[KVKeepRecord]") -> "KVKeepRecord":
        """One sample's record from the records of the ranks of a tensor-parallel engine, each holding its
        own KV heads (rank order = head order): the kept positions concatenated over the head dimension.
        The ranks compact at the same steps (each runs the same deterministic scheduler): a disagreement
        raises."""
        first = parts[0]
        if any(p.lengths != first.lengths or p.turn_ends != first.turn_ends for p in parts):
            raise RuntimeError(f"engine ranks compacted at different steps: {[p.lengths for p in parts]}")
        kept = None
        if first.kept is not None:
            kept = tuple(torch.cat([p.kept[c] for p in parts], dim=1) for c in range(first.num_compactions))
        return KVKeepRecord(first.lengths, kept, any(p.preempted for p in parts), first.turn_ends)

    def next_turn(self, turn: "KVKeepRecord", prompt_len: int, end: int) -> "KVKeepRecord":
        """This episode record (the turns so far; `KVKeepRecord(lengths=())` before the first) followed by
        `turn`, the record of one turn's request: its prompt the first `prompt_len` tokens of the episode, its
        sampled tokens up to length `end`. Raises ValueError naming the problem when the turn does not follow
        this record (its prompt shorter than what the record covers), sampled nothing, or compacted outside its
        own decode queries (positions prompt_len .. end - 2), or when the kept sets disagree in presence or shape."""
        covered = self.turn_ends[-1] if self.turn_ends else 0
        if prompt_len < max(covered, 1):
            raise ValueError(f"KVKeepRecord.next_turn: the turn's prompt ({prompt_len} tokens) overlaps the "
                             f"episode record, which covers {covered} tokens already")
        if end <= prompt_len:
            raise ValueError(f"KVKeepRecord.next_turn: end = {end} must exceed prompt_len = {prompt_len} "
                             "(a turn samples at least one token)")
        outside = [n for n in turn.lengths if not prompt_len <= n <= end - 2]
        if outside or turn.turn_ends:
            raise ValueError(f"KVKeepRecord.next_turn: the turn's compactions {turn.lengths} do not lie within its "
                             f"decode queries {prompt_len}..{end - 2} (turn_ends {turn.turn_ends} must be empty)")
        kept = _joined_kept(self, turn)
        for c, n in enumerate(turn.lengths):
            if kept is not None and turn.kept[c].numel() and int(turn.kept[c].max()) >= n:
                raise ValueError(f"KVKeepRecord.next_turn: the turn's compaction at {n} keeps position "
                                 f"{int(turn.kept[c].max())}, which it had not computed")
        return KVKeepRecord(self.lengths + turn.lengths, kept, self.preempted or turn.preempted,
                            self.turn_ends + (end,))

    def compaction_turns(self) -> tuple[int, ...]:
        """The model turn (0-based) each compaction happened in (all 0 in a single-turn record)."""
        return tuple(sum(n >= e - 1 for e in self.turn_ends) for n in self.lengths)

    def compressed_queries(self, seq_len: int, turn: int | None = None) -> torch.Tensor:
        """bool [seq_len]: which query positions attended a compacted cache (of model turn `turn` only, if given)."""
        out = torch.zeros(seq_len, dtype=torch.bool)
        events, turns = self._events(), self.compaction_turns()
        for (start, c), nxt in zip(events, events[1:] + [(seq_len, None)]):
            if c is not None and (turn is None or turns[c] == turn):
                out[min(start, seq_len):min(nxt[0], seq_len)] = True
        return out

    def replay_plan(self, seq_len: int) -> list[tuple[int | None, torch.Tensor]]:
        """The forwards that reproduce the engine's logprobs at the query positions 0..seq_len-1: (model turn whose
        compactions the forward's mask replays, None for a causal forward; bool [seq_len] the queries it scores
        exactly), in turn order, every query in exactly one. A query no compaction touched is exact in a forward
        whose turn compacts only after it, else in a causal forward (after an earlier turn's compaction)."""
        compressed = self.compressed_queries(seq_len)
        todo, plan = torch.ones(seq_len, dtype=torch.bool), []
        for turn in dict.fromkeys(self.compaction_turns()):
            first = self.lengths[self.compaction_turns().index(turn)]
            cols = self.compressed_queries(seq_len, turn) | (~compressed & (torch.arange(seq_len) < first))
            plan.append((turn, cols & todo))
            todo &= ~cols
        if todo.any():
            plan.append((None, todo))
        return plan

    def attention_mask(self, seq_len: int, turn: int | None = None) -> torch.Tensor:
        """bool [layers, kv_heads, seq_len, seq_len]: may query position t attend to key position s.

        Causal and dense before the first compaction and from each turn end's dense prefill on (until that turn's
        next compaction); after a compaction per layer and KV head what the engine kept. `turn`: replay only that
        model turn's compactions (an episode's record needs it when more than one turn compacted: module
        docstring). Needs the full record (`record_keep`); a learner recomputes pi_sparse with it.
        """
        if self.kept is None:
            raise ValueError("KVKeepRecord.attention_mask needs the kept positions (set rollout.kv.record_keep)")
        turns = self.compaction_turns()
        if turn is None and len(set(turns)) > 1:
            raise ValueError(f"KVKeepRecord.attention_mask: model turns {sorted(set(turns))} compacted; one forward "
                             "cannot replay them all, pass turn= (replay_plan)")
        if not self.kept or (turn is not None and turn not in turns):
            where = "" if turn is None else f" in turn {turn}"
            raise ValueError(f"KVKeepRecord.attention_mask: no compaction happened{where} (use a causal mask)")
        layers, heads, _ = self.kept[0].shape
        pos = torch.arange(seq_len)
        mask = (pos[None, :] <= pos[:, None]).expand(layers, heads, seq_len, seq_len).clone()
        events = self._events()
        for (start, c), (nxt, _) in zip(events, events[1:] + [(seq_len, None)]):
            end = min(nxt, seq_len)
            if start >= seq_len:
                break
            if c is None or (turn is not None and turns[c] != turn):
                continue  # a turn's dense prefill, or another turn's compaction: causal, as built
            rows = torch.zeros(layers, heads, seq_len, dtype=torch.bool)
            rows.scatter_(2, self.kept[c].long(), True)
            block = rows[:, :, None, :].expand(layers, heads, end - start, seq_len).clone()
            block |= (pos[None, :] >= start) & (pos[None, :] <= pos[start:end, None])
            mask[:, :, start:end] = block
        return mask


def _joined_kept(record: KVKeepRecord, turn: KVKeepRecord) -> tuple[torch.Tensor, ...] | None:
    """The kept sets of `record` then `turn`; both recorded or neither (a side without compactions takes the
    other's), of one [layers, kv_heads] shape."""
    if not turn.lengths:
        return record.kept
    if not record.lengths:
        return turn.kept
    if (record.kept is None) != (turn.kept is None):
        raise ValueError("KVKeepRecord.next_turn: one turn recorded the kept positions and another did not "
                         "(rollout.kv.record_keep must hold for the whole episode)")
    if record.kept is None:
        return None
    shapes = {tuple(k.shape[:2]) for k in record.kept + turn.kept}
    if len(shapes) > 1:
        raise ValueError(f"KVKeepRecord.next_turn: the kept sets' [layers, kv_heads] differ between turns: "
                         f"{sorted(shapes)}")
    return record.kept + turn.kept


def batch_attention_mask(records, seq_len: int) -> torch.Tensor | None:
    """bool [B, layers, kv_heads, seq_len, seq_len] for a batch of single-forward records (rows without a
    compaction see causally), or None when no row was compacted (the dense causal forward is already exact).
    Episodes whose turns compacted more than once: `batch_replays`."""
    compacted = [r for r in records if r.num_compactions]
    if not compacted:
        return None
    if compacted[0].kept is None:
        raise ValueError("recomputing sparse logprobs needs the kept positions (set rollout.kv.record_keep)")
    layers, heads, _ = compacted[0].kept[0].shape
    pos = torch.arange(seq_len)
    causal = (pos[None, :] <= pos[:, None]).expand(layers, heads, seq_len, seq_len)
    return torch.stack([r.attention_mask(seq_len) if r.num_compactions else causal for r in records])


def batch_replays(records, seq_len: int) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
    """The learner forwards that recompute pi_sparse of a batch: (attention mask bool [B, layers, kv_heads, seq_len,
    seq_len], None for a causal forward; bool [B, seq_len] the columns it scores exactly). Forward j replays each
    row's j-th `replay_plan` entry (rows without one: causal, no columns); [] when no row was compacted. A
    single-turn batch needs one forward, an episode batch one per compacted turn (+ a causal one)."""
    compacted = [r for r in records if r.num_compactions]
    if not compacted:
        return []
    if compacted[0].kept is None:
        raise ValueError("recomputing sparse logprobs needs the kept positions (set rollout.kv.record_keep)")
    layers, heads, _ = compacted[0].kept[0].shape
    pos = torch.arange(seq_len)
    causal = (pos[None, :] <= pos[:, None]).expand(layers, heads, seq_len, seq_len)
    plans = [r.replay_plan(seq_len) if r.num_compactions else [(None, torch.ones(seq_len, dtype=torch.bool))]
             for r in records]
    out = []
    for j in range(max(map(len, plans))):
        steps = [plan[j] if j < len(plan) else (None, torch.zeros(seq_len, dtype=torch.bool)) for plan in plans]
        columns = torch.stack([cols for _, cols in steps])
        if all(turn is None for turn, _ in steps):
            out.append((None, columns))
            continue
        out.append((torch.stack([causal if turn is None else r.attention_mask(seq_len, turn)
                                 for r, (turn, _) in zip(records, steps)]), columns))
    return out
