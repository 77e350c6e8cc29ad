"""A run whose training diverges stops at the first non-finite gradient norm or loss (training/steps.py), with a
message naming the step and the quantity, exit 2 and no traceback, and writes neither hf_final nor a checkpoint
after that step (real Megatron-Core learner and vLLM engine, tiny MoE; about a minute on two CPU cores).

    .venv/bin/python -m pytest -q tests/e2e/test_nonfinite_stop.py
"""
import json
import subprocess
from pathlib import Path

import pytest
from tests.msrl import MSRL

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def test_a_diverging_run_stops_at_the_first_nan_without_exporting_or_checkpointing(tmp_path):
    run_dir = tmp_path / "run"
    # lr 1e20: step 1's update leaves finite but huge weights (checkpointed), step 2's gradients overflow. Partial
    # credit and a format penalty give the untrained model's samples different rewards, hence gradients.
    sets = [f"logging.dir={run_dir}", f"model.path={tmp_path / 'model'}", "trainer.steps=3",
            "trainer.prompts_per_step=4", "trainer.eval_prompts=4", "trainer.eval_every=0", "trainer.sft.max_steps=0",
            "rollout.sampling.n=4", "rollout.sampling.max_tokens=4", "rollout.max_model_len=64",
            "checkpoint.save_every=1", "logging.tensorboard=false", "learner.optimizer.lr=1e20",
            "reward.partial_credit=0.5", "reward.format_penalty=0.5"]
    proc = subprocess.run([*MSRL, "train", str(REPO / "configs/tiny_moe.yaml"), "--set",
                           *sets], cwd=REPO, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 2, proc.stderr[-3000:]
    error = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(error) == 1 and error[0].startswith("error: RL step 2: ") and " is nan" in error[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (run_dir / "hf_final").exists() and not (run_dir / ".hf_final.tmp").exists()
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000001_sft_000000"]  # none after the NaN step
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["phase"] == "rl"]
    assert steps == [1]
