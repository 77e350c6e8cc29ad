"""Smoke runs of the commands README.md and docs show that no feature test runs already (tests/unit/test_doc_commands.py
SMOKES names them): each `msrl bench` kind at a tiny size, `msrl convert` both ways through the CLI, the plot module,
the local SLURM helper's usage line, and the calc tool control experiment. A smoke checks that the command runs to
its end and prints what the docs say it prints; the numbers are the commands' own to report. The ones over ~30 s
here are `slow` (make test-all); every name the scripts import, at any depth, resolves in make test
(tests/unit/test_imports_resolve.py), the way `msrl bench kv` once broke.

    .venv/bin/python -m pytest -q tests/e2e/test_doc_command_smokes.py
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tests.msrl import MSRL

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e
NUMBER = r"[0-9]+(?:\.[0-9]+)?"


def _run(cmd: list[str], timeout: float = 600, **kw) -> str:
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, **kw)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.parametrize("arch", ["qwen3_moe", pytest.param("deepseek_v3", marks=pytest.mark.slow)])
def test_msrl_bench_kv(arch):
    out = _run([*MSRL, "bench", "kv", "--arch", arch, "--prompts", "2", "--max-tokens", "48", "--budget", "16",
                "--interval", "16", "--pool-prompts", "3", "--pool-max-tokens", "48", "--pool-seqs", "1",
                "--prompt-len", "16"])
    assert ("multi-head latent attention" in out) == (arch == "deepseek_v3"), out
    assert re.search(rf"peak KV blocks in use \(vLLM BlockPool\): dense \d+, sparse \d+; sparse/dense = {NUMBER}", out), out
    assert re.search(rf"sequences that fit at their worst case: dense \d+, sparse \d+; sparse/dense = {NUMBER}", out), out
    assert len(re.findall(rf"tokens/s: dense {NUMBER}, sparse {NUMBER}; sparse/dense = {NUMBER}", out)) == 2, out


@pytest.mark.slow
def test_msrl_bench_sync():
    out = _run([*MSRL, "bench", "sync", "--mode", "colocated", "--hidden", "64", "--layers", "2", "--experts", "4",
                "--moe-ffn", "64", "--heads", "2", "--kv-heads", "1", "--repeats", "1"])
    assert re.search(rf"colocated: +sync .* / plain copy .* = {NUMBER};", out), out


def test_msrl_bench_routing():
    out = _run([*MSRL, "bench", "routing", "--hidden", "64", "--layers", "2", "--experts", "4", "--topk", "2",
                "--seq", "32", "--batch", "4", "--pairs", "1"])
    assert re.search(rf"with R2 replay / without, over 1 pairs: median {NUMBER}", out), out
    assert re.search(rf"route storage: {NUMBER} bytes/token packed", out), out


@pytest.mark.slow
def test_bench_convert_as_msrl_and_as_a_script():
    """`msrl bench convert` runs; `python benchmarks/convert.py` is the same module's entry (its options parsed)."""
    out = _run([*MSRL, "bench", "convert", "--hidden", "64", "--layers", "2", "--experts", "4", "--moe-ffn", "64"])
    for direction in ("hf-to-mcore", "mcore-to-hf"):
        assert re.search(rf"{direction}: +{NUMBER} GB/s  ratio {NUMBER} of raw", out), out
    assert "--moe-ffn" in _run([sys.executable, "benchmarks/convert.py", "--help"], timeout=120)


@pytest.mark.slow
def test_msrl_bench_async():
    out = _run([*MSRL, "bench", "async", "--steps", "4", "--staleness", "0,1", "--set", "trainer.sft.max_steps=0",
                "trainer.prompts_per_step=4", "trainer.eval_prompts=8"], timeout=1500)
    assert re.search(r"async/sync steps/s = " + NUMBER, out), out


