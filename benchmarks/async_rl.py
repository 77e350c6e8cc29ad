"""Asynchronous RL against the synchronous loop: the same run, once with trainer.max_staleness 0 and once with 1.

    msrl bench async [--config configs/async_tiny_moe.yaml --steps 16 --set trainer.prompts_per_step=32 ...]
    .venv/bin/python benchmarks/async_rl.py [same options]

Each run is `msrl launch local CONFIG --nproc 2` on one learner rank + one rollout rank (launch.rollout_ranks 1),
the same model, seeds, SFT warm-start and prompts; only trainer.max_staleness differs. From each run's
metrics.jsonl, over the RL steps after the first (the first step of a run cannot overlap anything) and before the
last (which also evaluates):
- steps/s from the records' wall-clock times, and `async/sync steps/s = X`;
- per-phase seconds per role: the learner rank trains, syncs and waits for its batch (synchronous: the whole
  rollout; asynchronous: what the rollout rank had not finished when training and sync were done); the rollout rank
  generates, loads weights and idles (synchronous: while the learner trains and syncs; asynchronous: waiting for
  the weights after it finished sampling);
- how the runs learn: mean reward over the last five RL steps and held-out accuracy at the end (a fixed short run:
  the two should agree within the run-to-run noise; a batch sampled one version behind is an off-policy batch).
The config should make generation and training take comparable time (the overlap can at best hide the shorter
of the two); `configs/async_tiny_moe.yaml` is sized for that on a 2-core CPU machine.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron_sparse_rl.config.checks import positive

REPO = Path(__file__).resolve().parents[1]
LAST = 5  # RL steps whose mean reward is printed


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=str(REPO / "configs" / "async_tiny_moe.yaml"))
    p.add_argument("--steps", type=positive(), default=16, help="RL steps per run (>= 4)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides for both runs")
    p.add_argument("--timeout", type=positive(), default=1800, help="seconds before a run is killed")


def _launch(args, tmp: Path, staleness: int) -> list[dict]:
    run_dir = tmp / f"max_staleness_{staleness}"
    sets = [f"logging.dir={run_dir}", f"model.path={tmp / 'model'}", "launch.rollout_ranks=1",
            f"trainer.max_staleness={staleness}", f"trainer.steps={args.steps}", "trainer.eval_every=0",
            "checkpoint.save_every=0", "logging.tensorboard=false", *args.set]
    cmd = [sys.executable, "-m", "megatron_sparse_rl.tools.cli", "launch", "local", args.config, "--nproc", "2",
           "--set", *sets]
    print(f"running trainer.max_staleness={staleness} ({args.steps} RL steps) ...", flush=True)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode:
        raise SystemExit(f"error: the max_staleness={staleness} run failed (exit {proc.returncode}); its log: "
                         f"{run_dir / 'logs'}\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summarise(records: list[dict]) -> dict[str, float]:
    """Steps/s and mean per-phase seconds over the RL steps after the first and before the last; the learning
    numbers of the whole run."""
    rl = sorted((r for r in records if r["phase"] == "rl"), key=lambda r: r["step"])
    middle = rl[1:-1]
    mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in middle)  # noqa: E731
    train, sync, generate = mean("time/train_s"), mean("time/sync_s"), mean("time/rollout_s")
    asynchronous = "async/learner_wait_s" in middle[-1]
    return {
        "steps_per_s": (len(middle) - 1) / (middle[-1]["time"] - middle[0]["time"]),
        "train_s": train, "sync_s": sync, "generate_s": generate,
        "learner_wait_s": mean("async/learner_wait_s") if asynchronous else generate,
        "load_s": mean("async/engine_load_s"),
        "rollout_idle_s": mean("async/engine_wait_s") if asynchronous else train + sync,
        "in_flight": mean("async/in_flight_update"), "stale_frac": mean("async/stale_frac"),
        "reward_last": statistics.fmean(r["rollout/reward"] for r in rl[-LAST:]),
        "accuracy": rl[-1].get("eval/accuracy", float("nan")),
    }


def _line(label: str, s: dict[str, float]) -> str:
    return (f"{label}: {1 / s['steps_per_s']:.3f} s/step; learner rank: train {s['train_s']:.3f} s, sync "
            f"{s['sync_s']:.3f} s, waiting for the batch {s['learner_wait_s']:.3f} s; rollout rank: generate "
            f"{s['generate_s']:.3f} s, load weights {s['load_s']:.3f} s, idle {s['rollout_idle_s']:.3f} s")


def run(args: argparse.Namespace) -> int:
    if args.steps < 4:
        raise SystemExit(f"error: --steps must be >= 4 (the first and last steps are not timed; got {args.steps})")
    tmp = Path(tempfile.mkdtemp(prefix="msrl_bench_async_"))  # kept when a run fails: its logs are there
    sync, asyn = (summarise(_launch(args, tmp, k)) for k in (0, 1))
    shutil.rmtree(tmp, ignore_errors=True)
    print(_line("synchronous  (max_staleness 0)", sync))
    print(_line("asynchronous (max_staleness 1)", asyn))
    print(f"asynchronous: weights arrived while sampling in {asyn['in_flight']:.0%} of the steps; "
          f"{asyn['stale_frac']:.0%} of the trained tokens were one version behind")
    print(f"learning over {args.steps} RL steps: mean reward of the last {LAST} steps sync {sync['reward_last']:.3f}, "
          f"async {asyn['reward_last']:.3f}; held-out accuracy at the end sync {sync['accuracy']:.3f}, "
          f"async {asyn['accuracy']:.3f}")
    print(f"async/sync steps/s = {asyn['steps_per_s'] / sync['steps_per_s']:.2f}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
