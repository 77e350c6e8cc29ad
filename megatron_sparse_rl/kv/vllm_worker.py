"""Worker side of the sparse-KV integration (vLLM 0.32.0 V1 model runner, used by the CPU runner too).

`SparseKVWorkerState` is owned by one model runner (`vllm_access.runner_state`, created by the runner
patch in megatron_sparse_rl.kv.vllm_hooks on the first step); it reaches the runner only through
`vllm_access.RunnerKV` and the accessor's layer functions. Per step:
- `before_update_states` (before vLLM's `_update_states`, which zeroes newly allocated blocks that may
  be the tail blocks just freed): for each compaction command, score the cached keys with the policy,
  copy the kept tokens' K/V to the front slots of the request's blocks (per layer, per KV head), cut
  the request's block list to what the scheduler kept and rewrite its block-table row; record the kept
  true positions;
- `after_prepare_inputs`: subtract dropped[req] from seq_lens (attention length = kept + new) and map
  new tokens to slot (pos - dropped); positions stay the true ones (RoPE);
- `capture` (wraps each attention impl's forward): keeps the recent queries (after RoPE) per request
  and layer for the score policies.
The per-(block, head, slot) K/V location is discovered at start-up by writing a known pattern through
the backend's own `do_kv_cache_update` into a scratch cache (the CPU vec ISA stores K transposed); kv/slots.py
reads and moves the entries of a layout that stores each one as an aligned run of head_dim elements as whole rows,
other layouts (that transposed K) element by element.

Multi-head latent attention (DeepSeek-V3 / Kimi-K2, vLLM's MLA backends): the cache holds one latent row
[c_kv, k_pe] per token and layer, shared by every head. The worker treats it as ONE KV head whose key is the
row and which has no separate V (the row is copied as a whole); the captured queries are absorbed into the
latent space with the layer's W_UK_T (kv/latent.py) and scored at the layer's softmax scale, so each layer keeps
one set of rows, recorded as kv_keep [layers, 1, kept]. Single-rank engines only (a TP rank holds the shared rows
but only its own heads' queries).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from megatron_sparse_rl import vllm_access
from megatron_sparse_rl.kv import latent
from megatron_sparse_rl.kv import policies as P
from megatron_sparse_rl.kv.query_window import QueryWindows, WritePlan
from megatron_sparse_rl.kv.record import KVKeepRecord
from megatron_sparse_rl.kv.settings import SparseKVSettings
from megatron_sparse_rl.kv.slots import SlotIndex

logger = logging.getLogger(__name__)


def discover_slot_layout(layer, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_index, v_index), int64 [kv_heads, block_size, head_dim] each: where, in one block of `kv_cache`
    flattened, the backend stores element d of head h's K (V) of the token in block slot s.

    Writes codes through the backend's own KV writer (`vllm_access.write_kv`) into a 2-block scratch cache, in passes of base-64
    digits (exact in bf16/fp16/fp32), and checks every element lands exactly once inside block 0.
    """
    _require_contiguous(kv_cache)
    nb, heads, bs, two_d = kv_cache.shape
    d = two_d // 2
    scratch = torch.zeros((2, heads, bs, two_d), dtype=kv_cache.dtype, device=kv_cache.device)
    slots = torch.arange(bs, dtype=torch.int64, device=kv_cache.device)

    def write(digit: torch.Tensor) -> None:  # digit [bs, H, D] token-major
        vllm_access.write_kv(layer, digit.to(kv_cache.dtype), (-digit).to(kv_cache.dtype), scratch, slots)

    return _locate(scratch, (heads, bs, d), write, values=True)


