"""Weight-sync throughput: bytes/s learner -> engine over the bytes/s of a plain tensor copy of the same bytes
(every weight tensor `copy_`-ed into a preallocated buffer of the same shape), colocated and disaggregated.

    msrl bench sync [--mode both --hidden 512 --layers 14 --experts 16 --moe-ffn 256 --bucket-mb 64 --repeats 3]
    .venv/bin/python benchmarks/sync.py [same options]
    msrl bench sync --hidden 128 --layers 2 --experts 4 --moe-ffn 128 --repeats 1   # a small, quick run

The default model is a random Qwen3-MoE of about 99M parameters (~397 MB fp32), built locally in a temporary
directory; the exact parameter count and bytes are printed. Real Megatron learner, real vLLM engine, on CPU,
gloo, TP1, every rank with one thread (megatron_sparse_rl/parallel/spawn.py).

- colocated: one rank holds learner and engine; `sync_to_engine` (HF-name export, bucket packing, XXH3-128
  checksums and verification, vLLM's in-place reload with the CPU MoE repack).
- disaggregated: 2 ranks, learner on rank 0, engine on rank 1 (`ParallelLayout(rollout_ranks=1)`), rank 0
  `send_weights` -> rank 1 `receive_weights` over the weight-sync bridge (checksums on). A sync's time is the
  later of the two ranks' (both start after a barrier). Also printed: the gloo transport's own bandwidth, a
  plain broadcast over the same two-member bridge (one send) of the same bytes from rank 0 to rank 1 in
  messages of the bucket size, timed until rank 1 acknowledges.

Each mode prints one line with its ratio(s), then the time of each phase of its best sync (`SyncStats.phases`:
export, pack, digest, transport, verify, rebuild, load; seconds and fraction of the sync; every sync runs its two
ends in two threads per rank (weight_sync/pipeline.py), so they may add up to more than the sync), the logprob probe's
time (run after the syncs, not part of them), and the routed experts' export + load time per expert and layer
(run with `--experts 16` and `--experts 64` to see that it does not grow with the expert count). Every number
is the best of `--repeats`, and each ratio is taken from numbers measured in the same processes in one run. The engine's prompt logprobs of a probe are
compared with the learner's before and after the syncs (|dlogprob|; after must be <= LOGPROB_TOL).
"""
from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

from megatron_sparse_rl.config.checks import positive

PROBE = [list(range(1, 17))]
LOGPROB_TOL = 1e-2
"""Engine vs learner on the probe after the syncs. Loose: at ~100M parameters (14 layers, fp32) Megatron and vLLM
already differ by ~2e-4 before any sync (both printed); the checksums verify the bytes, this catches a wrong
tensor. The 1e-4 parity of the tiny models is tests/e2e/test_weight_sync.py's."""
_DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2}
SRC, ENGINE_RANK = 0, 1  # disaggregated: the learner rank that sends, the rank that owns the engine



def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=["colocated", "disaggregated", "both"], default="both")
    p.add_argument("--hidden", type=positive(int), default=512)
    p.add_argument("--layers", type=positive(int), default=14)
    p.add_argument("--experts", type=positive(int), default=16)
    p.add_argument("--topk", type=positive(int), default=2)
    p.add_argument("--moe-ffn", type=positive(int), default=256, help="intermediate size of each expert")
    p.add_argument("--heads", type=positive(int), default=8)
    p.add_argument("--kv-heads", type=positive(int), default=4)
    p.add_argument("--head-dim", type=positive(int), default=64, help="one vLLM's CPU attention supports")
    p.add_argument("--bucket-mb", type=positive(float), default=64.0)
    p.add_argument("--repeats", type=positive(int), default=3)
    p.add_argument("--timeout", type=positive(float), default=1800.0, help="seconds per mode before giving up")


def plain_copy_bytes_per_s(tensors, repeats: int) -> float:
    import torch

    dst = [torch.empty_like(t) for t in tensors]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for d, t in zip(dst, tensors):
            d.copy_(t)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def _learner_copy_bps(learner, repeats: int) -> float:
    """Plain-copy bandwidth of the learner's HF tensors (cloned out of the stream, freed after)."""
    from megatron_sparse_rl.weight_sync import iter_hf_tensors

    return plain_copy_bytes_per_s([t.clone() for _, t in iter_hf_tensors(learner)], repeats)


