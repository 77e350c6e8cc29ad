"""Every configs/sparse_rl_*.yaml that enables the Sparse-RL correction aggregates the loss as Sparse-RL
prescribes: seq-mean-token-mean over the kept mask (shared/references.md, Sparse-RL 2601.10079).

    .venv/bin/python -m pytest -q tests/unit/test_sparse_rl_configs.py
"""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_sparse_rl.config import load_config

ROOT = Path(__file__).resolve().parents[2]
SPARSE_RL_CONFIGS = sorted((ROOT / "configs").glob("sparse_rl_*.yaml"))


def test_there_are_sparse_rl_configs():
    assert {"sparse_rl_compare.yaml", "sparse_rl_scratchpad.yaml", "sparse_rl_tiny_moe.yaml"} <= {
        p.name for p in SPARSE_RL_CONFIGS}


@pytest.mark.parametrize("path", SPARSE_RL_CONFIGS, ids=[p.name for p in SPARSE_RL_CONFIGS])
def test_sparse_rl_configs_aggregate_seq_mean_token_mean(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # model paths in configs/ are relative to the repository root
    algorithm = load_config(path).algorithm
    if algorithm.corrections.sparse_rl.enabled:
        assert algorithm.loss.aggregation == "seq_mean_token_mean", path.name
    # the baseline arms (--set algorithm.corrections.sparse_rl.enabled=false) keep the file's aggregation
    off = load_config(path, ["algorithm.corrections.sparse_rl.enabled=false"]).algorithm
    assert off.loss.aggregation == algorithm.loss.aggregation