def discover_latent_layout(layer, kv_cache: torch.Tensor) -> torch.Tensor:
    """int64 [1, block_size, kv_lora_rank + rope]: where, in one block of a multi-head latent attention cache
    flattened, the backend stores element d of the latent row of the token in block slot s (one row per token,
    shared by every head: a single "KV head" with no separate V). Discovered like `discover_slot_layout`, through
    the backend's own latent writer (`vllm_access.write_latent`)."""
    _require_contiguous(kv_cache)
    bs, width = kv_cache.shape[-2], kv_cache.shape[-1]
    if kv_cache[0].numel() != bs * width:
        raise RuntimeError(f"sparse KV: latent KV cache of shape {tuple(kv_cache.shape)} is not [blocks, (1,) "
                           "block_size, kv_lora_rank + rope]: layout unsupported")
    scratch = torch.zeros((2, *kv_cache.shape[1:]), dtype=kv_cache.dtype, device=kv_cache.device)
    slots = torch.arange(bs, dtype=torch.int64, device=kv_cache.device)

    def write(digit: torch.Tensor) -> None:  # digit [bs, 1, width]
        vllm_access.write_latent(layer, digit[:, 0].to(kv_cache.dtype), scratch, slots)

    return _locate(scratch, (1, bs, width), write, values=False)[0]


def _require_contiguous(kv_cache: torch.Tensor) -> None:
    if not kv_cache.is_contiguous():
        raise RuntimeError(f"sparse KV: KV cache of shape {tuple(kv_cache.shape)} is not contiguous: layout unsupported")


