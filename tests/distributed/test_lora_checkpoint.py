"""Adapter checkpoints (lora/checkpoint.py) in Hugging Face PEFT's format: the directory a TP1 LoRA learner saves
loads with transformers + `PeftModel.from_pretrained` and gives the learner's logprobs within 1e-4; a resume gives
the saved logprobs and, after more steps, the adapters of the run that did not stop (Adam state, step and LR schedule
restored); an adapter is refused on a base whose manifest digest differs, naming both digests. The run loop's torch_dist
checkpoint resumes a LoRA learner exactly, at tp 1 and tp 2.

The PEFT test adapts attention and the dense MLP of a dense Qwen3, a target set that PEFT 0.21 maps onto the same
modules (on transformers 5 MoE models it remaps gate/up/down_proj onto the fused routed experts).

    .venv/bin/python -m pytest -q tests/distributed/test_lora_checkpoint.py
"""
import json
from pathlib import Path

import pytest
import torch

from megatron_sparse_rl.config.lora import LoraConfig
from tests.lora_workers import lora_resume_worker, lora_save_worker
from tests.spawn import run_distributed

pytestmark = pytest.mark.distributed
peft = pytest.importorskip("peft", reason="Hugging Face PEFT is the reference: pip install -e .[test]")

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOKENS = torch.randint(3, 40, (4, 14), generator=torch.Generator().manual_seed(0))


def _model(path, seed=3):
    from megatron_sparse_rl.models.tiny import build_tiny_hf_model

    return str(build_tiny_hf_model(path, arch="qwen3", seed=seed))


def _hf_logprobs(model) -> torch.Tensor:
    with torch.no_grad():
        logits = model(TOKENS).logits[:, :-1].double()
    return torch.log_softmax(logits, -1).gather(-1, TOKENS[:, 1:, None])[..., 0]


def test_saved_adapter_loads_in_peft_with_the_same_logprobs(tmp_path):
    from transformers import AutoModelForCausalLM

    from megatron_sparse_rl.lora.checkpoint import CONFIG, WEIGHTS

    model_dir = _model(tmp_path / "hf")
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=TARGETS)
    out = run_distributed(lora_save_worker, 1, args=(model_dir, TOKENS, lora, str(tmp_path / "adapter"), 0, 0))[0]
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json",
                                                                        "adapter_model.safetensors",
                                                                        "base_model.json"]
    assert not list(tmp_path.glob(".adapter*"))  # the temporary directory was renamed
    assert json.loads((tmp_path / "adapter" / CONFIG).read_text())["r"] == 4

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    plain = _hf_logprobs(base)
    model = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "adapter" / WEIGHTS))
    held = {n.replace(".default", ""): p for n, p in model.named_parameters() if "lora_" in n}
    assert set(held) == set(saved) and len(saved) == 2 * 2 * len(TARGETS)  # PEFT placed every tensor
    for key, value in saved.items():
        assert torch.equal(held[key], value), key
    ref = _hf_logprobs(model)
    assert (ref - plain).abs().max() > 1e-3  # the adapters change the logprobs
    assert (out["logprobs"].double() - ref).abs().max() < 1e-4


def test_resume_is_exact_and_another_base_is_refused(tmp_path):
    from megatron_sparse_rl.lora.checkpoint import load_adapter

    model_dir = _model(tmp_path / "hf")
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
    path = str(tmp_path / "adapter")
    straight = run_distributed(lora_save_worker, 1, args=(model_dir, TOKENS, lora, path, 2, 2))[0]
    resumed = run_distributed(lora_resume_worker, 1, args=(model_dir, TOKENS, lora, path, 2))[0]
    assert torch.equal(resumed["logprobs"], straight["logprobs"])  # save -> load: the same logprobs
    assert resumed["step"] == straight["step"] == 4
    for name, value in straight["adapters"].items():
        assert torch.equal(resumed["adapters"][name], value), name  # Adam state and schedule restored exactly

    other = _model(tmp_path / "other", seed=4)
    with pytest.raises(ValueError, match=r"base_sha256 [0-9a-f]{64} .* manifest sha256 [0-9a-f]{64}"):
        load_adapter(path, None, other)


