"""Weight sync between two processes on one device without vLLM (weight_sync/ipc.py, device_digest.py): a rank
(the learner side) packs a set of bf16/fp32 tensors of mixed shapes (about 0.9 GiB on cuda, 3.5 MiB on cpu) into
device buckets, digested on the device, and hands them to a receiver process it spawns (CUDA IPC on cuda, shared
memory on cpu), which verifies them on its device and copies them into engine tensors it holds.

- the digest of random bytes on the device equals the digest of the same bytes on the CPU (eager torch ops; on
  cuda the compiled kernel is what runs on the device, so this checks it against the eager path);
- after a transfer, the receiver's tensors are bit-equal to the sender's; a bucket with one flipped byte is refused
  naming its tensor, and nothing of it reaches the engine tensors;
- figures (payload bytes / seconds, best of `REPS` after a warm-up): d2d_copy_GBps (the same tensors copied
  learner -> engine-shaped tensors in one process: the baseline), digest_GBps, pack_digest_GBps (`seal` into the
  reused buffer), ipc_end_to_end_GBps (pack + digest + hand-over + verify + copy into the engine tensors, from the
  sender's start to the last ack), ratio_end_to_end_vs_copy, digest_compiled (1: the torch.compile'd kernel ran).
  The issue's goal is end-to-end >= 0.5 of the copy; the ratio is recorded, not asserted.

    .venv/bin/python -m pytest -q tests/gpu/test_cuda_weight_sync.py                           # cuda (needs CUDA)
    MSRL_GPU_TESTS_ON_CPU=1 .venv/bin/python -m pytest -q tests/gpu/test_cuda_weight_sync.py   # the cpu variant
"""
import time

import torch

from tests.gpu.devices import run_on

ROWS = {"cuda": 16384, "cpu": 64}
"""Tensor rows per device: 56 KiB per row in all (0.9 GiB on cuda)."""
BUCKET_MB = {"cuda": 256, "cpu": 1}
REPS = 3


def learner_tensors(device: str, rows: int) -> list[tuple[str, torch.Tensor]]:
    """bf16 and fp32 tensors of mixed shapes, odd-sized ones included, random on `device`."""
    g = torch.Generator(device=device).manual_seed(0)
    out = [("embed", torch.randn(rows, 4096, generator=g, device=device).to(torch.bfloat16))]
    for k in range(4):
        out += [(f"layers.{k}.w", torch.randn(rows // 2, 4096, generator=g, device=device)),
                (f"layers.{k}.moe", torch.randn(rows, 2048, generator=g, device=device).to(torch.bfloat16)),
                (f"layers.{k}.bias", torch.randn(4099, generator=g, device=device).to(torch.bfloat16)),
                (f"layers.{k}.scale", torch.randn(17, generator=g, device=device))]
    return out


def receiver_main(spec, device, inbox, outbox):
    """The engine process: zero engine tensors of `spec` [(name, shape, dtype)], served until Stop."""
    from megatron_sparse_rl.weight_sync.device_digest import DeviceDigester
    from megatron_sparse_rl.weight_sync.ipc import serve

    engine = {name: torch.zeros(shape, dtype=dtype, device=device) for name, shape, dtype in spec}
    serve(engine, inbox, outbox, DeviceDigester(device))


def _best(fn, device) -> float:
    """Best seconds of `REPS` calls of `fn` (synchronized on cuda)."""
    times = []
    for _ in range(REPS):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def sync_worker(rank, world, device):
    import torch.multiprocessing as tmp

    from megatron_sparse_rl.weight_sync.buckets import group_tensors, seal
    from megatron_sparse_rl.weight_sync.device_digest import DeviceDigester, device_digest
    from megatron_sparse_rl.weight_sync.export import WeightSyncError
    from megatron_sparse_rl.weight_sync.ipc import BucketSender

    tensors = learner_tensors(device, ROWS[device])
    payload = sum(t.numel() * t.element_size() for _, t in tensors)
    digester = DeviceDigester(device)
    noise = torch.randint(0, 256, (3 * 2**20 + 3,), dtype=torch.uint8, device=device)
    out = {"digest_equal": digester(noise) == device_digest(noise.cpu())}

    ctx = tmp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    spec = [(name, tuple(t.shape), t.dtype) for name, t in tensors]
    receiver = ctx.Process(target=receiver_main, args=(spec, device, inbox, outbox))
    receiver.start()
    sender = BucketSender(inbox, outbox)
    try:
        groups = list(group_tensors(tensors, bucket_mb=BUCKET_MB[device]))
        buffer = torch.empty(max(sum(_raw(t).numel() + 16 for _, t in g) for g in groups), dtype=torch.uint8,
                             device=device)

        def transfer():
            for i, items in enumerate(groups):
                sender.send(seal(i, items, digester=digester, into=buffer))

        transfer()  # warm-up: CUDA IPC mapping, compiles in both processes
        seconds = {"ipc_end_to_end": _best(transfer, device)}
        bad = seal(len(groups), groups[0], digester=digester, into=buffer)
        bad.buffer[bad.metas[-1].offset + 5] ^= 0x10
        try:
            sender.send(bad)
            out["refused"] = None
        except WeightSyncError as e:
            out["refused"] = str(e)
        out["corrupted_tensor"] = bad.metas[-1].name
        got = sender.engine_tensors()
        out["bit_equal"] = {name: torch.equal(_raw(got[name]), _raw(t)) for name, t in tensors}
        del got

        targets = [torch.empty_like(t) for _, t in tensors]
        seconds["d2d_copy"] = _best(lambda: [d.copy_(s) for d, (_, s) in zip(targets, tensors)], device)
        seconds["digest"] = _best(lambda: [digester(_raw(t)) for _, t in tensors], device)
        seconds["pack_digest"] = _best(lambda: [seal(i, items, digester=digester, into=buffer)
                                               for i, items in enumerate(groups)], device)
    finally:
        sender.stop()
        receiver.join(timeout=60)
        if receiver.is_alive():
            receiver.kill()
    out.update(payload=payload, seconds=seconds, path=digester.path, compile_error=digester.compile_error,
               receiver_exit=receiver.exitcode)
    return out


def test_ipc_weight_sync(device, figure):
    got = run_on(device, sync_worker, (device,))
    print(f"{device}: {got['payload'] / 2**20:.1f} MiB, seconds {got['seconds']}, digest path {got['path']}"
          + (f" (compile failed: {got['compile_error'][:300]})" if got["compile_error"] else ""))
    assert got["digest_equal"], "the device digest differs from the CPU digest of the same bytes"
    assert got["refused"] is not None, "a bucket with a flipped byte was loaded"
    assert "checksum mismatch" in got["refused"] and repr(got["corrupted_tensor"]) in got["refused"], got["refused"]
    assert all(got["bit_equal"].values()), [n for n, ok in got["bit_equal"].items() if not ok]
    assert got["receiver_exit"] == 0
    rates = {name: got["payload"] / s / 1e9 for name, s in got["seconds"].items()}
    for name, rate in rates.items():
        figure(f"{name}_GBps", rate, "GB/s")
    figure("ratio_end_to_end_vs_copy", rates["ipc_end_to_end"] / rates["d2d_copy"])
    figure("digest_compiled", got["path"] == "compiled")