def _locate(scratch: torch.Tensor, shape: tuple[int, int, int], write, *, values: bool):
    """(k_index, v_index or None) [H, bs, D]: positions in block 0 of `scratch` that `write(digit [bs, H, D])`
    fills with +digit (K) and, with `values`, -digit (V); codes are written in passes of base-64 digits."""
    heads, bs, d = shape
    n = heads * bs * d
    device = scratch.device
    code = torch.arange(n, device=device).view(heads, bs, d).transpose(0, 1)  # [bs, H, D] token-major
    base, passes = 64, max(1, math.ceil(math.log(n, 64)))
    codes = [torch.zeros(n, dtype=torch.int64, device=device) for _ in range(1 + values)]
    found = None
    for p in range(passes):
        digit = (code // base**p) % base + 1
        scratch.zero_()
        write(digit)
        if scratch[1].abs().sum() != 0:
            raise RuntimeError("sparse KV layout discovery: slots 0..block_size-1 wrote outside block 0")
        flat = scratch[0].reshape(-1).double()
        pos = [(flat > 0).nonzero()[:, 0]] + ([(flat < 0).nonzero()[:, 0]] if values else [])
        if any(x.numel() != n for x in pos):
            raise RuntimeError(f"sparse KV layout discovery: {[x.numel() for x in pos]} K/V elements, expected {n}")
        if found is None:
            found = pos
        elif not all(torch.equal(a, b) for a, b in zip(pos, found)):
            raise RuntimeError("sparse KV layout discovery: K/V positions differ between passes")
        for acc, x, sign in zip(codes, pos, (1, -1)):
            acc += ((sign * flat[x]).round().long() - 1) * base**p
    out = []
    for acc, x in zip(codes, found):
        index = torch.full((n,), -1, dtype=torch.int64, device=device)
        index[acc] = x
        if (index < 0).any():
            raise RuntimeError("sparse KV layout discovery: some K/V elements were not found (codes collide)")
        out.append(index.view(heads, bs, d))
    return out[0], (out[1] if values else None)


def _kv_cache(layer) -> torch.Tensor:
    name, cache, _ = vllm_access.layer_kv(layer)
    if cache is None:
        raise RuntimeError(f"sparse KV: layer {name} has no KV cache tensor")
    return cache


TIMING = ("compactions", "compact_s", "score_s", "copy_s", "capture_s", "prepare_s")
"""What `SparseKVWorkerState.take_timing` reports: compactions run; seconds in them (`compact_s`), of which scoring
(gathering the keys and running the policy, `score_s`) and moving the kept K/V (`copy_s`), the rest being the
records and block-table rewrite; seconds capturing queries for the score policies (`capture_s`, every step);
seconds shifting each step's attention lengths and slots onto the compacted lengths (`prepare_s`, every step)."""


@dataclass
class _Request:
    """Per-request worker state (reset when vLLM resumes it after a preemption)."""

    dropped: int = 0
    kept_pos: torch.Tensor | None = None  # int64 [L, H, kept]: true positions of the front slots
    queries: list = field(default_factory=list)  # h2o: per layer, the chunks [Hq, n, D] captured since compaction
    query_index: list = field(default_factory=list)  # h2o: stored index of each captured query
    acc: list = field(default_factory=list)  # h2o: per layer [H, kept] carried accumulated attention


@dataclass
class _Step:
    req_ids: list
    qsl: np.ndarray  # [num_reqs + 1] query start offsets
    stored_start: np.ndarray  # [num_reqs] stored index of each request's first scheduled token
    plan: WritePlan | None = None  # R-KV / SnapKV: where this step's queries go (QueryWindows.plan, once per step)


class SparseKVWorkerState:
    """Sparse-KV state of one vLLM model runner (see the module docstring)."""

    def __init__(self, runner, settings: SparseKVSettings):
        vllm_access.check_instance(runner, ("sparse_kv",))
        self.runner, self.settings = vllm_access.RunnerKV(runner), settings
        groups = self.runner.groups
        if len(groups) != 1:
            raise RuntimeError(f"sparse KV supports one KV cache group (got {len(groups)})")
        self.block_size, names = groups[0]
        if self.runner.table_block_size != self.block_size:
            raise RuntimeError(f"sparse KV: kernel block size {self.runner.table_block_size} != KV manager block "
                               f"size {self.block_size} (hybrid block tables are not supported)")
        self.layers = self.runner.attention_layers(names)
        for layer in self.layers:
            _kv_cache(layer)
        # multi-head latent attention: one latent row per token = one "KV head" whose key is the row and which has
        # no separate V; the queries are absorbed into the latent space (kv/latent.py), scored at the layer's scale
        self.latent = vllm_access.is_latent_layer(self.layers[0])
        if self.latent:
            self._check_latent()
            self.dims = vllm_access.latent_dims(self.layers[0])
            layouts = (discover_latent_layout(self.layers[0], _kv_cache(self.layers[0])),)
            self.q_heads, self.scale = self.dims.heads, self.dims.scale
        else:
            layouts = discover_slot_layout(self.layers[0], _kv_cache(self.layers[0]))
            self.q_heads, self.scale = vllm_access.layer_kv(self.layers[0])[2], None  # None: 1 / sqrt(head_dim)
        block_len = _kv_cache(self.layers[0])[0].numel()
        # K and V (a latent cache: its rows alone); each moved as whole rows of head_dim where its layout allows
        self.slot_index = tuple(SlotIndex.of(layout, block_len) for layout in layouts)
        self.kv_heads, _, self.head_dim = layouts[0].shape
        self.reqs: dict[str, _Request] = {}
        self.records: dict[str, dict] = {}
        self.dropped: dict[str, int] = {}
        self.step: _Step | None = None
        self.timing = dict.fromkeys(TIMING, 0.0)
        # R-KV / SnapKV score with the last `window` queries: kept for all requests at once (H2O keeps every query)
        self.windows = QueryWindows(len(self.layers), settings.window) if settings.policy in ("rkv", "snapkv") \
            else None
        if settings.policy != "streamingllm":
            for li, layer in enumerate(self.layers):
                self._wrap_forward(li, layer)
        logger.info("sparse KV worker: policy=%s budget=%d interval=%d, %d layers, block size %d, K/V moved %s",
                    settings.policy, settings.budget, settings.interval, len(self.layers), self.block_size,
                    "/".join("by element" if i.row is None else "by row" for i in self.slot_index))

    def _check_latent(self) -> None:
        tp, _ = vllm_access.tensor_parallel_group()
        if tp > 1:  # each rank would score with its own heads only and keep a different set of the shared rows
            raise RuntimeError(f"sparse KV on the MLA latent cache runs on a single-rank engine (tensor parallel size "
                               f"{tp}): set rollout.tensor_parallel_size: 1 or rollout.kv.policy: none")
        if not all(vllm_access.is_latent_layer(layer) for layer in self.layers):
            raise RuntimeError("sparse KV: a model mixing latent and per-head attention layers is not supported")
        vllm_access.check(features=("sparse_kv_mla",))

    def _wrap_forward(self, li: int, layer) -> None:
        if self.latent:
            def on_latent(q, w_uk):
                if self.step is not None:
                    self.capture(li, q, w_uk)

            vllm_access.on_latent_query(layer, on_latent)
            return

        def on_query(query):
            if self.step is not None:
                self.capture(li, query)

        vllm_access.on_attention_query(layer, on_query)

    # ---- query capture ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _timed(self, key: str):
        """Add the block's seconds to `self.timing[key]`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timing[key] += time.perf_counter() - start

    def capture(self, li: int, query: torch.Tensor, w_uk: torch.Tensor | None = None) -> None:
        """Keep this step's queries of layer `li` per request: query [tokens, q_heads * head_dim] (per-head cache)
        or, on a latent cache, [tokens, heads, qk_nope + rope] with the layer's W_UK_T `w_uk` to absorb them."""
        with self._timed("capture_s"):
            self._capture(li, query, w_uk)

    def _capture(self, li: int, query: torch.Tensor, w_uk: torch.Tensor | None) -> None:
        st = self.step
        if self.windows is not None:  # one gather and one write for every request of the step
            if st.plan is None:
                st.plan = self.windows.plan(st.req_ids, st.qsl)
            if len(st.plan.token):
                index = st.plan.token.to(query.device)
                self.windows.write(li, st.plan, self._queries_at(query, index, w_uk))
            return
        for row, rid in enumerate(st.req_ids):  # H2O: every query, with its stored index
            a, b = int(st.qsl[row]), int(st.qsl[row + 1])
            if b <= a:
                continue
            r = self.reqs.setdefault(rid, _Request())
            while len(r.queries) <= li:
                r.queries.append([])
            r.queries[li].append(self._queries(query, a, b, w_uk))
            if li == 0:
                r.query_index.append(torch.arange(b - a) + int(st.stored_start[row]))

    def _queries_at(self, query: torch.Tensor, index: torch.Tensor, w_uk: torch.Tensor | None) -> torch.Tensor:
        """float32 [len(index), Hq, D]: the queries of the step's token rows `index` as the policies score them."""
        if not self.latent:
            return query[index].view(len(index), self.q_heads, self.head_dim).to(torch.float32)
        q = query[index].to(torch.float32).transpose(0, 1)  # [heads, n, qk_nope + rope]
        nope = self.dims.qk_nope
        return latent.absorb_queries(q[..., :nope], q[..., nope:], w_uk.to(torch.float32)).transpose(0, 1)

    def _queries(self, query: torch.Tensor, a: int, b: int, w_uk: torch.Tensor | None) -> torch.Tensor:
        """float32 [Hq, n, D]: the queries of tokens a..b-1 (H2O keeps every one)."""
        return self._queries_at(query, torch.arange(a, b, device=query.device), w_uk).transpose(0, 1)

    # ---- compaction -----------------------------------------------------------------------------------
    def _knobs(self, budget: int) -> SparseKVSettings:
        """The policy's knobs at `budget`, the budget the scheduler's command carries (it moves between generate
        calls under rollout.kv.budget_schedule; the engine's settings hold the starting one)."""
        if budget == self.settings.budget:
            return self.settings
        sched = dataclasses.replace(self.settings.budget_schedule, enabled=False)
        return dataclasses.replace(self.settings, budget=budget, budget_schedule=sched)

    def _keep(self, li: int, rids: list[str], flat: torch.Tensor, blocks: torch.Tensor,
              stored: int, knobs: SparseKVSettings) -> torch.Tensor:
        """int64 [R, H, knobs.budget]: the stored indices each request keeps. The score policies score the R requests
        (same stored length) as one batch of R x H KV heads (each head's scores are its own); H2O carries
        per-request sums, so it runs request by request."""
        n, budget = len(rids), knobs.budget
        if knobs.policy == "streamingllm":
            return P.streamingllm_keep(self.kv_heads, stored, knobs, blocks.device).expand(n, -1, -1)
        slots = torch.arange(stored, device=blocks.device).expand(n, self.kv_heads, stored)
        keys = self.slot_index[0].read(flat, blocks, slots)  # [R, H, stored, D]
        if knobs.policy == "h2o":
            return torch.stack([self._h2o_keep(li, self.reqs[rid], keys[i], knobs) for i, rid in enumerate(rids)])
        queries = torch.cat([self.windows.get(li, rid)[:, -knobs.window:] for rid in rids])  # [R x Hq, W, D]
        keep = P.select_keep(knobs.policy, keys.reshape(n * self.kv_heads, stored, -1), queries, knobs,
                             scale=self.scale)
        return keep.view(n, self.kv_heads, budget)

    def _h2o_keep(self, li: int, r: _Request, keys: torch.Tensor, knobs: SparseKVSettings) -> torch.Tensor:
        queries = torch.cat(r.queries[li], dim=1)
        prev = r.acc[li] if li < len(r.acc) else None
        acc = P.h2o_scores(keys, queries, torch.cat(r.query_index), previous=prev, scale=self.scale)
        keep = P.select_keep("h2o", keys, None, knobs, h2o_acc=acc)
        while len(r.acc) <= li:
            r.acc.append(None)
        r.acc[li] = acc.gather(1, keep)
        return keep

    def _compact(self, rids: list[str], stored: int, budget: int) -> None:
        """Compact requests `rids`, each holding `stored` tokens, to `budget`: per layer one scoring of them all
        and one gather + scatter of their kept K/V (to the front slots), then each one's records and block table."""
        tables = [self.runner.block_ids(rid) for rid in rids]
        for rid, block_ids in zip(rids, tables):
            if len(block_ids) != -(-stored // self.block_size):
                raise RuntimeError(f"sparse KV: worker holds {len(block_ids)} blocks for {stored} stored tokens of "
                                   f"{rid}")
        reqs = [self.reqs.setdefault(rid, _Request()) for rid in rids]
        blocks = torch.tensor(tables, dtype=torch.int64, device=self.slot_index[0].element.device)
        dst = torch.arange(budget, device=blocks.device).expand(len(rids), self.kv_heads, budget)
        kept_pos = [[] for _ in rids]
        knobs = self._knobs(budget)
        for li, layer in enumerate(self.layers):
            cache = _kv_cache(layer)
            flat = cache.view(cache.shape[0], -1)
            with self._timed("score_s"):
                keep = self._keep(li, rids, flat, blocks, stored, knobs)  # [R, H, budget] stored indices
            with self._timed("copy_s"):
                for index in self.slot_index:
                    index.copy(flat, blocks, keep, dst)
            for i, r in enumerate(reqs):
                kept_pos[i].append(torch.where(keep[i] < (0 if r.kept_pos is None else r.kept_pos.shape[2]),
                                               self._old_pos(r, li, keep[i]), keep[i] + r.dropped))
        for rid, r, block_ids, pos in zip(rids, reqs, tables, kept_pos):
            rec = self.records.setdefault(rid, {"lengths": [], "kept": [], "preempted": False})
            rec["lengths"].append(stored + r.dropped)
            r.kept_pos = torch.stack(pos).cpu()
            if self.settings.record_keep:
                rec["kept"].append(r.kept_pos.to(torch.int32))
            r.dropped += stored - budget
            if self.settings.policy == "h2o":
                r.queries, r.query_index = [[] for _ in self.layers], []
            del block_ids[-(-budget // self.block_size):]
            self.runner.set_table_row(rid, block_ids)

    def take_timing(self) -> dict[str, float]:
        """The worker's sparse-KV time since the last call (`TIMING`), then reset."""
        out, self.timing = self.timing, dict.fromkeys(TIMING, 0.0)
        return out

    @staticmethod
    def _old_pos(r: _Request, li: int, keep: torch.Tensor) -> torch.Tensor:
        if r.kept_pos is None:
            return keep
        old = r.kept_pos[li].to(keep.device)
        return old.gather(1, keep.clamp(max=old.shape[1] - 1))

    # ---- vLLM hooks ------------------------------------------------------------------------------------
    def before_update_states(self, scheduler_output) -> None:
        msg = vllm_access.rider(scheduler_output)
        if msg is None:
            raise RuntimeError("sparse KV: the SchedulerOutput carries no sparse-KV message (scheduler_cls not "
                               "SparseKVScheduler?)")
        _, finished, resumed = vllm_access.step_requests(scheduler_output)
        for rid in finished:
            self.reqs.pop(rid, None)
            if self.windows is not None:
                self.windows.release(rid)
        for rid in resumed:
            if self.windows is not None:
                self.windows.release(rid)
            old = self.reqs.pop(rid, None)
            if old is not None and old.dropped and rid in self.records:
                self.records[rid]["preempted"] = True
        due: dict[tuple[int, int], list[str]] = {}  # requests due at this step, by (stored, budget): one batch each
        for rid, (stored, budget) in msg["compact"].items():
            due.setdefault((stored, budget), []).append(rid)
        for (stored, budget), rids in due.items():
            with self._timed("compact_s"):
                self._compact(rids, stored, budget)
            self.timing["compactions"] += len(rids)
        self.dropped = msg["dropped"]
        for rid, d in self.dropped.items():
            if self.reqs[rid].dropped != d:
                raise RuntimeError(f"sparse KV: worker dropped {self.reqs[rid].dropped} != scheduler {d} for {rid}")

    def after_prepare_inputs(self, num_scheduled_tokens: np.ndarray) -> None:
        with self._timed("prepare_s"):
            self._shift_compacted(num_scheduled_tokens)

    def _shift_compacted(self, num_scheduled_tokens: np.ndarray) -> None:
        """Attention lengths and slots of this step's tokens on the compacted lengths, all requests at once."""
        req_ids, computed = self.runner.batch()
        n = len(req_ids)
        qsl = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(num_scheduled_tokens[:n], out=qsl[1:])
        dropped = np.array([self.dropped.get(r, 0) for r in req_ids], dtype=np.int64)
        start = computed.astype(np.int64)
        self.step = _Step(req_ids, qsl, start - dropped)
        if not dropped.any():
            return
        rows = np.nonzero(dropped)[0]
        self.runner.shorten_seq_lens(torch.from_numpy(rows), torch.from_numpy(dropped[rows]))
        table_np, slot_mapping = self.runner.slot_tables()
        counts = qsl[rows + 1] - qsl[rows]
        row_of = np.repeat(rows, counts)  # the batch row of every scheduled token of a compacted request
        offset = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        pos = start[row_of] - dropped[row_of] + offset  # stored index = true position - dropped
        slots = table_np[row_of, pos // self.block_size].astype(np.int64) * self.block_size + pos % self.block_size
        tokens = torch.from_numpy(qsl[row_of] + offset)
        slot_mapping[tokens.to(slot_mapping.device)] = torch.from_numpy(slots).to(slot_mapping.device,
                                                                                  slot_mapping.dtype)

    def end_step(self) -> None:
        self.step = None

    def take_records(self, samples) -> dict[tuple[str, int], KVKeepRecord]:
        """Pop the records of `samples`, (output request id, sample index) each, as vLLM's outputs name them
        (the records are kept under vLLM's internal ids); samples without a compaction get an empty record."""
        internal = {vllm_access.request_key(k): k for k in self.records}
        out = {}
        for key in samples:
            rid = internal.get(tuple(key))
            rec = (self.records.pop(rid, None) if rid is not None else None) or \
                {"lengths": [], "kept": [], "preempted": False}
            out[key] = KVKeepRecord(lengths=tuple(rec["lengths"]),
                                    kept=tuple(rec["kept"]) if self.settings.record_keep else None,
                                    preempted=rec["preempted"])
        return out
