"""Sparse-KV policies (kv/policies.py, kv/latent.py) and the worker's compaction on one device. The cuda variant ran
on one H100 80GB HBM3 (torch 2.11+cu130, 2026-11-27; 13 s for both tests): every keep set equal to CPU's (0
mismatched entries); 32 layers x 32768 tokens to 4096: SnapKV 77.8 ms (53.1 scoring, 24.5 copying), StreamingLLM
25.1 ms; the copy ran at 44 GB/s. Those figures are of the per-element copy (an int64 index per element; a plain
1 GiB copy there runs at ~3 TB/s); the copy now moves whole rows of D (kv/slots.py) and awaits a GPU measurement.

- keep sets: R-KV, SnapKV, H2O (its accumulated scores included) and StreamingLLM on fp32 keys [8 KV heads, 2048,
  128] and queries [32 heads, ., 128], and the same four on the MLA latent cache (kv/latent.py: rows [2048, 512 +
  64], 16 heads), computed on the device and on CPU tensors in the same rank from the same seeded inputs. The keep
  sets must be equal, except where the GPU's other reduction order reorders near-ties: an entry in one set and not
  the other is allowed only when its CPU score lies within REL_TOL x the head's max |score| of the head's cutoff
  (the lowest CPU score still kept). The count of such entries is recorded (`<case>_mismatched_entries`);
  StreamingLLM is positional and must match exactly.
- compaction: a cache of `layers` x [blocks, 8 KV heads, block_size 16, K | V of D=128] in bf16 (the cuda variant:
  32 layers x 32768 tokens, 4.3 GB, budget 4096; the cpu variant: 2 layers x 2048 tokens, budget 512, to stay
  quick), one request whose block table is a shuffled list of blocks. Per layer, as `SparseKVWorkerState._keep`
  and `_compact` (kv/vllm_worker.py) do: gather the keys, score them with the layer's recent window queries, select,
  then move the kept K and V to the front slots with one gather + scatter each. The keys are read and the K and V
  moved by the worker's own `SlotIndex` (kv/slots.py, `SlotIndex.of` the layout as the worker builds it: this
  layout's entries are aligned rows of D, so the row path), called as `_compact` calls it (which itself needs a
  vLLM runner). The first (checked) run asserts that each layer's front `budget` slots of every head hold exactly
  the original entries at the keep indices (ascending), in order, and that the other slots are untouched; the timed
  runs after it record, per policy, `compaction_ms` (all layers, median, synchronised), `per_layer_ms`,
  `score_select_ms` (gathering the keys and running the policy; StreamingLLM gathers nothing, as in the worker) and
  `copy_ms` (CUDA events between the phases; the copy includes building its int64 row indices, as in the worker) and
  `copy_GBps` (K and V of the kept entries read and written, over `copy_ms`). Speed is not asserted.
  KVConfig's default policy is "none" (dense, nothing to compact), so the timed policies are SnapKV (scores from
  the window) and StreamingLLM (no scoring: the copy alone), with KVConfig's default window (8), pooling and
  kernel. R-KV is not timed at 32k tokens: its redundancy term builds [heads, T, T] matrices (an fp32 similarity
  and an int64 index: 96 GiB per layer at 8 x 32768^2), more than the GPU holds; the worker runs it at
  T = budget + interval.

    .venv/bin/python -m pytest -q tests/gpu/test_cuda_sparse_kv.py                           # cuda (needs CUDA)
    MSRL_GPU_TESTS_ON_CPU=1 .venv/bin/python -m pytest -q tests/gpu/test_cuda_sparse_kv.py   # the cpu variant
"""
import math
import statistics
import time

import torch

from tests.gpu.devices import run_on

T, KV_HEADS, Q_HEADS, D = 2048, 8, 32, 128
LATENT_HEADS, NOPE, RANK, ROPE = 16, 128, 512, 64
KEEP_BUDGET, H2O_QUERIES = 512, 64
REL_TOL = 1e-5
"""Near-tie rule: a keep-set difference is allowed where the CPU score is within REL_TOL x max |score| of the cutoff."""

