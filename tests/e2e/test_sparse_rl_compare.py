"""experiments/sparse_rl_compare.py end to end at toy size: three real `msrl train` arms (dense, naive sparse,
Sparse-RL) of 2 steps each from the same tiny random model (no SFT stage, no dense re-evaluation) leave one
PNG and a summary whose numbers are finite, and both sparse arms really compacted their KV caches.

    .venv/bin/python -m pytest -q tests/e2e/test_sparse_rl_compare.py      (about 1-3 min: 3 trainer starts)
"""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]


def test_three_arms_leave_a_plot_and_a_finite_summary(tmp_path):
    out = tmp_path / "compare"
    cmd = [sys.executable, str(REPO / "experiments" / "sparse_rl_compare.py"), "--out", str(out), "--steps", "2",
           "--sft-steps", "0", "--prompts-per-step", "4", "--eval-prompts", "4", "--no-dense-eval",
           "--set", "rollout.sampling.n=4"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| metric | dense | naive_sparse | sparse_rl |" in (out / "summary.md").read_text()
    arms = json.loads((out / "summary.json").read_text())["arms"]
    assert set(arms) == {"dense", "naive_sparse", "sparse_rl"}
    for name, vals in arms.items():
        assert vals["steps"] == 2, name
        for key, v in vals.items():
            assert v is None or math.isfinite(v), f"{name}.{key} = {v}"
        assert vals["reward_last"] is not None and vals["eval_acc_final_own_engine"] is not None, name
    assert arms["dense"]["kv_compressed_frac_mean"] is None  # dense engine: no kv metrics at all
    for name in ("naive_sparse", "sparse_rl"):
        assert arms[name]["kv_compressed_frac_mean"] > 0, f"{name} never compacted"
        assert arms[name]["kv_k1_after_compression_mean"] is not None
    # only the corrected arm runs the Sparse-RL rejection
    assert arms["sparse_rl"]["rejected_seq_frac_mean"] is not None
    assert arms["naive_sparse"]["rejected_seq_frac_mean"] is None
