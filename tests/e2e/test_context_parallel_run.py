"""A 2-step colocated RL run at context parallel 2 (`msrl launch local --nproc 2`, parallel.cp=2, R2 routing replay,
keep-sampling-mask under top-k/top-p): both ranks hold every row's sequences split in two, one of them samples for
both, the learner's old logprobs (renormalised over the sampled support) agree with the engine's sampling logprobs
(k1 near 0) and every update replays the recorded routes (applied fraction 1)."""
import json
import subprocess
from pathlib import Path

import pytest
from tests.msrl import MSRL

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_two_rl_steps_at_cp2(tmp_path):
    run_dir = tmp_path / "cp2"
    sets = [f"logging.dir={run_dir}", f"model.path={run_dir / 'model'}", "trainer.steps=2",
            "trainer.prompts_per_step=4", "trainer.eval_prompts=8", "trainer.eval_every=2", "trainer.sft.max_steps=2",
            "trainer.sft.eval_every=2", "trainer.sft.batch_size=8", "rollout.sampling.n=4",
            "rollout.sampling.max_tokens=6", "rollout.max_model_len=64", "logging.tensorboard=false",
            "learner.optimizer.lr=1e-3", "trainer.verify_sync_every=1", "parallel.cp=2", "routing.mode=R2",
            # keep-sampling-mask: the learner renormalises each rank's positions over the sampler's recorded support
            "rollout.sampling.temperature=0.8", "rollout.sampling.top_p=0.8", "rollout.sampling.top_k=20",
            "rollout.record_sampling_mask=true", "algorithm.keep_sampling_mask=true"]
    cmd = [*MSRL, "launch", "local", str(REPO / "configs/tiny_moe.yaml"), "--nproc", "2", "--set", *sets]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "learner TP1 PP1 CP2 EP1 DP1" in proc.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rl = {r["step"]: r for r in records if r["phase"] == "rl"}
    assert sorted(rl) == [1, 2]
    for r in rl.values():
        assert r["routing/replay_applied_fraction"] == 1.0
        assert abs(r["mismatch/k1"]) < 1e-5
