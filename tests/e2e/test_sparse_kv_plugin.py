"""Sparse KV in a multi-process vLLM: the engine core runs in a SPAWNED process, which gets the runner hooks
only through the `vllm.general_plugins` entry point (setup.py). Its sampled tokens and logprobs must equal
the in-process sparse engine's (same seed) and differ from the dense engine's; with the plugin excluded
(VLLM_PLUGINS) the engine refuses to start instead of silently ignoring the compactions.
Run: .venv/bin/python -m pytest -q tests/e2e/test_sparse_kv_plugin.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys
from megatron_sparse_rl.config.rollout import KVConfig, RolloutConfig
from megatron_sparse_rl.kv.engine_extension import SparseKV
from vllm import LLM, SamplingParams, TokensPrompt

model_dir, results = sys.argv[1], {}
for policy in sys.argv[2:]:
    cfg = RolloutConfig(max_model_len=256, max_num_seqs=4, kv_cache_gb=1,
                        kv=KVConfig(policy=policy, budget=24, interval=16, window=8, block_size=32))
    extra = SparseKV().engine_args(cfg) if policy != "none" else {}
    llm = LLM(model=model_dir, dtype="float32", seed=0, enforce_eager=True, max_model_len=256, max_num_seqs=4,
              enable_prefix_caching=False, block_size=32, distributed_executor_backend="uni", **extra)
    params = SamplingParams(temperature=1.0, max_tokens=64, seed=7, ignore_eos=True, logprobs=0)
    prompts = [TokensPrompt(prompt_token_ids=[1] + [5 + (3 * j) % 30 for j in range(20)])]
    out = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0]
    logprobs = [step[t].logprob for t, step in zip(out.token_ids, out.logprobs)]
    results[policy] = {"tokens": list(out.token_ids), "logprobs": logprobs}
    del llm
print("RESULT " + json.dumps(results))
"""


def run(model_dir, policies: list[str], tmp_path, multiprocess: bool, **env_extra) -> subprocess.CompletedProcess:
    from megatron_sparse_rl.rollout.engine_setup import shared_cache_dir

    # the runs' shared vLLM cache: a warm one spares each engine start vLLM's registry inspection child
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocess else "0",
               VLLM_WORKER_MULTIPROC_METHOD="spawn", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_CACHE_ROOT=str(shared_cache_dir()), OMP_NUM_THREADS="1", **env_extra)
    return subprocess.run([sys.executable, "-c", SCRIPT, str(model_dir), *policies], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def generate(model_dir, policies: list[str], tmp_path, multiprocess: bool) -> dict:
    proc = run(model_dir, policies, tmp_path, multiprocess)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_entry_point_is_what_vllm_loads():
    from vllm.plugins import load_plugins_by_group

    from megatron_sparse_rl.kv import vllm_plugin

    assert load_plugins_by_group("vllm.general_plugins")["msrl_sparse_kv"] is vllm_plugin.plugin


def test_spawned_engine_core_compacts_like_the_in_process_engine(tmp_path):
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    model_dir = build_tiny_hf_model(tmp_path / "moe", seed=0)
    spawned = generate(model_dir, ["streamingllm"], tmp_path, multiprocess=True)["streamingllm"]
    local = generate(model_dir, ["streamingllm", "none"], tmp_path, multiprocess=False)
    local, dense = local["streamingllm"], local["none"]
    assert spawned["tokens"] == local["tokens"]
    assert max(abs(a - b) for a, b in zip(spawned["logprobs"], local["logprobs"])) < 1e-5
    # 21 prompt + 64 new tokens pass budget + interval = 40: the sparse run must differ from dense
    assert spawned["tokens"] != dense["tokens"] or \
        max(abs(a - b) for a, b in zip(spawned["logprobs"], dense["logprobs"])) > 1e-3


@pytest.mark.slow  # `make test-all` only (51 s on the 2-core CI machine): a spawned engine core without the plugin
def test_spawned_engine_core_without_the_plugin_refuses_to_start(tmp_path):
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    model_dir = build_tiny_hf_model(tmp_path / "moe", seed=0)
    proc = run(model_dir, ["streamingllm"], tmp_path, multiprocess=True, VLLM_PLUGINS="some_other_plugin")
    assert proc.returncode != 0
    assert "model-runner hooks are not installed in this vLLM process" in proc.stderr
