"""The lock that lets one process at a time run in a run directory (run/run_dir.py `claim` takes it first).

`lock(run_dir, holder_of)` takes an exclusive `flock` on the directory itself (no lock file: nothing is written
into the directory to take it) and keeps it as long as the run's `RunDir` lives (the whole run). The kernel
releases a flock when the last descriptor of it closes, which a process killed with SIGKILL cannot prevent: a held
lock therefore means its holder is alive, and a directory whose `run.json` names a holder but whose lock is free
was left by a run that has ended or died (a stale holder, taken over and logged). Forked children (vLLM's engine
processes) close their copy of the descriptor, so a child that outlives its parent does not keep the directory
locked; exec'd ones never get it.

The holder (pid, host, start time, command line) is recorded by `claim` in `run.json` right after the lock is
taken; a refused start names it. A second `claim` in the process that holds the lock (the holder recorded is
this process) shares it.

`claim` locks the run's checkpoint directory the same way (`checkpoint.dir`, or <logging.dir>/checkpoints), so that
two runs never share one. No run record lives there: the holder of its lock is read from the kernel's lock table
(`flock_holder`, /proc/locks: the process on this host holding the lock).
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

# How long a refused start waits for the holder to record itself (it writes run.json right after locking).
RECORD_WAIT_S = 3.0


class RunLockedError(Exception):
    """Another live process holds the run directory; the message names it and the directory (run_dir.py turns it
    into a RunDirError)."""


def this_process() -> dict:
    """The holder record of this process: pid, host, start time and command line."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv)[:500],
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def is_this_process(holder: dict | None) -> bool:
    return bool(holder) and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()


UNRECORDED = "a process that has not recorded itself in run.json yet"


def describe(holder: dict | None, unknown: str = UNRECORDED) -> str:
    """'process 1234 on host h (started ..., command: ...)' or what is known of it (`unknown`: nothing)."""
    if not holder:
        return unknown
    started = f", started {holder['started']}" if holder.get("started") else ""
    command = f", command: {holder['command']}" if holder.get("command") else ""
    return f"process {holder.get('pid')} on host {holder.get('host')}{started}{command}"


class DirLock:
    """An exclusive flock on a directory, held while this object lives (the run's `RunDir`, kept by its
    `RunContext` to the end) or until `release`. Pickled (rank 0's answer is broadcast to every rank) it travels
    without its descriptor: only the process that took it holds it."""

    def __init__(self, path: Path, fd: int | None):
        self.path, self._fd = path, fd
        if fd is not None:
            ref = weakref.ref(self)
            os.register_at_fork(after_in_child=lambda: (held := ref()) is not None and held._close())

    @property
    def held(self) -> bool:
        return self._fd is not None

    def _close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def release(self) -> None:
        """Give the directory up before the process ends (tests; a run keeps it to the end)."""
        self._close()

    def __del__(self):
        self._close()

    def __getstate__(self):
        return {"path": self.path, "_fd": None}

    def __setstate__(self, state):
        self.path, self._fd = state["path"], None


def flock_holder(path: Path) -> dict | None:
    """The process on this host that holds a flock on directory `path`, as a holder record (pid, host, command
    line), from the kernel's lock table (/proc/locks, Linux); None when none is listed (no such table, or a holder
    on another host of a network filesystem)."""
    try:
        st = os.stat(path)
        table = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in table:  # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:2146442 0 EOF"; a waiter's line has "->"
        fields = line.split()
        if "FLOCK" in fields and inode in fields and "->" not in fields:
            pid = int(fields[fields.index(inode) - 1])
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                command = ""
            return {"pid": pid, "host": socket.gethostname(), "command": command.strip()[:500]}
    return None


def lock(run_dir: Path, holder_of: Callable[[], dict | None], *, field: str = "logging.dir",
         way_out: str = "start this run in another directory (--set logging.dir=...)",
         unknown: str = UNRECORDED) -> DirLock:
    """Take `run_dir`'s lock (the directory must exist). `holder_of()` reads the holder recorded in the directory.
    Raises RunLockedError naming `field`, the directory and the holder (`unknown` when none is found) when another
    live process holds it, the message ending with `way_out`; this process holding it already gives a DirLock
    sharing it. A filesystem that cannot lock directories is warned about, not refused."""
    for _ in range(5):
        fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return _held_elsewhere(run_dir, holder_of, field, way_out, unknown)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EBADF, errno.EINVAL):
                raise
            log.warning("cannot lock %s %s on this filesystem (%s): a second run started into it at the same time "
                        "would not be refused", field, run_dir, e.strerror)
            return DirLock(run_dir, None)
        if _same_dir(run_dir, fd):
            return DirLock(run_dir, fd)
        os.close(fd)  # the directory was removed and made again while we waited: lock the one there now
    raise RunLockedError(f"{field} {str(run_dir)!r} keeps being replaced while this run tries to lock it")


def _same_dir(run_dir: Path, fd: int) -> bool:
    try:
        now, locked = os.stat(run_dir), os.fstat(fd)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (locked.st_dev, locked.st_ino)


def _held_elsewhere(run_dir: Path, holder_of: Callable[[], dict | None], field: str, way_out: str,
                    unknown: str) -> DirLock:
    """The lock is taken: by this process (share it) or by another one (refuse, naming it once it has recorded
    itself, which it does right after locking)."""
    deadline = time.monotonic() + RECORD_WAIT_S
    holder = holder_of()
    while not holder and time.monotonic() < deadline:
        time.sleep(0.1)
        holder = holder_of()
    if is_this_process(holder):
        return DirLock(run_dir, None)
    raise RunLockedError(f"{field} {str(run_dir)!r} is in use by a live run: {describe(holder, unknown)}. Wait for "
                         f"it to finish or stop it, or {way_out}")
