"""Multi-turn episodes on a rollout rank running ahead of the learner, end to end through `msrl launch local`
(real Megatron-Core learner, real vLLM engine, the calc tool environment of configs/tool_calc.yaml).

One learner rank + one rollout rank, trainer.max_staleness 2, 4 RL steps after 20 SFT steps on the demonstrated
episodes (so the model calls the tool and episodes reach a second turn), a probe after every sync. Checks: every
step is logged with episode metrics; some episodes called the tool and took two turns; the trained tokens were
behind the training version by at most k = 2 and by more than 0 in some step (batches sampled ahead); nothing was
dropped or sampled again; every sync probe within 1e-4 (the run itself fails above it).
Run: .venv/bin/python -m pytest -q tests/e2e/test_episodes_async.py   (about 50 s here)
"""
import json
import subprocess
from pathlib import Path

import pytest

from tests.msrl import MSRL

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
K = 2


def test_episodes_run_two_versions_ahead_on_a_rollout_rank(tmp_path):
    sets = [f"logging.dir={tmp_path}", f"model.path={tmp_path / 'model'}", "launch.rollout_ranks=1",
            f"trainer.max_staleness={K}", "trainer.steps=4", "trainer.sft.max_steps=20", "trainer.sft.eval_every=20",
            "trainer.eval_every=4", "trainer.eval_prompts=8", "trainer.eval_samples=1", "checkpoint.save_every=0",
            "logging.tensorboard=false", "trainer.verify_sync_every=1", "trainer.verify_sync_tol=1e-4"]
    cmd = [*MSRL, "launch", "local", str(REPO / "configs" / "tool_calc.yaml"), "--nproc", "2", "--set", *sets]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rl = {r["step"]: r for r in records if r["phase"] == "rl"}
    assert sorted(rl) == [1, 2, 3, 4]
    print({s: {k: round(r[k], 3) for k in ("episode/turns", "episode/tool_calls", "async/staleness_mean",
                                           "async/staleness_max") if k in r} for s, r in rl.items()})
    assert max(r["episode/turns"] for r in rl.values()) > 1 and max(r["turn2/episodes"] for r in rl.values()) > 0
    assert all(0 <= r["async/staleness_max"] <= K for r in rl.values())
    assert max(r["async/staleness_mean"] for r in rl.values()) > 0
    for step in (2, 3, 4):  # step 1 is sampled synchronously (nothing was ahead yet)
        assert rl[step]["async/dropped_samples"] == 0 and rl[step]["async/resampled"] == 0
