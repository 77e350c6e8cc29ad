"""Routing replay overhead and route storage size.

    msrl bench routing [--hidden 128 --layers 4 --experts 64 --topk 8 --seq 256 --batch 8 --pairs 8]
    .venv/bin/python benchmarks/routing.py [--hidden 128 --layers 4 --experts 64 --topk 8 --seq 256 --batch 8 --pairs 8]

One process (single-rank gloo world, TP1), a tiny random Qwen3-MoE, fp32, real Megatron learner on CPU.
Prints the learner train-step time with R2 replay (train_step with the update's replay request in its extras,
including the per-step route checks and the applied-fraction verification) over the time without replay (same model,
routers computing their own top-k): `--pairs` back-to-back pairs, the order alternating, reported as the
median and range of the per-pair ratios (a shared CPU's noise shows in the range). Also the host time of
the replay bookkeeping alone (route checks/expansion at phase entry, per-micro-batch route slicing,
verification at exit), timed around those calls, as a share of the step. And the route storage in bytes
per token (packed uint8 RouteStore) next to int64 indices padded to the batch's longest sequence.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import replace

from megatron_sparse_rl.config.checks import positive


def _learner(model_dir):
    from megatron_sparse_rl.config.routing import RoutingConfig
    from megatron_sparse_rl.config.schema import LearnerConfig, ModelConfig, OptimizerConfig, ParallelConfig
    from megatron_sparse_rl.learner.learner import Learner
    from megatron_sparse_rl.models import load_spec
    from megatron_sparse_rl.parallel import ParallelLayout
    from megatron_sparse_rl.patches import megatron_cpu

    megatron_cpu.apply()
    adapter, spec = load_spec(model_dir)
    layout = ParallelLayout.from_config(ParallelConfig(), 1)
    learner = Learner(adapter, spec, layout, layout.initialize(), model_cfg=ModelConfig(path=str(model_dir)),
                      cfg=LearnerConfig(micro_batch_size=2, optimizer=OptimizerConfig(lr=1e-5)), total_steps=100,
                      routing=RoutingConfig(mode="R2", record_stats=False))
    learner.load_hf(model_dir)
    return learner


class _Bookkeeping:
    """Accumulates the host time of the learner's own replay work (request start and finish, micro-batch
    slicing): its LearnerRouting's calls, timed on that instance."""

    def __init__(self, routing):
        self.seconds = 0.0
        for name in ("begin", "before_micro_batch", "finish"):
            setattr(routing, name, self._timed(getattr(routing, name)))

    def _timed(self, inner):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
        return timed


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--hidden", type=positive(), default=128)
    ap.add_argument("--layers", type=positive(), default=4)
    ap.add_argument("--experts", type=positive(), default=64)
    ap.add_argument("--topk", type=positive(), default=8)
    ap.add_argument("--seq", type=positive(), default=256)
    ap.add_argument("--batch", type=positive(), default=8)
    ap.add_argument("--pairs", type=positive(), default=8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(ap)
    raise SystemExit(run(ap.parse_args()))


def run(a: argparse.Namespace) -> int:
    from megatron_sparse_rl.parallel.ports import free_port

    if a.topk > a.experts:
        raise SystemExit(f"error: --topk must be <= --experts (got {a.topk} > {a.experts})")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    import torch
    import torch.distributed as dist

    from megatron_sparse_rl.learner.extras import ForwardExtras
    from megatron_sparse_rl.learner.sft import make_sft_loss
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_hf_model(f"{tmp}/m", hidden=a.hidden, layers=a.layers, experts=a.experts, topk=a.topk,
                                        moe_ffn=a.hidden, max_position=max(2048, a.seq))
        learner = _learner(model_dir)
        routing = learner.routing
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(3, 60, (a.batch, a.seq), generator=g)
        lengths = torch.randint(a.seq // 2, a.seq + 1, (a.batch,), generator=g)
        mask = (torch.arange(a.seq - 1)[None] < (lengths - 1)[:, None]).float()
        loss_fn = make_sft_loss(mask, mask.sum().item())
        record = ForwardExtras(routes=replace(routing.old_forward(None), lengths=lengths))  # R2: record
        routes = learner.forward_logprobs(tokens, extras=record)["routing"].routes
        replay = ForwardExtras(routes=replace(routing.update(routes), lengths=lengths))
        learner.train_step(tokens, loss_fn)  # warm-up
        book = _Bookkeeping(routing)
        ratios, plain_s = [], []
        for i in range(a.pairs):
            order = ("plain", "replay") if i % 2 == 0 else ("replay", "plain")
            t = {}
            for kind in order:
                start = time.perf_counter()
                if kind == "plain":
                    learner.train_step(tokens, loss_fn)
                else:
                    learner.train_step(tokens, loss_fn, extras=replay)
                t[kind] = time.perf_counter() - start
            ratios.append(t["replay"] / t["plain"])
            plain_s.append(t["plain"])
    n_tok = int(routes.indices.shape[0])
    padded_int64 = a.batch * (a.seq - 1) * a.layers * a.topk * 8
    ratios.sort()
    med, step = ratios[len(ratios) // 2], sorted(plain_s)[len(plain_s) // 2]
    print(f"learner step without replay: median {step * 1e3:.1f} ms; with R2 replay / without, over {a.pairs} "
          f"pairs: median {med:.4f} (overhead {100 * (med - 1):+.2f}%, range {100 * (ratios[0] - 1):+.2f}% .. "
          f"{100 * (ratios[-1] - 1):+.2f}%; target < 2%)")
    per_step = book.seconds / a.pairs
    print(f"replay bookkeeping (host): {per_step * 1e3:.2f} ms per step = {100 * per_step / step:.2f}% of the step")
    print(f"route storage: {routes.bytes_per_token():.2f} bytes/token packed {routes.indices.dtype} "
          f"({a.layers} layers x top-{a.topk}) vs {padded_int64 / n_tok:.1f} bytes/token as padded int64 "
          f"-> {padded_int64 / routes.nbytes:.1f}x smaller")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    main()
