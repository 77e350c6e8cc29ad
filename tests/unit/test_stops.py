"""Stop signals (run/stops.py): the first SIGTERM / SIGINT is a request the loop polls; a second one, or the
deadline passing, ends the process at once with 128 + the signal number. Run in child processes (the handlers are
process-wide and the abandon path exits)."""
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import logging, os, signal, sys, time
    logging.basicConfig(level=logging.INFO)
    from megatron_sparse_rl.run.stops import StopSignals
    stops = StopSignals(timeout_s=float(sys.argv[1])).install()
    print("ready", flush=True)
    deadline = time.time() + 30
    while not stops.requested() and time.time() < deadline:
        time.sleep(0.01)
    print("requested", stops.name, flush=True)
    time.sleep(float(sys.argv[2]))   # the 'step in flight'
    stops.uninstall()
    print("finished", flush=True)
""")


def _child(timeout_s: float, step_s: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(timeout_s), str(step_s)], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_the_first_signal_is_a_request_the_loop_sees():
    proc = _child(timeout_s=30, step_s=0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "requested SIGTERM" in out and "finished" in out
    assert "SIGTERM received: finishing the step in flight" in err and "trainer.stop_timeout_s" in err


def test_a_second_signal_ends_the_process_at_once():
    proc = _child(timeout_s=30, step_s=20)
    proc.send_signal(signal.SIGINT)
    assert proc.stdout.readline().startswith("requested SIGINT")
    start = time.time()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGINT and time.time() - start < 10
    assert "finished" not in out and "SIGINT received again: stopping without a checkpoint" in err


def test_a_stop_that_overruns_its_deadline_is_abandoned():
    proc = _child(timeout_s=1, step_s=20)
    start = time.time()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM and time.time() - start < 10
    assert "finished" not in out and "the stop did not finish within 1 s" in err
