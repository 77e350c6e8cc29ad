"""A free loopback TCP port for a rendezvous on this machine (local worlds, tests, a local SLURM)."""
from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