COMPACTION = {"cuda": {"layers": 32, "tokens": 32768, "budget": 4096, "repeats": 5},
              "cpu": {"layers": 2, "tokens": 2048, "budget": 512, "repeats": 3}}
BLOCK_SIZE = 16
TIMED_POLICIES = ("snapkv", "streamingllm")


# ---- keep sets ------------------------------------------------------------------------------------------------
def _inputs(seed: int) -> dict:
    """fp32 CPU tensors of one per-head layer and one MLA layer. Keys 1000..1063 are near-copies of keys 0..63
    (cosine ~0.9 > rkv_threshold) so that R-KV's redundancy term has work to do."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(KV_HEADS, T, D, generator=g)
    keys[:, 1000:1064] = keys[:, :64] + 0.5 * torch.randn(KV_HEADS, 64, D, generator=g)
    latent = torch.randn(T, RANK, generator=g)
    latent[1000:1064] = latent[:64] + 0.5 * torch.randn(64, RANK, generator=g)
    return {"keys": keys, "queries": torch.randn(Q_HEADS, H2O_QUERIES, D, generator=g),
            "h2o_prev": 5 * torch.rand(KV_HEADS, T - 100, generator=g),
            "latent": latent, "k_pe": torch.randn(T, ROPE, generator=g),
            "q_nope": torch.randn(LATENT_HEADS, H2O_QUERIES, NOPE, generator=g),
            "q_pe": torch.randn(LATENT_HEADS, H2O_QUERIES, ROPE, generator=g),
            "w_uk": torch.randn(LATENT_HEADS, NOPE, RANK, generator=g) / math.sqrt(RANK),
            "latent_prev": 5 * torch.rand(T - 100, generator=g),
            "query_index": torch.arange(T - H2O_QUERIES, T)}


def _cases(x: dict, p) -> dict:
    """{case: (keep int64 [heads, budget], candidate scores [heads, T - window] or None)} on x's device."""
    from megatron_sparse_rl.kv import latent as L
    from megatron_sparse_rl.kv import policies as P

    w, scale = p.window, 1.0 / math.sqrt(NOPE + ROPE)
    keys, q = x["keys"], x["queries"][:, -w:]
    acc = P.h2o_scores(keys, x["queries"], x["query_index"], x["h2o_prev"])
    rows = L.latent_rows(x["latent"], x["k_pe"])[None]
    absorbed = L.absorb_queries(x["q_nope"][:, -w:], x["q_pe"][:, -w:], x["w_uk"])
    lat = dict(q_nope=x["q_nope"], q_pe=x["q_pe"], w_uk=x["w_uk"], scale=scale)
    lat_acc = L.latent_h2o_scores(x["q_nope"], x["q_pe"], x["w_uk"], x["latent"], x["k_pe"], scale,
                                  x["query_index"], x["latent_prev"])
    return {
        "rkv": (P.select_keep("rkv", keys, q, p), P.rkv_scores(keys, q, p)),
        "snapkv": (P.select_keep("snapkv", keys, q, p), P.snapkv_scores(keys, q, p)),
        "h2o": (P.select_keep("h2o", keys, None, p, h2o_acc=acc), acc[:, : T - w]),
        "streamingllm": (P.select_keep("streamingllm", keys, None, p), None),
        "latent_rkv": (L.select_latent("rkv", x["latent"], x["k_pe"], p, **lat)[None],
                       P.rkv_scores(rows, absorbed, p, scale=scale)),
        "latent_snapkv": (L.select_latent("snapkv", x["latent"], x["k_pe"], p, **lat)[None],
                          P.snapkv_scores(rows, absorbed, p, scale=scale)),
        "latent_h2o": (L.select_latent("h2o", x["latent"], x["k_pe"], p, h2o_acc=lat_acc)[None],
                       lat_acc[None, : T - w]),
        "latent_streamingllm": (L.select_latent("streamingllm", x["latent"], x["k_pe"], p)[None], None),
    }


