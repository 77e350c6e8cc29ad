"""torchrun whose rendezvous store listens on --master-addr only: what `msrl launch local` and the SLURM script's
torchrun mode run instead of `python -m torch.distributed.run`, with the same arguments.

    python -m megatron_sparse_rl.launch.torchrun --nnodes=1 --node-rank=0 --master-addr=127.0.0.1 \\
        --master-port=0 --nproc-per-node=2 -m megatron_sparse_rl.tools.cli train CONFIG

Stock torchrun's agent serves its TCPStore on every interface whatever --master-addr says (`--standalone`'s
c10d store too, and the second store it shares with the workers). Here the agent of node 0 serves the store
first, on --master-addr only (parallel/ports.py `store_server`), and torch's static rendezvous, which asks for a
multi-tenant store on the same port of the same process, shares that one instead of binding its own.
`--master-port=0` picks a free port (one node only: the other nodes could not learn it). The workers are the
store's clients (torchrun tells them so with TORCHELASTIC_USE_AGENT_STORE), so the launch itself listens on
that one address; what the ranks open is parallel/world.py's business. Only the static rendezvous is taken: the
other backends (`--standalone`, c10d, etcd) create their stores where this module cannot bind them.
A stop signal ends it with one line and 128 + the signal number, after torch has passed the signal to the ranks and
waited up to --shutdown-timeout for them (run/stops.py: they checkpoint and exit), not with a traceback.
Ranks that refuse to start (a ConfigError, recorded in their error files: launch/refusal.py) end it with each
distinct message once as `error: ...` and exit 2, as `msrl train` alone does, not with torch's failure report.
"""
from __future__ import annotations

import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record

from megatron_sparse_rl.launch.refusal import messages


def _one_node(args) -> bool:
    return str(args.nnodes) in ("1", "1:1")


def argument_problem(args) -> str | None:
    """Why parsed torchrun arguments cannot run with a store bound to --master-addr, or None."""
    if args.standalone or args.rdzv_backend != "static" or args.rdzv_endpoint:
        return ("only the static rendezvous binds its store to one address: pass --nnodes, --node-rank, "
                "--master-addr and --master-port, not --standalone, --rdzv-backend or --rdzv-endpoint")
    if args.master_port is None:
        return "--master-port is required (0: a free port, on one node only)"
    if args.master_port == 0 and not _one_node(args):
        return f"--master-port=0 works on one node only (--nnodes={args.nnodes}): the other nodes must know the port"
    return None


@record
def main(argv: list[str] | None = None) -> int:
    from torch.distributed.run import parse_args, run

    from megatron_sparse_rl.parallel.ports import store_server

    args = parse_args(sys.argv[1:] if argv is None else argv)
    problem = argument_problem(args)
    if problem:
        print(f"launch.torchrun: {problem}", file=sys.stderr)
        return 2
    store = None  # node 0: served here until the run ends, before torch's rendezvous asks for it
    if args.node_rank == 0:
        try:
            store = store_server(args.master_addr, args.master_port, remote=not _one_node(args))
        except OSError as e:
            print(f"launch.torchrun: --master-addr/--master-port: {e}", file=sys.stderr)
            return 1
        args.master_port = store.port
    try:
        run(args)
    except SignalException as e:  # torch has passed the signal to the ranks and waited for them (--shutdown-timeout)
        print(f"launch.torchrun: stopped by {signal.Signals(e.sigval).name}", file=sys.stderr)
        return 128 + e.sigval
    except ChildFailedError as e:
        refused = messages(e.failures)
        if not refused:  # a crash: torch's report (each failed rank, its exit code or signal, the root cause)
            raise
        print("\n".join(f"error: {m}" for m in refused), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