def repack_bytes_per_s(learner, repeats: int) -> tuple[float, int] | None:
    """(bytes/s, bytes) of vLLM's CPU linear-kernel repack (the oneDNN handle every linear layer's weight is packed
    into after a load, `dispatch_cpu_unquantized_gemm`) over the learner's 2-D non-expert projection weights, best
    of `repeats`; None where vLLM has no oneDNN path (not a CPU build). A colocated sync into a CPU engine pays it
    on every such byte: the handle holds a packed copy, so the weight cannot be copied in place."""
    from vllm import _custom_ops as ops

    from megatron_sparse_rl.weight_sync import iter_hf_tensors

    if not (getattr(ops, "_supports_onednn", False) and hasattr(ops, "create_onednn_mm")):
        return None
    weights = [t.clone() for name, t in iter_hf_tensors(learner)
               if t.dim() == 2 and name.endswith("proj.weight") and ".experts." not in name]
    nbytes = sum(t.numel() * t.element_size() for t in weights)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for w in weights:
            ops.create_onednn_mm(w.t(), 32)
        best = min(best, time.perf_counter() - start)
    return nbytes / best, nbytes


def _engine(model_dir):
    from megatron_sparse_rl.config.rollout import RolloutConfig
    from megatron_sparse_rl.patches import vllm_cpu
    from megatron_sparse_rl.rollout import RolloutEngine

    vllm_cpu.apply()
    return RolloutEngine(model_dir, RolloutConfig(max_model_len=256, max_num_seqs=4, kv_cache_gb=1))


def _learner(layout, groups, model_dir):
    """A TP1 fp32 learner loaded from `model_dir`."""
    from megatron_sparse_rl.config.schema import LearnerConfig, ModelConfig
    from megatron_sparse_rl.learner.learner import Learner
    from megatron_sparse_rl.models import load_spec

    adapter, spec = load_spec(model_dir)
    learner = Learner(adapter, spec, layout, groups, model_cfg=ModelConfig(path=str(model_dir)), cfg=LearnerConfig())
    learner.load_hf(model_dir)
    return learner


def _layout(model_dir, world_size: int, rollout_ranks: int):
    """Every rank: (layout, Megatron groups or None on a rollout rank)."""
    from megatron_sparse_rl.config.schema import ParallelConfig
    from megatron_sparse_rl.models import load_spec
    from megatron_sparse_rl.parallel import ParallelLayout
    from megatron_sparse_rl.patches import megatron_cpu

    megatron_cpu.apply()
    layout = ParallelLayout.from_config(ParallelConfig(), world_size - rollout_ranks, rollout_ranks=rollout_ranks)
    layout.check_model(load_spec(model_dir)[1])
    return layout, layout.initialize()


def colocated_worker(rank, world_size, model_dir, bucket_mb, repeats):
    from megatron_sparse_rl.weight_sync import sync_to_engine, verify_logprobs

    layout, groups = _layout(model_dir, world_size, 0)
    learner = _learner(layout, groups, model_dir)
    engine = _engine(model_dir)
    before = verify_logprobs(learner, engine, PROBE, tol=float("inf"))
    syncs = [sync_to_engine(learner, engine, bucket_mb=bucket_mb) for _ in range(repeats)]
    start = time.perf_counter()
    diff = verify_logprobs(learner, engine, PROBE, tol=LOGPROB_TOL)
    probe_s = time.perf_counter() - start
    copy_bps = _learner_copy_bps(learner, repeats)
    repack = repack_bytes_per_s(learner, repeats)
    engine.shutdown()
    return {"seconds": [s.seconds for s in syncs], "stats": _best(syncs), "copy_bps": copy_bps,
            "diff": (before, diff), "probe_s": probe_s, "repack": repack}


def _best(syncs):
    """The fastest of the syncs (its phases are printed)."""
    return min(syncs, key=lambda s: s.seconds)


def gloo_bytes_per_s(sync, nbytes: int, chunk: int, repeats: int) -> float:
    """A plain broadcast over the two-member bridge `sync` (rank SRC -> rank ENGINE_RANK, one send each) of
    `nbytes` in messages of at most `chunk` bytes, timed on the sender from a barrier until the receiver's
    1-byte ack; best of `repeats` (the receiver returns 0)."""
    import torch

    sender = sync.members[sync.rank] == SRC
    buf, ack = torch.zeros(min(chunk, nbytes), dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)
    sizes = [min(chunk, nbytes - off) for off in range(0, nbytes, chunk)]
    best = float("inf")
    for _ in range(repeats):
        sync.barrier()
        start = time.perf_counter()
        for n in sizes:
            sync.broadcast(buf[:n], src=SRC)
        sync.broadcast(ack, src=ENGINE_RANK)
        best = min(best, time.perf_counter() - start)
    return nbytes / best if sender else 0.0


