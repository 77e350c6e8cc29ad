"""Stopping a run safely. SIGTERM (what `kill`, schedulers and torchrun's shutdown send) and SIGINT (Ctrl-C) ask
the trainer to stop at the next step boundary: the step in flight finishes, a checkpoint is written, the run says
so and exits with EXIT_STOPPED ("stopped, resumable"); running it again resumes from that checkpoint exactly as
after any other restart. The launcher's preemption file ($MSRL_PREEMPT_FILE, SLURM's USR1 notice) takes the same
path.

The stop is bounded: when the step in flight and the checkpoint have not finished `trainer.stop_timeout_s` seconds
after the first signal, or when a second signal arrives, the process gives up at once (exit 128 + the signal
number, "abandoned": the run resumes from its previous checkpoint). A stop asked for during start-up writes no
checkpoint (nothing new to save): the set-up finishes (the engine's start-up child is out of reach of a signal to
the process group: patches/vllm_registry_session.py), then the run exits with EXIT_STOPPED before its first step.

    stops = StopSignals(timeout_s=120).install()
    ...
    if stops.requested(): ...      # this process's view; training/state.py agrees it across the learner ranks
    stops.uninstall()
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading

log = logging.getLogger(__name__)

EXIT_STOPPED = 75
"""Exit code of a run that stopped on request and checkpointed: run it again to resume (sysexits' EX_TEMPFAIL)."""

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """SIGTERM / SIGINT handlers of one training process: the first signal sets a flag the loop polls at step
    boundaries and arms a watchdog; the second, or the watchdog, ends the process at once."""

    def __init__(self, *, timeout_s: float, role: str = "trainer"):
        """`role` says what a first signal does, in its log line: "trainer" (the loop checkpoints at the next step
        boundary), "starting" (set-up: the process exits before its first step) or "rollout rank"."""
        self.timeout_s = timeout_s
        self.role = role
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._watchdog: threading.Timer | None = None

    def install(self) -> "StopSignals":
        """Take over SIGTERM and SIGINT (main thread only; elsewhere, e.g. under a test runner thread, a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        """Give the signals back to their previous handlers and disarm the watchdog."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._watchdog is not None:
            self._watchdog.cancel()

    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:  # asked twice: the user wants out now
            abandon(signum, f"{signal.Signals(signum).name} received again")
        self.signum = signum
        what = {"trainer": "finishing the step in flight, then checkpointing and exiting",
                "starting": "finishing start-up, then exiting before the first step (nothing to checkpoint)",
                }.get(self.role, "waiting for the learner to checkpoint and stop this rank")
        log.warning("%s received: %s (at most %.0f s, trainer.stop_timeout_s; send it again to stop at once "
                    "without a checkpoint)", self.name, what, self.timeout_s)
        self._watchdog = threading.Timer(self.timeout_s, abandon, (signum, f"the stop did not finish within "
                                                                   f"{self.timeout_s:.0f} s (trainer.stop_timeout_s)"))
        self._watchdog.daemon = True
        self._watchdog.start()


def abandon(signum: int, why: str) -> None:
    """End the process now, without a checkpoint: the run resumes from its previous one."""
    log.error("%s: stopping without a checkpoint; running the same command again resumes from the run's newest "
              "checkpoint (steps after it are trained again)", why)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(128 + signum)
