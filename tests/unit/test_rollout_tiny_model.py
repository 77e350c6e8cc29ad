"""The character tokenizer and the tiny HF model builder, checked with transformers (no vLLM)."""
import json

import pytest
import torch

from megatron_sparse_rl.models import char_tokenizer as char_tok
from megatron_sparse_rl.models.tiny import build_tiny_hf_model


def test_tokenizer_round_trip(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(char_tok.build_tokenizer(tmp_path / "tok"))
    assert len(tok) == char_tok.vocab_size() == 64
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (char_tok.PAD_ID, char_tok.BOS_ID, char_tok.EOS_ID)
    text = "q: 12+7=?\na: 19"
    ids = tok(text)["input_ids"]
    assert ids[0] == char_tok.BOS_ID and len(ids) == len(text) + 1  # one id per character after <bos>
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.convert_ids_to_tokens(ids[1:4]) == ["q", ":", " "]


@pytest.mark.parametrize("arch, cls_name", [("qwen3_moe", "Qwen3MoeForCausalLM"), ("qwen3", "Qwen3ForCausalLM")])
def test_tiny_model_dir_loads_in_transformers(tmp_path, arch, cls_name):
    from transformers import AutoModelForCausalLM

    path = build_tiny_hf_model(tmp_path / arch, arch=arch, seed=0)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [cls_name] and config["vocab_size"] == char_tok.vocab_size()
    assert {"model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {
        p.name for p in path.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert type(model).__name__ == cls_name
    logits = model(torch.tensor([[1, 5, 6]])).logits
    assert logits.shape == (1, 3, char_tok.vocab_size()) and torch.isfinite(logits).all()


def test_seed_changes_weights_not_names(tmp_path):
    from safetensors.torch import load_file

    a = load_file(build_tiny_hf_model(tmp_path / "a", seed=0) / "model.safetensors")
    b = load_file(build_tiny_hf_model(tmp_path / "b", seed=1) / "model.safetensors")
    c = load_file(build_tiny_hf_model(tmp_path / "c", seed=0) / "model.safetensors")
    assert a.keys() == b.keys() and any("experts.3.down_proj" in k for k in a)
    assert not torch.equal(a["lm_head.weight"], b["lm_head.weight"])
    assert all(torch.equal(a[k], c[k]) for k in a)


def test_bad_head_dim_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="head_dim must be one of"):
        build_tiny_hf_model(tmp_path / "x", head_dim=48)