def _disagg_learner(layout, groups, sync, model_dir, bucket_mb, repeats):
    import torch

    from megatron_sparse_rl.weight_sync import send_weights

    learner = _learner(layout, groups, model_dir)
    copy_bps = _learner_copy_bps(learner, repeats)
    sends = []
    for _ in range(repeats):
        sync.barrier()
        sends.append(send_weights(learner, sync, src=SRC, bucket_mb=bucket_mb))
    gloo_bps = gloo_bytes_per_s(sync, sends[0].bytes, int(bucket_mb * 2**20), repeats)
    start = time.perf_counter()
    ours = learner.forward_logprobs(torch.tensor(PROBE))["logprobs"]
    probe_s = time.perf_counter() - start
    sync.broadcast_object(ours, src=SRC)
    return {"seconds": [s.seconds for s in sends], "stats": _best(sends), "copy_bps": copy_bps, "gloo_bps": gloo_bps,
            "probe_s": probe_s}


def disaggregated_worker(rank, world_size, model_dir, bucket_mb, repeats):
    layout, groups = _layout(model_dir, world_size, 1)
    sync = layout.weight_sync_group(src=SRC)
    if groups is not None:
        return _disagg_learner(layout, groups, sync, model_dir, bucket_mb, repeats)
    return _disagg_engine_rank(sync, model_dir, bucket_mb, repeats)


def _disagg_engine_rank(sync, model_dir, bucket_mb, repeats):
    import torch

    from megatron_sparse_rl.weight_sync import receive_weights

    engine = _engine(model_dir)
    before = torch.stack(engine.prompt_logprobs(PROBE))
    received = []
    for _ in range(repeats):
        sync.barrier()
        received.append(receive_weights(engine, sync, src=SRC, verify=True))
    gloo_bytes_per_s(sync, received[0].bytes, int(bucket_mb * 2**20), repeats)
    got = [sync.broadcast_object(None, src=SRC)]
    start = time.perf_counter()
    theirs = torch.stack(engine.prompt_logprobs(PROBE))
    probe_s = time.perf_counter() - start
    diff = (theirs - got[0]).abs().max().item()
    engine.shutdown()
    if not diff <= LOGPROB_TOL:
        raise RuntimeError(f"engine logprobs differ from the learner's by {diff:.3e} after the syncs "
                           f"(tolerance {LOGPROB_TOL:.0e}): the weight sync moved wrong weights")
    diffs = ((before - got[0]).abs().max().item(), diff)
    return {"seconds": [r.seconds for r in received], "stats": _best(received), "diff": diffs, "probe_s": probe_s}


def model_size(model_dir: Path) -> tuple[int, int]:
    """(parameters, bytes) of the HF model's safetensors files."""
    from safetensors import safe_open

    params = nbytes = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                part = f.get_slice(name)
                numel = math.prod(part.get_shape())
                params, nbytes = params + numel, nbytes + numel * _DTYPE_BYTES[part.get_dtype()]
    return params, nbytes


def _gbps(bps: float) -> str:
    return f"{bps / 1e9:.3f} GB/s"


def _dlogprob(diffs: tuple[float, float]) -> str:
    return f"|dlogprob| engine vs learner {diffs[0]:.1e} before the syncs, {diffs[1]:.1e} after"


def phase_line(who: str, stats) -> str:
    """`stats`' phases (weight_sync.PHASES) as seconds and fraction of its sync time; 'other' is the untimed rest."""
    from megatron_sparse_rl.weight_sync import PHASES

    total = stats.seconds
    timed = {p: stats.phases.get(p, 0.0) for p in PHASES if stats.phases.get(p, 0.0) > 0}
    busy = sum(timed.values())
    if busy <= total:
        timed["other"] = total - busy
    parts = ", ".join(f"{p} {sec:.3f} s ({sec / total:.0%})" for p, sec in timed.items())
    overlap = f"; pipelined: the phases overlap, adding up to {busy:.3f} s ({busy / total:.0%})" if busy > total else ""
    return f"  {who} phases of its best sync ({total:.3f} s): {parts}{overlap}"


def expert_line(stats, args, what: str = "export + load") -> str:
    """Export + engine-load seconds of the routed experts' tensors per expert and layer (must not grow with E)."""
    n = args.experts * args.layers
    return (f"  experts: {what} of the routed experts' tensors {stats.expert_seconds:.3f} s = "
            f"{stats.expert_seconds / n * 1e6:.0f} us per expert per layer ({args.experts} experts x {args.layers} "
            f"layers)")