def test_merged_export_equals_peft_merge_and_unload(tmp_path):
    """`merge_adapter` (msrl convert merge-lora) of a learner-saved adapter against PEFT's `merge_and_unload` of the
    same adapter loaded with `PeftModel.from_pretrained` (dense Qwen3, which PEFT maps as saved): every tensor bit for
    bit, and the merged model's logprobs are the learner's within 1e-4. A base of other weights is refused."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from megatron_sparse_rl.lora.merge import merge_adapter

    model_dir = _model(tmp_path / "hf")
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=TARGETS)
    adapter = str(tmp_path / "adapter")
    out = run_distributed(lora_save_worker, 1, args=(model_dir, TOKENS, lora, adapter, 0, 0))[0]
    merged_dir = merge_adapter(model_dir, adapter, tmp_path / "merged")

    merged = {k: v for f in sorted(merged_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
    ref = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                         adapter).merge_and_unload()
    ref_sd = ref.state_dict()
    original = {k: v for f in sorted(Path(model_dir).glob("*.safetensors"))
                for k, v in load_file(f).items()}
    assert merged.keys() == original.keys()
    changed = [k for k in merged if not torch.equal(merged[k], original[k])]
    assert len(changed) == 2 * len(TARGETS)  # every adapted weight of both layers, nothing else
    for key, value in merged.items():
        assert torch.equal(value, ref_sd[key]), key
    model = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32)
    assert (out["logprobs"].double() - _hf_logprobs(model)).abs().max() < 1e-4

    with pytest.raises(ValueError, match="base_sha256"):
        merge_adapter(_model(tmp_path / "other", seed=4), adapter, tmp_path / "merged2")
    assert not (tmp_path / "merged2").exists()


def test_run_loop_learner_checkpoint_resumes_a_lora_learner_exactly(tmp_path):
    """The run loop's own checkpoint (learner/checkpoint.py save_learner/load_learner, torch_dist: the frozen base,
    the adapters and their Adam state) of a LoRA learner: the same logprobs after the load, and two steps on, the
    adapters of the run that did not stop, bit for bit; likewise from the adapter-only copy it holds in adapter/."""
    model_dir = _model(tmp_path / "hf")
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
    path = str(tmp_path / "ckpt")
    straight = run_distributed(lora_save_worker, 1, args=(model_dir, TOKENS, lora, path, 2, 2, "learner"))[0]
    resumed = run_distributed(lora_resume_worker, 1, args=(model_dir, TOKENS, lora, path, 2, "learner"))[0]
    assert torch.equal(resumed["logprobs"], straight["logprobs"])
    assert resumed["step"] == straight["step"] == 4
    for name, value in straight["adapters"].items():
        assert torch.equal(resumed["adapters"][name], value), name
    # the same checkpoint holds the adapters alone (PEFT's format, the base's digest), also resuming exactly
    alone = run_distributed(lora_resume_worker, 1, args=(model_dir, TOKENS, lora, f"{path}/adapter", 2))[0]
    assert torch.equal(alone["logprobs"], straight["logprobs"]) and alone["step"] == 4
    for name, value in straight["adapters"].items():
        assert torch.equal(alone["adapters"][name], value), name


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_run_loop_learner_checkpoint_resumes_a_tp2_or_pp2_lora_learner_exactly(tmp_path, tp, pp):
    """At tensor parallel 2 (sequence parallel) the torch_dist checkpoint holds each split adapter as its tp shards
    (lora/layers.py `_shard_split_adapters`); at pipeline parallel 2 each stage its layers' adapters. A resume in the
    same layout gives the logprobs at save and, two steps on, the adapters of the run that did not stop, bit for
    bit; its adapter/ copy holds every adapter whole (the whole shapes of the Hugging Face modules)."""
    from safetensors.torch import load_file

    from megatron_sparse_rl.lora.checkpoint import WEIGHTS

    model_dir = _model(tmp_path / "hf")
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"))
    path = str(tmp_path / "ckpt")
    straight = run_distributed(lora_save_worker, 2, args=(model_dir, TOKENS, lora, path, 2, 2, "learner", tp, pp))
    resumed = run_distributed(lora_resume_worker, 2, args=(model_dir, TOKENS, lora, path, 2, "learner", tp, pp))
    for s, r in zip(straight, resumed):
        assert torch.equal(r["logprobs"], s["logprobs"]) and r["step"] == s["step"] == 4
        for name, value in s["adapters"].items():
            assert torch.equal(r["adapters"][name], value), name
    shapes = {k: tuple(v.shape) for k, v in load_file(f"{path}/adapter/{WEIGHTS}").items()}
    assert len(shapes) == len(set().union(*(s["adapters"] for s in straight)))  # every stage's
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    q, ffn = cfg["num_attention_heads"] * cfg["head_dim"], cfg["intermediate_size"]
    layer0 = "base_model.model.model.layers.0."
    assert shapes[f"{layer0}self_attn.q_proj.lora_B.weight"] == (q, 4)  # split over tp: whole here
    assert shapes[f"{layer0}self_attn.o_proj.lora_A.weight"] == (4, q)
    assert shapes[f"{layer0}mlp.gate_proj.lora_B.weight"] == (ffn, 4)
    assert shapes[f"{layer0}mlp.down_proj.lora_A.weight"] == (4, ffn)
