"""The TCP sockets a process tree listens on, read from the kernel through psutil, for the tests of where a run
listens (docs/launch.md "What listens where").

    seen = sample_listeners(subprocess.Popen(cmd))   # every (pid, ip, port) seen while it ran, polled every 0.2 s
    assert not off_loopback(seen) and seen
"""
from __future__ import annotations

import ipaddress
import subprocess
import time

import psutil


def listeners(pid: int, *, tree: bool = True) -> set[tuple[int, str, int]]:
    """(pid, ip, port) of every TCP socket in LISTEN state held by `pid` (and its descendants with `tree`)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *(root.children(recursive=True) if tree else [])]
    except psutil.NoSuchProcess:
        return set()
    out = set()
    for proc in procs:
        try:
            conns = proc.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue  # ended between the listing and the look
        out |= {(proc.pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}
    return out


def sample_listeners(proc: subprocess.Popen, *, every: float = 0.2, timeout: float = 600) -> set:
    """Every listener of `proc`'s tree seen from now until it exits (killed past `timeout`, then raises)."""
    seen: set = set()
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"{proc.args} still running after {timeout} s")
        seen |= listeners(proc.pid)
        time.sleep(every)
    return seen


def off_loopback(seen) -> list:
    """The listeners of `seen` whose address is not a loopback one (127.0.0.0/8, ::1): '::' and '0.0.0.0' (every
    interface) included."""
    return sorted(s for s in seen if not ipaddress.ip_address(s[1].split("%")[0]).is_loopback)
