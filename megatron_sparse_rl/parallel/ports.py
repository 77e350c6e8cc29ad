"""Where the sockets of a run listen: one named address, never every interface.

    store = store_server("127.0.0.1")               # a TCPStore server on loopback only, on a free port
    store = store_server(addr, 29500, world_size=8)  # the rendezvous of a multi-node job, on `addr` only
    env = loopback_socket_env(os.environ)            # gloo / NCCL pinned to loopback unless the user named one

torch's TCPStore binds the port it is given on every interface (`::`, or `0.0.0.0`) whatever host it is told;
`store_server` binds the socket itself, on the address it is given, and hands it to the store
(`master_listen_fd`). Gloo and NCCL listen on the interface their `*_SOCKET_IFNAME` variable names, else on the
address this machine's hostname resolves to (gloo) or the first non-loopback interface (NCCL).
docs/launch.md "What listens where" lists every listener of a run.
"""
from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping
from datetime import timedelta

LOOPBACK = "127.0.0.1"
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""The variables gloo and NCCL read for the interface their sockets listen on."""
STORE_TIMEOUT = timedelta(minutes=30)
"""How long a store client waits for the server and for a key (torch's default process-group timeout)."""


def free_port(host: str = LOOPBACK) -> int:
    """A port free on `host` now (for a service started later, which binds it itself; it may be taken by then)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def bound_socket(host: str, port: int = 0, *, remote: bool = False) -> socket.socket:
    """A TCP socket bound to `host` (a name is resolved here, the first address it has) and `port` (0: a free
    one), not yet listening. Raises OSError naming the address when it cannot be bound, or with `remote` (other
    machines must reach it) when the name resolves to a loopback address here (e.g. /etc/hosts mapping this
    machine's name to 127.0.1.1)."""
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise OSError(f"cannot listen on {host!r}: the name does not resolve ({e})") from None
    if remote and ipaddress.ip_address(addr[0]).is_loopback:
        raise OSError(f"cannot listen on {host!r} for the other nodes: it resolves to {addr[0]} on this node, a "
                      "loopback address they cannot reach (name the interface: launch.slurm.interface)")
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a fixed port reused right after a restart
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port} ({addr[0]}): {e.strerror}") from None
    return sock


def store_server(host: str, port: int = 0, *, world_size: int | None = None, remote: bool = False,
                 timeout: timedelta = STORE_TIMEOUT):
    """A TCPStore server listening on `host`:`port` only (port 0: a free one, read back as `.port`); `remote`: other
    machines connect to it (`bound_socket`).

    Multi-tenant: a TCPStore this process creates later on the same port as a server (torch's static rendezvous
    in launch/torchrun.py) shares this one instead of binding the port on every interface."""
    import torch.distributed as dist

    sock = bound_socket(host, port, remote=remote)
    bound = sock.getsockname()[1]
    return dist.TCPStore(host, bound, world_size, True, timeout, wait_for_workers=False, multi_tenant=True,
                         master_listen_fd=sock.detach())  # the store owns the descriptor from here on


def store_client(host: str, port: int, *, world_size: int | None = None, timeout: timedelta = STORE_TIMEOUT):
    """A TCPStore client of the server on `host`:`port` (it opens no listening socket)."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, world_size, False, timeout, wait_for_workers=False)


def loopback_interface() -> str:
    """The name of the interface holding 127.0.0.1 ('lo' on Linux)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == LOOPBACK for a in addrs):
            return name
    return "lo"


def loopback_socket_env(env: Mapping[str, str]) -> dict[str, str]:
    """The `*_SOCKET_IFNAME` settings that keep gloo's and NCCL's sockets on loopback, for the variables `env`
    does not set already (a value the user set is theirs to keep)."""
    name = loopback_interface()
    return {var: name for var in SOCKET_IFNAME_VARS if not env.get(var)}