def run_colocated(model_dir, args) -> str:
    from megatron_sparse_rl.parallel.spawn import run_ranks

    (out,) = run_ranks(colocated_worker, 1, args=(str(model_dir), args.bucket_mb, args.repeats), timeout=args.timeout,
                       rank_init=getattr(args, "rank_logging", None))
    sec, nbytes = min(out["seconds"]), out["stats"].bytes
    return (f"colocated:     sync {_gbps(nbytes / sec)} ({sec * 1e3:.0f} ms, {out['stats'].buckets} bucket(s)) / "
            f"plain copy {_gbps(out['copy_bps'])} = {nbytes / sec / out['copy_bps']:.4f}; "
            f"{_dlogprob(out['diff'])}\n{phase_line('colocated', out['stats'])}\n"
            f"  probe (after the sync, not in it): engine vs learner logprobs {out['probe_s']:.3f} s\n"
            f"{expert_line(out['stats'], args)}{_repack_line(out['repack'], out['copy_bps'])}")


def _repack_line(repack, copy_bps: float) -> str:
    if repack is None:
        return ""
    bps, nbytes = repack
    return (f"\n  engine repack: vLLM's CPU oneDNN pack of the linear layers' weights ({nbytes / 2**20:.1f} MiB, not "
            f"the experts) {_gbps(bps)} / plain copy = {bps / copy_bps:.4f}: paid per such byte by every sync into a "
            "CPU engine (the kernel holds a packed copy, so no in-place fill)")


def run_disaggregated(model_dir, args) -> str:
    from megatron_sparse_rl.parallel.spawn import run_ranks

    sent, got = run_ranks(disaggregated_worker, 2, args=(str(model_dir), args.bucket_mb, args.repeats),
                          timeout=args.timeout, rank_init=getattr(args, "rank_logging", None))
    s, r = sent["stats"], got["stats"]
    if (s.bytes, s.tensors, s.buckets) != (r.bytes, r.tensors, r.buckets):
        raise RuntimeError(f"rank 1 received {r} but rank 0 sent {s}")
    sec = min(max(a, b) for a, b in zip(sent["seconds"], got["seconds"]))
    bps, copy_bps, gloo_bps = s.bytes / sec, sent["copy_bps"], sent["gloo_bps"]
    return (f"disaggregated: sync {_gbps(bps)} ({sec * 1e3:.0f} ms, {s.buckets} bucket(s), rank 0 -> rank 1) / "
            f"plain copy {_gbps(copy_bps)} = {bps / copy_bps:.4f}; gloo bridge {_gbps(gloo_bps)} "
            f"(/ plain copy = {gloo_bps / copy_bps:.4f}); sync / gloo = {bps / gloo_bps:.4f}; "
            f"{_dlogprob(got['diff'])}\n{phase_line('sender (rank 0)', s)}\n{phase_line('receiver (rank 1)', r)}\n"
            f"  probe (after the sync, not in it): learner forward {sent['probe_s']:.3f} s, engine prompt logprobs "
            f"{got['probe_s']:.3f} s\n{expert_line(s, args, 'sender export')}\n"
            f"{expert_line(r, args, 'receiver engine load')}")


def run(args: argparse.Namespace) -> int:
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_hf_model(f"{tmp}/m", hidden=args.hidden, layers=args.layers, experts=args.experts,
                                        topk=args.topk, heads=args.heads, kv_heads=args.kv_heads,
                                        head_dim=args.head_dim, moe_ffn=args.moe_ffn, seed=0)
        params, nbytes = model_size(model_dir)
        print(f"model: Qwen3-MoE hidden {args.hidden}, {args.layers} layers, {args.experts} experts (top-{args.topk}, "
              f"moe_ffn {args.moe_ffn}), heads {args.heads}/{args.kv_heads}x{args.head_dim}: {params:,} parameters, "
              f"{nbytes:,} bytes fp32 ({nbytes / 2**20:.1f} MiB); buckets <= {args.bucket_mb:g} MiB; "
              f"best of {args.repeats}; 1 torch thread per rank", flush=True)
        if args.mode in ("colocated", "both"):
            print(run_colocated(model_dir, args), flush=True)
        if args.mode in ("disaggregated", "both"):
            print(run_disaggregated(model_dir, args), flush=True)
    return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    sys.exit(run(p.parse_args()))


if __name__ == "__main__":
    # run as benchmarks.sync, so that the rank functions pickle under an importable name
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.sync import main as _main

    _main()
