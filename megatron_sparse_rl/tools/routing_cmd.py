"""`msrl routing inspect|compare`: routing statistics from saved routes (moe.RouteStore safetensors files).

    msrl routing inspect ROUTES.safetensors                  sequences, tokens, bytes/token, load entropy per layer
    msrl routing compare A.safetensors B.safetensors [--plot agreement.png]
                                                             per-layer agreement, flipped-token fraction, PNG plot
Exit codes: 0 ok, 2 bad input (missing file, not a routes file, route sets for different tokens).
"""
from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = sub.add_parser("inspect", help="summary and expert load of one routes file")
    p.add_argument("routes", help="routes file written by RouteStore.save")
    p = sub.add_parser("compare", help="agreement between two routes files of the same tokens")
    p.add_argument("a", help="reference routes (e.g. the rollout engine's)")
    p.add_argument("b", help="routes to compare (e.g. the learner's)")
    p.add_argument("--plot", default=None, help="write a PNG of the per-layer agreement here")


def run(args: argparse.Namespace) -> int:
    from megatron_sparse_rl.moe.storage import RouteStore, RoutingError

    try:
        if args.action == "inspect":
            _inspect(RouteStore.load(args.routes))
        else:
            _compare(RouteStore.load(args.a), RouteStore.load(args.b), args.plot)
    except (FileNotFoundError, RoutingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _inspect(store) -> None:
    from megatron_sparse_rl.moe.stats import expert_load, load_entropy

    tokens = int(store.indices.shape[0])
    print(f"source {store.source}: {len(store)} sequences, {tokens} tokens, {len(store.layers)} MoE layers, "
          f"top-{store.topk} of {store.num_experts} experts, {store.indices.dtype}, "
          f"{store.nbytes} bytes ({store.bytes_per_token():.2f} bytes/token)")
    load = expert_load(store)
    for j, (layer, h) in enumerate(zip(store.layers, load_entropy(load).tolist())):
        print(f"layer {layer}: load entropy {h:.3f}, tokens per expert {load[j].tolist()}")


def _compare(a, b, plot: str | None) -> None:
    from megatron_sparse_rl.moe.stats import agreement, flipped_fraction

    agree = agreement(a, b)
    for layer, v in zip(a.layers, agree.tolist()):
        print(f"layer {layer}: agreement {v:.4f}")
    print(f"mean agreement {float(agree.mean()):.4f}; tokens with any flipped expert {flipped_fraction(a, b):.4f}")
    if plot:
        _plot(a.layers, agree.tolist(), plot, f"{a.source} vs {b.source}")
        print(f"wrote {plot}")


def _plot(layers, values, path: str, title: str) -> None:
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(4, 0.4 * len(layers) + 2), 3))
    ax.bar([str(x) for x in layers], values, color="tab:blue")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("top-k set agreement")
    ax.set_title(f"routing agreement: {title}")
    fig.tight_layout()
    tmp = f"{path}.tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
