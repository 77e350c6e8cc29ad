"""Where a run's sockets listen (parallel/ports.py, parallel/world.py, launch/torchrun.py): a store server on the
named address only (torch's own TCPStore, the reference, listens on every interface), an address that cannot be
bound named in the error, a world of one (`msrl train` in one process) listening on loopback only, gloo and NCCL
pinned to loopback unless the user named an interface, and torchrun arguments that would serve the store on
every interface refused before anything starts. The sockets are read from the kernel (psutil, tests/sockets.py).

    .venv/bin/python -m pytest -q tests/unit/test_ports.py
"""
from __future__ import annotations

import gc
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

from megatron_sparse_rl.launch import torchrun
from megatron_sparse_rl.parallel.ports import LOOPBACK, loopback_socket_env, store_server
from tests.sockets import listeners, off_loopback

REPO = Path(__file__).resolve().parents[2]
NOT_HERE = "203.0.113.7"  # TEST-NET-3 (RFC 5737): an address no interface of this machine holds


def _on_port(port: int) -> set:
    return {(ip, p) for _, ip, p in listeners(os.getpid(), tree=False) if p == port}


def test_store_server_listens_on_the_named_address_only():
    reference = dist.TCPStore(LOOPBACK, 0, 1, True, wait_for_workers=False)  # torch's: told 127.0.0.1 ...
    try:
        assert off_loopback({(0, ip, p) for ip, p in _on_port(reference.port)})  # ... and listening on '::'
    finally:
        del reference
        gc.collect()
    store = store_server(LOOPBACK)
    assert _on_port(store.port) == {(LOOPBACK, store.port)}
    store.set("k", "v")
    assert store.get("k") == b"v"


def test_store_server_names_an_address_it_cannot_listen_on():
    taken = store_server(LOOPBACK)
    for host, port, message in [(NOT_HERE, 0, f"cannot listen on {NOT_HERE}:0"),
                                ("no-such-host.invalid", 0, "cannot listen on 'no-such-host.invalid'"),
                                (LOOPBACK, taken.port, f"cannot listen on {LOOPBACK}:{taken.port}")]:
        with pytest.raises(OSError, match=message):
            store_server(host, port)


def test_socket_ifname_defaults_keep_what_the_user_set():
    lo = next(n for n, addrs in psutil.net_if_addrs().items() if any(a.address == LOOPBACK for a in addrs))
    assert loopback_socket_env({}) == {"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo}
    assert loopback_socket_env({"GLOO_SOCKET_IFNAME": "ib0"}) == {"NCCL_SOCKET_IFNAME": lo}


WORLD_OF_ONE = """
import json, os, sys
import torch.distributed as dist
from megatron_sparse_rl.config.schema import ParallelConfig
from megatron_sparse_rl.parallel.world import join_world
from tests.sockets import listeners
join_world(ParallelConfig(backend="gloo"))
dist.new_group([0], backend="gloo")  # as Megatron and vLLM make theirs
dist.barrier()
print(json.dumps({"listen": sorted(listeners(os.getpid())), "gloo": os.environ.get("GLOO_SOCKET_IFNAME")}))
"""


def _world_of_one(**env) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                             "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    r = subprocess.run([sys.executable, "-c", WORLD_OF_ONE], cwd=REPO, env={**base, **env}, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.splitlines()[-1])


def _other_interface() -> str | None:
    """A non-loopback interface that is up and holds an IPv4 address, if this machine has one."""
    stats = psutil.net_if_stats()
    for name, addrs in psutil.net_if_addrs().items():
        if stats.get(name) and stats[name].isup and any(
                a.family == socket.AF_INET and not a.address.startswith("127.") for a in addrs):
            return name
    return None


def test_a_world_of_one_listens_on_loopback_only():
    out = _world_of_one()
    assert out["listen"] and not off_loopback(out["listen"]), out  # the store and gloo's pair listeners
    assert out["gloo"] == loopback_socket_env({})["GLOO_SOCKET_IFNAME"]
    other = _other_interface()
    if other is None:
        pytest.skip("no non-loopback interface here to show that a user's GLOO_SOCKET_IFNAME is kept")
    chosen = _world_of_one(GLOO_SOCKET_IFNAME=other)  # the user's choice wins, and the check above would see it
    assert chosen["gloo"] == other and off_loopback(chosen["listen"])


@pytest.mark.parametrize("argv, message", [
    (["--standalone", "--nproc-per-node=2", "x.py"], "not --standalone, --rdzv-backend or --rdzv-endpoint"),
    (["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0", "x.py"], "only the static rendezvous"),
    (["--nnodes=1", "--node-rank=0", "x.py"], "--master-port is required"),
    (["--nnodes=2", "--node-rank=0", "--master-port=0", "x.py"], "--master-port=0 works on one node only"),
])
def test_torchrun_refuses_a_store_it_cannot_bind_to_one_address(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    assert torchrun.main(argv) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing started: no worker wrote, no agent log


def test_a_store_for_other_nodes_refuses_a_name_that_resolves_to_loopback():
    with pytest.raises(OSError, match="cannot listen on 'localhost' for the other nodes: it resolves to 127.0.0.1 on "
                                      "this node.*launch.slurm.interface"):
        store_server("localhost", remote=True)
    assert store_server("localhost").port  # one machine: loopback is what it should be


@pytest.mark.parametrize("argv, message", [
    (["--nnodes=1", f"--master-addr={NOT_HERE}", "--master-port=0"], f"[Errno 99] cannot listen on {NOT_HERE}:0"),
    (["--nnodes=2", "--master-addr=localhost", "--master-port=29400"], "'localhost' for the other nodes"),
])
def test_torchrun_names_a_master_addr_it_cannot_serve(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    assert torchrun.main([*argv, "--node-rank=0", "x.py"]) == 1
    err = capsys.readouterr().err
    assert "launch.torchrun: --master-addr/--master-port: " in err and message in err
    assert list(tmp_path.iterdir()) == []
