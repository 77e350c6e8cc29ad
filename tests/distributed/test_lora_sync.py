"""Merged weight sync of a LoRA learner (weight_sync/export.py with lora/layers.py LoraParams.merged): the tensors a
sync sends are the Hugging Face model's with every adapted weight W + (alpha / r) x B A, recomputed here in float64
from the base's safetensors and the learner's adapters (within 1e-5 relative; fp32 rounding), every other tensor
the base's bit for bit, and no adapter tensor sent. Holding a bf16 engine's weights (the low-precision probe's
EngineWeights.held_by), the LoRA learner gives the logprobs of transformers on the sent weights rounded to bf16
(within 1e-4; its base holds them, its adapters are off), and its own logprobs again after. Dense Qwen3 (q/k/v
interleaved in linear_qkv, gate/up stacked in linear_fc1) and DeepSeek-V3 (MLA, a dense layer and shared experts).

    .venv/bin/python -m pytest -q tests/distributed/test_lora_sync.py
"""
from pathlib import Path

import pytest
import torch

from megatron_sparse_rl.config.lora import LoraConfig
from tests.lora_workers import lora_sync_worker
from tests.spawn import run_distributed

pytestmark = pytest.mark.distributed
TOKENS = torch.randint(3, 40, (3, 12), generator=torch.Generator().manual_seed(0))


def _build(kind: str, path) -> str:
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model
    from megatron_sparse_rl.models.tiny_families import build_tiny_deepseek

    if kind == "deepseek_v3":
        return str(build_tiny_deepseek(path, seed=3, layers=2))
    return str(build_tiny_hf_model(path, arch=kind, seed=3))


@pytest.mark.parametrize("kind, targets", [
    ("qwen3", ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    ("deepseek_v3", ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
])
def test_sync_sends_the_merged_weights(tmp_path, kind, targets):
    from safetensors.torch import load_file

    model_dir = _build(kind, tmp_path / "hf")
    lora = LoraConfig(rank=4, alpha=6.0, target_modules=targets)
    out = run_distributed(lora_sync_worker, 1, args=(model_dir, lora, TOKENS))[0]
    base = {k: v for f in sorted(Path(model_dir).glob("*.safetensors")) for k, v in load_file(f).items()}
    sent, adapters = out["sent"], out["adapters"]
    assert not [n for n in sent if "lora" in n]
    assert set(sent) <= set(base)
    merged = 0
    for name, tensor in sent.items():
        parts = name.split(".")
        leaf = parts[-2]
        if "layers" in parts and leaf in targets and ".mlp.experts." not in name:
            key = (int(parts[parts.index("layers") + 1]), "shared_expert" in name, leaf)
            a, b = adapters[(*key, "A")].double(), adapters[(*key, "B")].double()
            want = base[name].double() + (6.0 / 4) * b @ a
            assert (tensor.double() - want).abs().max() < 1e-5 * want.abs().max(), name
            assert (want - base[name].double()).abs().max() > 1e-3, name  # the adapter moved the weight
            merged += 1
        else:
            assert torch.equal(tensor, base[name].to(tensor.dtype)), name
    assert merged == len(adapters) // 2  # every adapted linear was sent merged
    _check_held_by_bf16(model_dir, sent, out, tmp_path / "held")


def _check_held_by_bf16(model_dir, sent, out, held_dir):
    """Inside held_by(bf16) the learner's logprobs are transformers' on the sent (merged) weights rounded to bf16;
    that rounding moves them (the check can fail); outside, the learner's own logprobs, exactly."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    shutil.copytree(model_dir, held_dir, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    save_file({n: t.to(torch.bfloat16).float().contiguous() for n, t in sent.items()},
              str(held_dir / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(str(held_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(TOKENS).logits[:, :-1].double()
    ref = torch.log_softmax(logits, -1).gather(-1, TOKENS[:, 1:, None])[..., 0]
    assert (out["held"].double() - ref).abs().max() < 1e-4
    assert (out["held"] - out["before"]).abs().max() > 1e-4  # bf16 rounding of the merged weights shows
    assert torch.equal(out["after"], out["before"])
