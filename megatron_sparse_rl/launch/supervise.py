"""Run a local launch (torchrun) as a child that hears stop signals only through us, so a stop is one orderly
stop: the first SIGTERM / SIGINT is forwarded to torchrun as SIGTERM (torchrun passes it to every rank and waits up to
its --shutdown-timeout for them to checkpoint and exit); a second one goes to every process of the launch, which then
end at once. The exit code says what happened: the ranks' stop record newer than the launch (training/state.py
`record_stop`) means "stopped, resumable" (EXIT_STOPPED), whatever torchrun itself returned.

    rc = supervise(cmd, run_dir=Path(run.logging.dir))
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from megatron_sparse_rl.training.state import STOP_RECORD
from megatron_sparse_rl.run.stops import EXIT_STOPPED, SIGNALS


def supervise(cmd: list[str], *, run_dir: Path) -> int:
    """Run `cmd` in a session of its own, forwarding stop signals; its exit code, or EXIT_STOPPED when the run
    recorded a stop during this launch."""
    started = time.time()
    proc = subprocess.Popen(cmd, start_new_session=True)
    received: list[int] = []

    def forward(signum, frame):
        received.append(signum)
        if len(received) == 1:
            print(f"msrl: {signal.Signals(signum).name} received: asking the ranks to checkpoint and stop "
                  "(send it again to stop at once)", file=sys.stderr, flush=True)
            proc.send_signal(signal.SIGTERM)
        else:
            _signal_tree(proc.pid, signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in SIGNALS}
    try:
        rc = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    record = _stop_record(run_dir, since=started)
    if record is not None:
        saved = (f"checkpoint {record['checkpoint']}" if record.get("checkpoint")
                 else "no new checkpoint (stopped before the first step)")
        print(f"msrl: the run stopped ({record.get('stopped')}) at {record.get('at')}; {saved}; run the same "
              "command again to resume", file=sys.stderr, flush=True)
        return EXIT_STOPPED
    return rc


def _signal_tree(pid: int, sig: int) -> None:
    """`sig` to `pid` and every process under it (torchrun starts its ranks in sessions of their own)."""
    import psutil

    try:
        root = psutil.Process(pid)
        victims = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for victim in victims:
        try:
            victim.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def _stop_record(run_dir: Path, *, since: float) -> dict | None:
    """The run's stop record when it was written after `since`, else None."""
    path = run_dir / STOP_RECORD
    try:
        if path.stat().st_mtime < since:
            return None
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