def _differences(cpu_keep: torch.Tensor, dev_keep: torch.Tensor, scores: torch.Tensor | None, top: int):
    """(mismatched, unexplained): entries kept by the CPU and not by the device, summed over heads, and the entries
    of either difference that the near-tie rule does not explain (no scores: every one; a recent-window entry: every
    one; else CPU score further than REL_TOL x max |score| from the head's cutoff, its `top`-th highest score)."""
    mismatched = unexplained = 0
    for h in range(cpu_keep.shape[0]):
        a, b = set(cpu_keep[h].tolist()), set(dev_keep[h].tolist())
        mismatched += len(a - b)
        diff = sorted(a ^ b)
        if not diff:
            continue
        if scores is None or diff[-1] >= scores.shape[1]:
            unexplained += len(diff)
            continue
        cut = scores[h].topk(top).values[-1]
        gap = (scores[h, diff].double() - float(cut)).abs()
        unexplained += int((gap > REL_TOL * float(scores[h].abs().max())).sum())
    return mismatched, unexplained


def keep_worker(rank, world, device):
    """{case: {device, dtype, shape, ascending, cpu_shape, mismatched, unexplained}}: each case's keep set on
    `device` against the same computation on CPU tensors."""
    from megatron_sparse_rl.config.rollout import KVConfig

    p = KVConfig(budget=KEEP_BUDGET)
    x = _inputs(seed=0)
    cpu = _cases(x, p)
    dev = _cases({k: v.to(device) for k, v in x.items()}, p)
    out = {}
    for name, (dev_keep, _) in dev.items():
        cpu_keep, scores = cpu[name]
        mismatched, unexplained = _differences(cpu_keep, dev_keep.cpu(), scores, p.budget - p.window)
        out[name] = {"device": dev_keep.device.type, "dtype": str(dev_keep.dtype), "shape": tuple(dev_keep.shape),
                     "cpu_shape": tuple(cpu_keep.shape), "ascending": bool((dev_keep.diff(dim=-1) > 0).all()),
                     "mismatched": mismatched, "unexplained": unexplained}
    return out


def test_keep_sets_match_cpu(device, figure):
    got = run_on(device, keep_worker, (device,))
    assert len(got) == 8, got
    for name, r in got.items():
        figure(f"{name}_mismatched_entries", r["mismatched"], "entries")
        assert r["device"] == device, (name, r)
        heads = 1 if name.startswith("latent") else KV_HEADS
        assert r["dtype"] == "torch.int64" and r["shape"] == r["cpu_shape"] == (heads, KEEP_BUDGET), (name, r)
        assert r["ascending"], (name, r)
        assert r["unexplained"] == 0, f"{name}: keep set on {device} differs from CPU beyond near-ties: {r}"
    assert got["streamingllm"]["mismatched"] == got["latent_streamingllm"]["mismatched"] == 0, got


