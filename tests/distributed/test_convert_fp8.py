"""A block-wise fp8 DeepSeek-V3-style release checkpoint with a multi-token-prediction layer through
`hf_to_mcore` and back through `mcore_to_hf` (one rank, tp=ep=1): the export holds exactly the model's tensors
(no `_scale_inv`, no MTP layer), the quantised ones equal to the float64 block dequantisation of
`tests/unit/test_fp8_import.py` rounded to float32 and the others bit-exact; its config.json has no
quantization_config and num_nextn_predict_layers 0; both directions log what they skipped or changed. The same for a
tiny fp8 DeepSeek-V3.2 release (DSA: the indexer's wq_b and wk fp8, its rows reordered on import and put back on
export), whose export is also verified against transformers.

Run: .venv/bin/python -m pytest -q tests/distributed/test_convert_fp8.py
"""
import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.spawn import run_distributed
from tests.unit.test_fp8_import import LAYERS, QUANT, _quantised, dequantise, write_checkpoint

pytestmark = pytest.mark.distributed


def roundtrip_worker(rank, world, hf, root):
    from megatron_sparse_rl.checkpoint.convert import hf_to_mcore, mcore_to_hf

    messages: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("megatron_sparse_rl")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    hf_to_mcore(hf, f"{root}/mc", tp=1, ep=1)
    mcore_to_hf(f"{root}/mc", f"{root}/back", verify=True)  # transformers loads the export (config.json included)
    return messages


def test_fp8_release_checkpoint_roundtrip_drops_scales_and_mtp(tmp_path):
    from megatron_sparse_rl.models.tiny_families import build_tiny_deepseek

    plain_dir = build_tiny_deepseek(tmp_path / "plain", seed=3, layers=LAYERS, moe_ffn=24, ffn=40)
    plain = load_file(str(plain_dir / "model.safetensors"))
    stored = _quantised(plain, mtp=1)
    hf = write_checkpoint(plain_dir, tmp_path / "release", stored, quantization_config=QUANT,
                          num_nextn_predict_layers=1)
    messages = run_distributed(roundtrip_worker, 1, args=(str(hf), str(tmp_path)), timeout=600)[0]

    back = {}
    for f in Path(tmp_path, "back").glob("*.safetensors"):
        back.update(load_file(str(f)))
    assert sorted(back) == sorted(plain)  # no scales, no layer 3
    quantised = [n for n, t in stored.items() if t.dtype == torch.float8_e4m3fn and n in plain]
    assert len(quantised) > 40
    for name, t in back.items():
        want = dequantise(stored[name], stored[name + "_scale_inv"], torch.float64).float() if name in quantised \
            else stored[name]
        assert t.dtype == torch.float32 and torch.equal(t, want), name
    cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["num_nextn_predict_layers"] == 0
    assert any("skipping" in m and "multi-token-prediction layer(s) 3 " in m for m in messages), messages
    assert any("num_nextn_predict_layers 1 -> 0" in m and "quantization_config (fp8) dropped" in m
               for m in messages), messages


def test_fp8_dsa_release_roundtrip(tmp_path):
    """A tiny fp8 DeepSeek-V3.2 release (tests/unit/test_fp8_dsa_import.py: the indexer's wq_b and wk fp8, blocks
    straddling its reordered rows, an MTP layer) through hf_to_mcore and mcore_to_hf --verify: the export holds the
    model's tensors, the fp8 ones equal to the float64 dequantisation, so the indexer rows went back to HF's order."""
    from tests.unit.test_fp8_dsa_import import LAYERS as DSA_LAYERS
    from tests.unit.test_fp8_dsa_import import make_release, reference

    hf, stored = make_release(tmp_path, "deepseek_v32")
    messages = run_distributed(roundtrip_worker, 1, args=(str(hf), str(tmp_path)), timeout=600)[0]
    back = {}
    for f in Path(tmp_path, "back").glob("*.safetensors"):
        back.update(load_file(str(f)))
    model = [n for n in stored if not n.endswith("_scale_inv") and not n.startswith(f"model.layers.{DSA_LAYERS}.")]
    assert sorted(back) == sorted(model)
    fp8 = [n for n in model if stored[n].dtype == torch.float8_e4m3fn]
    assert {n for n in fp8 if ".indexer." in n} == {f"model.layers.{i}.self_attn.indexer.{m}.weight"
                                                    for i in range(DSA_LAYERS) for m in ("wq_b", "wk")}
    for name, t in back.items():
        want = reference(stored, name)
        assert t.dtype == want.dtype and torch.equal(t, want), name
    assert any("skipping" in m and f"multi-token-prediction layer(s) {DSA_LAYERS} " in m for m in messages), messages