def test_msrl_convert_both_ways_with_verify(tmp_path):
    """The CLI round trip at one rank: the HF tensors that come back equal the original ones bit for bit."""
    import torch
    from safetensors.torch import load_file

    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    hf = build_tiny_hf_model(tmp_path / "hf", seed=0)
    _run([*MSRL, "convert", "hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "mc"), "--verify"])
    _run([*MSRL, "convert", "mcore-to-hf", "--mcore", str(tmp_path / "mc"), "--out", str(tmp_path / "back"),
          "--verify"])

    def tensors(d: Path) -> dict[str, torch.Tensor]:
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(f).items()}

    original, back = tensors(Path(hf)), tensors(tmp_path / "back")
    assert original.keys() == back.keys()
    assert all(torch.equal(original[k], back[k]) for k in original)


def test_msrl_convert_merge_lora(tmp_path):
    """`msrl convert merge-lora` on a hand-written PEFT adapter (q_proj and o_proj of every layer): each adapted weight
    is W + (alpha/r) B A recomputed in float64 (within 1e-6), every other tensor is the base's bit for bit, and an
    adapter recorded for another base exits 2 naming base_sha256. (Bit-exactness against PEFT's merge_and_unload:
    tests/distributed/test_lora_checkpoint.py, tests/unit/test_lora_merge.py.)"""
    import torch
    from safetensors.torch import load_file, save_file

    from megatron_sparse_rl.lora.checkpoint import base_digest
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    hf = Path(build_tiny_hf_model(tmp_path / "hf", seed=0))
    base = {k: v for f in sorted(hf.glob("*.safetensors")) for k, v in load_file(f).items()}
    g = torch.Generator().manual_seed(0)
    adapter, names = {}, [k for k in base if k.endswith(("self_attn.q_proj.weight", "self_attn.o_proj.weight"))]
    for name in names:
        module = "base_model.model." + name.removesuffix(".weight")
        adapter[f"{module}.lora_A.weight"] = torch.randn(4, base[name].shape[1], generator=g)
        adapter[f"{module}.lora_B.weight"] = torch.randn(base[name].shape[0], 4, generator=g)
    (tmp_path / "ad").mkdir()
    save_file(adapter, str(tmp_path / "ad" / "adapter_model.safetensors"))
    (tmp_path / "ad" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 6}))
    (tmp_path / "ad" / "base_model.json").write_text(json.dumps({"base_sha256": base_digest(hf)}))

    out = _run([*MSRL, "convert", "merge-lora", "--base", str(hf), "--adapter", str(tmp_path / "ad"), "--out",
                str(tmp_path / "merged")])
    assert "merged" in out, out
    merged = {k: v for f in sorted((tmp_path / "merged").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert merged.keys() == base.keys() and len(names) >= 2
    for key, w in base.items():
        if key in names:
            module = "base_model.model." + key.removesuffix(".weight")
            a, b = adapter[f"{module}.lora_A.weight"].double(), adapter[f"{module}.lora_B.weight"].double()
            want = w.double() + 1.5 * b @ a
            assert (merged[key].double() - want).abs().max() < 1e-6 * want.abs().max(), key
        else:
            assert torch.equal(merged[key], w), key

    (tmp_path / "ad" / "base_model.json").write_text(json.dumps({"base_sha256": "0" * 64}))
    proc = subprocess.run([*MSRL, "convert", "merge-lora", "--base", str(hf), "--adapter", str(tmp_path / "ad"),
                           "--out", str(tmp_path / "m2")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "base_sha256" in proc.stderr, proc.stderr


def test_plot_module_writes_a_png(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "phase": "rl", "reward/mean": 0.1 * s, "eval/accuracy": 0.05 * s} for s in range(1, 5)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "m.png"
    _run([sys.executable, "-m", "megatron_sparse_rl.observability.plot", str(metrics), str(out)], timeout=120)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_local_slurm_usage():
    """Without `up DIR` it prints its usage and exits 2 (the cluster itself: tests/e2e/test_slurm.py)."""
    proc = subprocess.run([sys.executable, "-m", "megatron_sparse_rl.launch.local_slurm"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "usage: python -m megatron_sparse_rl.launch.local_slurm up DIR" in proc.stderr


@pytest.mark.slow
def test_tool_calc_control_runs_both_arms(tmp_path):
    """On an untrained tiny model of the config's shape: both arms print their line (accuracy is the model's)."""
    from megatron_sparse_rl.config import load_config
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model
    from megatron_sparse_rl.models.tiny_config import tiny_fields

    run = load_config(REPO / "configs/tool_calc.yaml")
    model = build_tiny_hf_model(tmp_path / "model", arch=run.model.tiny.arch, **tiny_fields(run.model.tiny))
    out = _run([sys.executable, "experiments/tool_calc_control.py", "configs/tool_calc.yaml", str(model),
                "--samples", "1", "--set", f"logging.dir={tmp_path / 'run'}"])
    for arm in ("calc", "tool error"):
        assert re.search(rf"^{arm}: accuracy {NUMBER} over 64 episodes \(64 held-out prompts x 1\), tool calls/episode "
                         rf"{NUMBER}, tool errors/episode {NUMBER}", out, re.M), out
