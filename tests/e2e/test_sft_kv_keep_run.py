"""Sparsity-aware SFT through `msrl train` (trainer.sft.kv_keep): a 2-step SFT stage of the digit chain on a small
tiny MoE runs, trains half of each batch under the simulated R-KV keep sets and logs the share of target tokens that
were scored from a compressed cache (metrics.jsonl and the SFT log line); `msrl validate` refuses it on a dense
engine, naming the field.

    .venv/bin/python -m pytest -q tests/e2e/test_sft_kv_keep_run.py
"""
import json
import subprocess
from pathlib import Path

import pytest
from tests.msrl import MSRL

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs/sparse_rl_chain.yaml")
SMALL = ("model.tiny.hidden=64", "model.tiny.layers=2", "model.tiny.experts=4", "model.tiny.moe_ffn=64",
         "data.chain.train_size=64", "data.chain.eval_size=8")


def test_sft_stage_trains_under_keep_sets_and_logs_the_share(tmp_path):
    run_dir = tmp_path / "run"
    sets = [f"logging.dir={run_dir}", f"model.path={tmp_path / 'model'}", *SMALL, "trainer.steps=0",
            "trainer.sft.max_steps=2", "trainer.sft.eval_every=2", "trainer.sft.batch_size=4", "trainer.eval_prompts=2",
            "trainer.eval_samples=1", "trainer.sft.kv_keep.enabled=true", "trainer.sft.kv_keep.fraction=0.5",
            "logging.tensorboard=false"]
    proc = subprocess.run([*MSRL, "train", CONFIG, "--set", *sets], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    sft = [r for r in records if r["phase"] == "sft"]
    assert sft, records
    # 88-token rows (7 prompt tokens), budget 40 + interval 4: compactions at 44, 48, ..., 84, so the targets scored
    # by the queries at positions 44..86 (43 of 81 per masked row) saw the compressed cache; half the rows were masked
    last = sft[-1]
    assert last["sft/kv_masked_rows_frac"] == 0.5
    assert last["sft/kv_compactions_per_masked_row"] == 11.0
    assert abs(last["sft/kv_compressed_target_frac"] - 0.5 * 43 / 81) < 1e-9
    assert "targets from a compressed cache 0.27" in proc.stdout + proc.stderr


def test_validate_refuses_it_on_a_dense_engine_naming_the_field():
    proc = subprocess.run([*MSRL, "validate", CONFIG, "--set", "trainer.sft.kv_keep.enabled=true",
                           "rollout.kv.policy=none"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "trainer.sft.kv_keep.enabled" in proc.stderr and "rollout.kv.policy is 'none'" in proc.stderr