# ---- compaction -----------------------------------------------------------------------------------------------
class _Clock:
    """Phase marks in stream order: CUDA events on cuda (no host sync between marks), perf_counter on cpu."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        self.marks = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def ms(self, i: int) -> float:
        """Milliseconds between mark i and mark i + 1 (after a synchronise)."""
        a, b = self.marks[i], self.marks[i + 1]
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


def _token_view(flat: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """[heads, T, 2D]: one layer's K | V rows in stored-token order, read through the block table with plain views
    (independent of the worker's element indices)."""
    nb = blocks.shape[1]
    return flat[blocks[0]].view(nb, KV_HEADS, BLOCK_SIZE, 2 * D).transpose(0, 1).reshape(KV_HEADS, -1, 2 * D)


def _check_layer(before: torch.Tensor, after: torch.Tensor, keep: torch.Tensor, what: str) -> None:
    """Raise unless `after` [H, T, 2D] holds `before`'s rows at `keep` [H, budget] in its front slots, in order, and
    `before`'s rows everywhere else."""
    budget = keep.shape[1]
    want = before.gather(1, keep[:, :, None].expand(-1, -1, before.shape[2]))
    if not (torch.equal(after[:, :budget], want) and torch.equal(after[:, budget:], before[:, budget:])):
        raise AssertionError(f"{what}: the compacted slots are not the kept entries (or other slots changed)")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def compaction_worker(rank, world, device, layers, tokens, budget, repeats):
    """{policy: {checked_layers, compaction_ms [runs], score_select_ms [runs], copy_ms [runs]}} for TIMED_POLICIES."""
    from megatron_sparse_rl.config.rollout import KVConfig
    from megatron_sparse_rl.kv import policies as P
    from megatron_sparse_rl.kv.slots import SlotIndex

    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)
    nb = tokens // BLOCK_SIZE
    cache = torch.empty((layers, nb, KV_HEADS * BLOCK_SIZE * 2 * D), dtype=torch.bfloat16, device=dev)
    cache.normal_(generator=g)
    blocks = torch.randperm(nb, generator=g, device=dev)[None]  # [1 request, nb]: a shuffled block table
    element = torch.arange(KV_HEADS * BLOCK_SIZE * 2 * D, device=dev).view(KV_HEADS, BLOCK_SIZE, 2 * D)
    k_index, v_index = (SlotIndex.of(e.contiguous(), element.numel()) for e in (element[..., :D], element[..., D:]))
    assert k_index.row is not None and v_index.row is not None  # [H, block slot] rows of D in a block
    queries = torch.randn(layers, Q_HEADS, 8, D, generator=g, device=dev)
    slots = torch.arange(tokens, device=dev).expand(1, KV_HEADS, tokens)
    dst = torch.arange(budget, device=dev).expand(1, KV_HEADS, budget)
    out = {}
    for policy in TIMED_POLICIES:
        p = KVConfig(policy=policy, budget=budget)
        runs = {"checked_layers": 0, "compaction_ms": [], "score_select_ms": [], "copy_ms": []}
        for run in range(1 + repeats):
            clock = _Clock(device)
            _sync(device)
            t0 = time.perf_counter()
            for li in range(layers):
                flat = cache[li]
                before = _token_view(flat, blocks).clone() if run == 0 else None
                clock.mark()
                if policy == "streamingllm":  # as SparseKVWorkerState._keep: positional, no keys gathered
                    keep = P.streamingllm_keep(KV_HEADS, tokens, p, dev)[None]  # [1, H, budget]
                else:
                    keys = k_index.read(flat, blocks, slots)[0]  # [H, T, D]
                    keep = P.select_keep(policy, keys, queries[li, :, -p.window:], p)[None]
                clock.mark()
                for index in (k_index, v_index):  # SparseKVWorkerState._compact's copy
                    index.copy(flat, blocks, keep, dst)
                clock.mark()
                if before is not None:
                    _check_layer(before, _token_view(flat, blocks), keep[0], f"{policy} layer {li}")
                    runs["checked_layers"] += 1
            _sync(device)
            if run > 0:
                runs["compaction_ms"].append((time.perf_counter() - t0) * 1e3)
                runs["score_select_ms"].append(sum(clock.ms(3 * li) for li in range(layers)))
                runs["copy_ms"].append(sum(clock.ms(3 * li + 1) for li in range(layers)))
        out[policy] = runs
    return out


def test_compaction(device, figure):
    shape = COMPACTION[device]
    layers, tokens, budget = shape["layers"], shape["tokens"], shape["budget"]
    got = run_on(device, compaction_worker, (device, layers, tokens, budget, shape["repeats"]))
    copied_gb = 2 * 2 * layers * KV_HEADS * budget * D * 2 / 1e9  # K and V, read + write, bf16
    figure("cache_GB", layers * tokens * KV_HEADS * 2 * D * 2 / 1e9, "GB")
    for policy, r in got.items():
        assert r["checked_layers"] == layers, (policy, r)
        ms = {k: statistics.median(r[k]) for k in ("compaction_ms", "score_select_ms", "copy_ms")}
        for name, value in ms.items():
            figure(f"{policy}_{name}", value, "ms")
        figure(f"{policy}_per_layer_ms", ms["compaction_ms"] / layers, "ms")
        figure(f"{policy}_copy_GBps", copied_gb / (ms["copy_ms"] / 1e3), "GB/s")
