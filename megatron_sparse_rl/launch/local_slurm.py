"""A single-node SLURM cluster on this machine (munged + slurmctld + slurmd), for tests and demos.

    python -m megatron_sparse_rl.launch.local_slurm up /tmp/msrl-slurm   # prints `export SLURM_CONF=...`
                                                                         # Ctrl-C stops it
    sbatch, srun, squeue ... with that SLURM_CONF

    with LocalSlurm(tmpdir) as cluster:                   # in Python (tests/e2e/test_slurm.py)
        subprocess.run(["sbatch", "--wait", script], env=cluster.env())

Everything (munge key and socket, state, spool, logs, pids) lives under one fresh directory; daemons run
in the foreground as children of this process and are stopped by their process ids. Settings are the ones
measured to work with Debian's slurm-wlm 22.05 (munge with its own key; auth/slurm does not exist there): root
as SlurmUser, proctrack/linuxproc, task/none, no accounting, cons_tres, one node with this machine's CPUs.
Ports are picked free so that several clusters can run side by side on a shared machine.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from megatron_sparse_rl.parallel.ports import free_port as _free_port

PACKAGES = ("slurm-wlm", "munge")
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo")
PARTITION = "debug"


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]


def _bin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def install(timeout: float = 600) -> None:
    """`apt-get install -y slurm-wlm munge` (root only); raises RuntimeError with apt's output on failure."""
    if os.geteuid() != 0:
        raise RuntimeError("installing SLURM needs root")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES],):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if r.returncode:  # the package lists may be missing on a fresh machine: update once, retry
            subprocess.run(["apt-get", "update"], env=env, capture_output=True, text=True, timeout=timeout)
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if r.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")


class LocalSlurm:
    """munged + slurmctld + slurmd under `root`; use as a context manager or call start()/stop()."""

    def __init__(self, root: str | Path, cpus: int | None = None):
        self.root = Path(root).resolve()
        self.host = socket.gethostname()
        self.cpus = cpus or os.cpu_count() or 1
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket.2"
        self.procs: dict[str, subprocess.Popen] = {}

    def env(self) -> dict[str, str]:
        """The environment for SLURM clients (sbatch, srun, scontrol, `msrl launch slurm`)."""
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def _write_config(self) -> None:
        r = self.root
        for d in ("munge", "state", "spool", "log", "run"):
            (r / d).mkdir(parents=True, exist_ok=True)
        os.chmod(r / "munge", 0o755)  # munged refuses a socket directory others can write to
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self.conf.write_text("\n".join([
            "ClusterName=msrltest", f"SlurmctldHost={self.host}(127.0.0.1)",
            "SlurmUser=root", "SlurmdUser=root",
            f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={r / 'state'}", f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'run' / 'slurmctld.pid'}", f"SlurmdPidFile={r / 'run' / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "MailProg=/bin/true", "MpiDefault=none", "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "ReturnToService=2", "SchedulerParameters=sched_interval=1",
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
            f"PartitionName={PARTITION} Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.stdout", "wb")
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                            start_new_session=True)
        log.close()

    def _wait_for(self, what: str, ok, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited ({p.returncode}) while waiting for {what}; "
                                       f"see {self.root / 'log'}:\n{self.logs()}")
            if ok():
                return
            time.sleep(0.2)
        raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}; logs:\n{self.logs()}")

    def _node_idle(self) -> bool:
        r = subprocess.run([_bin("sinfo"), "-h", "-N", "-o", "%T"], env=self.env(), capture_output=True, text=True)
        return r.returncode == 0 and r.stdout.strip().startswith("idle")

    def start(self, timeout: float = 30) -> "LocalSlurm":
        self._write_config()
        m = self.root / "munge"
        self._spawn("munged", [_bin("munged"), "-F", "--force", f"--socket={self.munge_socket}",
                               f"--key-file={m / 'munge.key'}", f"--pid-file={m / 'munged.pid'}",
                               f"--log-file={self.root / 'log' / 'munged.log'}", f"--seed-file={m / 'munged.seed'}"])
        self._wait_for("the munge socket", self.munge_socket.exists, timeout)
        self._spawn("slurmctld", [_bin("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._spawn("slurmd", [_bin("slurmd"), "-D", "-N", self.host, "-f", str(self.conf)])
        self._wait_for("the node to become idle", self._node_idle, timeout)
        return self

    def stop(self) -> None:
        """Cancel remaining jobs, then stop the daemons by their process ids (TERM, then KILL)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            subprocess.run([_bin("scancel"), "--user", "root", "--full"], env=self.env(), capture_output=True,
                           timeout=10)
        for name in ("slurmd", "slurmctld", "munged"):
            p = self.procs.pop(name, None)
            if p is None or p.poll() is not None:
                continue
            p.terminate()
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def logs(self, tail: int = 3000) -> str:
        out = []
        for f in sorted((self.root / "log").glob("*")):
            text = f.read_text(errors="replace")
            out.append(f"--- {f.name}\n{text[-tail:]}")
        return "\n".join(out)

    def __enter__(self) -> "LocalSlurm":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "up":
        print("usage: python -m megatron_sparse_rl.launch.local_slurm up DIR", file=sys.stderr)
        return 2
    if missing_binaries():
        install()
    with LocalSlurm(argv[1]) as cluster:
        print(f"export SLURM_CONF={cluster.conf}    # partition {PARTITION!r}; Ctrl-C stops the cluster", flush=True)
        try:
            while all(p.poll() is None for p in cluster.procs.values()):
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
