"""Hand device buckets to an engine in another process on the same machine: CUDA IPC for a GPU buffer (the
receiver maps the sender's memory, no copy through the host), shared memory for a CPU buffer (same code).

    # sender (owns the learner tensors)                      # receiver process (owns the engine tensors)
    ctx = torch.multiprocessing.get_context("spawn")         serve(engine_tensors, inbox, outbox,
    inbox, outbox = ctx.Queue(), ctx.Queue()                       DeviceDigester(device))
    ...start the receiver with (inbox, outbox)...
    sender = BucketSender(inbox, outbox)
    buffer = torch.empty(limit, dtype=torch.uint8, device=device)
    for i, items in enumerate(group_tensors(stream, bucket_mb=256)):
        sender.send(seal(i, items, digester=digester, into=buffer))   # returns once the receiver acked
    sender.stop()

The receiver verifies each bucket's digests on its device (buckets.py `verify_bucket`), then copies every tensor
into the engine tensor of the same name, then acknowledges; only then may the sender overwrite the buffer (one
buffer is reused, so the receiver maps it once). A corrupted bucket is acknowledged with the error and nothing of
it is copied; the sender raises it as WeightSyncError naming the tensors. An unknown name or a shape or dtype that
differs from the engine tensor's is refused likewise, before anything of that bucket is copied.
Messages are frozen dataclasses, one per command: `Load`, `SendBack`, `Stop` to the receiver, `Loaded` back.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_sparse_rl.weight_sync.buckets import Bucket, verify_bucket
from megatron_sparse_rl.weight_sync.device_digest import DeviceDigester
from megatron_sparse_rl.weight_sync.export import WeightSyncError


@dataclass(frozen=True)
class Load:
    """Verify `bucket` and copy its tensors into the engine tensors; answer `Loaded`."""
    bucket: Bucket


@dataclass(frozen=True)
class SendBack:
    """Answer with the engine tensors themselves (shared, not copied): for tests and checks."""


@dataclass(frozen=True)
class Stop:
    """End `serve`."""


@dataclass(frozen=True)
class Loaded:
    """The receiver's answer to `Load`: `error` None when the bucket's tensors are in the engine tensors."""
    index: int
    error: str | None = None


def load_bucket(bucket: Bucket, engine_tensors: dict[str, torch.Tensor], digester: DeviceDigester | None = None
                ) -> None:
    """Verify `bucket` (on its buffer's device) and copy its tensors into `engine_tensors` (name -> tensor of the
    same shape and dtype); raises WeightSyncError before copying anything when a digest, a name or a shape is
    wrong. Returns when the copies are done (the sender may then reuse the buffer)."""
    verify_bucket(bucket, digester=digester)
    for m in bucket.metas:
        target = engine_tensors.get(m.name)
        if target is None:
            raise WeightSyncError(f"bucket {bucket.index}: tensor {m.name!r} is not one of the engine's "
                                  f"{len(engine_tensors)} tensors (e.g. {sorted(engine_tensors)[:3]})")
        if tuple(target.shape) != m.shape or target.dtype != m.dtype:
            raise WeightSyncError(f"bucket {bucket.index}: tensor {m.name!r} arrived as {m.dtype} {list(m.shape)}; "
                                  f"the engine's is {target.dtype} {list(target.shape)}")
    for name, tensor in bucket.tensors():
        engine_tensors[name].copy_(tensor)
    if bucket.buffer.is_cuda:  # the copies read the sender's memory: done before the ack lets it be overwritten
        torch.cuda.current_stream(bucket.buffer.device).synchronize()


def serve(engine_tensors: dict[str, torch.Tensor], inbox, outbox, digester: DeviceDigester | None = None) -> None:
    """The receiver's loop: `Load` -> `load_bucket` -> `Loaded` on `outbox`, until `Stop`."""
    while True:
        # the previous message stays alive while the next one is unpickled: a reused CUDA buffer is mapped once
        message = inbox.get()
        if isinstance(message, Stop):
            return
        if isinstance(message, SendBack):
            outbox.put(engine_tensors)
            continue
        if not isinstance(message, Load):
            raise TypeError(f"the receiver takes Load, SendBack or Stop (got {type(message).__name__})")
        try:
            load_bucket(message.bucket, engine_tensors, digester)
        except WeightSyncError as e:
            outbox.put(Loaded(message.bucket.index, str(e)))
        else:
            outbox.put(Loaded(message.bucket.index))


class BucketSender:
    """The sender's end of `serve`: one bucket in flight at a time (its buffer may be reused after `send`)."""

    def __init__(self, inbox, outbox, *, timeout: float = 300.0):
        self.inbox, self.outbox, self.timeout = inbox, outbox, timeout

    def send(self, bucket: Bucket) -> None:
        """Hand `bucket` over and wait for the receiver's ack; raises WeightSyncError with the receiver's error."""
        self.inbox.put(Load(bucket))
        ack = self.outbox.get(timeout=self.timeout)
        if ack.index != bucket.index:
            raise WeightSyncError(f"the receiver acknowledged bucket {ack.index} while bucket {bucket.index} was sent")
        if ack.error is not None:
            raise WeightSyncError(f"the receiver refused: {ack.error}")

    def engine_tensors(self) -> dict[str, torch.Tensor]:
        """The receiver's engine tensors (shared memory / CUDA IPC views: keep the receiver alive while used)."""
        self.inbox.put(SendBack())
        return self.outbox.get(timeout=self.timeout)

    def stop(self) -> None:
        self.inbox.put(Stop())
