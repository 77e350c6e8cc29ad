"""Conversion input checks (checkpoint/checks.py), one test per failure class, without a process group: each error
names the tensor (with the expected and found shape or dtype) or the damaged file, comes before the layout is
built (no process group, no Megatron model), and nothing is written or removed (the output directory's listing and
checksums, and the input's, are the same before and after; no partial directory is left).

The expected HF shapes are checked against what transformers itself saves for every supported family."""
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megatron_sparse_rl.checkpoint import convert
from megatron_sparse_rl.checkpoint.checks import check_hf_tensors, check_torch_dist_files, damaged_torch_dist_file
from megatron_sparse_rl.formats.hf_io import HFCheckpoint
from megatron_sparse_rl.models import load_spec
from megatron_sparse_rl.models.tiny import build_tiny_hf_model
from megatron_sparse_rl.models.tiny_families import build_tiny_deepseek, build_tiny_mixtral
from tests.snapshot import snapshot

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"  # (heads * head_dim, hidden) = (128, 64) in the tiny model


# ---- helpers ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    return build_tiny_hf_model(tmp_path_factory.mktemp("hf"), seed=1)


@pytest.fixture
def outs(tmp_path):
    """A parent directory holding an existing output directory a conversion with overwrite=True would replace."""
    root = tmp_path / "outs"
    (root / "existing").mkdir(parents=True)
    (root / "existing" / "keep.txt").write_text("the user's data")
    return root


@pytest.fixture
def no_layout(monkeypatch):
    """Fail loudly if a conversion gets as far as the parallel layout (the first process-group use)."""
    def reached(*_a, **_k):
        raise AssertionError("the conversion reached the parallel layout: the check came too late")

    monkeypatch.setattr(convert, "_layout", reached)
    assert not dist.is_initialized()


def _edited_hf(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _hf_to_mcore_fails(hf: Path, outs: Path, match: str) -> str:
    before_out, before_in = snapshot(outs), snapshot(hf)
    with pytest.raises(ValueError, match=match) as err:
        convert.hf_to_mcore(hf, outs / "existing", tp=1, ep=1, overwrite=True)
    assert snapshot(outs) == before_out and snapshot(hf) == before_in
    return str(err.value)


# ---- expected HF shapes, against transformers' own checkpoints ---------------------------------------------
def _qwen2(out: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=96, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(str(out), safe_serialization=True)
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3", "qwen2", "mixtral", "deepseek", "deepseek_q_lora"])
def test_hf_shapes_equal_what_transformers_saves(family, tmp_path):
    build = {"qwen3_moe": lambda d: build_tiny_hf_model(d, experts=4),
             "qwen3": lambda d: build_tiny_hf_model(d, arch="qwen3"),
             "qwen2": _qwen2, "mixtral": build_tiny_mixtral,
             "deepseek": lambda d: build_tiny_deepseek(d, layers=3, first_k_dense=1, shared=1),
             "deepseek_q_lora": lambda d: build_tiny_deepseek(d, q_lora_rank=24)}[family]
    d = build(tmp_path / family)
    adapter, spec = load_spec(d)
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert adapter.hf_shapes(spec) == saved


# ---- hf-to-mcore: headers against the config, before any process group ---------------------------------
def test_transposed_tensor_is_refused_naming_expected_and_found(tiny_hf, tmp_path, outs, no_layout):
    bad = _edited_hf(tiny_hf, tmp_path / "in", lambda t: t.update({Q_PROJ: t[Q_PROJ].t().contiguous()}))
    msg = _hf_to_mcore_fails(bad, outs, "do not fit the model")
    assert f"{Q_PROJ} (in model.safetensors): expected shape (128, 64), found (64, 128)" in msg
    assert "1 tensor(s)" in msg and "config.json" in msg


def test_reshaped_tensor_with_the_same_element_count_is_refused(tiny_hf, tmp_path, outs, no_layout):
    name = "model.layers.1.mlp.experts.2.down_proj.weight"  # (hidden, moe_ffn) = (64, 64)
    bad = _edited_hf(tiny_hf, tmp_path / "in", lambda t: t.update({name: t[name].reshape(32, 128)}))
    msg = _hf_to_mcore_fails(bad, outs, "do not fit the model")
    assert f"{name} (in model.safetensors): expected shape (64, 64), found (32, 128)" in msg


@pytest.mark.parametrize("dtype,shown", [(torch.int64, "int64"), (torch.float64, "float64"),
                                         (torch.float8_e4m3fn, "F8_E4M3")])
def test_non_weight_dtype_is_refused_naming_the_tensor(dtype, shown, tiny_hf, tmp_path, outs, no_layout):
    name = "model.embed_tokens.weight"
    bad = _edited_hf(tiny_hf, tmp_path / "in", lambda t: t.update({name: t[name].to(dtype)}))
    msg = _hf_to_mcore_fails(bad, outs, "do not fit the model")
    assert f"{name} (in model.safetensors): dtype {shown} (allowed: bfloat16, float16, float32)" in msg


def test_missing_and_unexpected_tensors_are_named(tiny_hf, tmp_path, outs, no_layout):
    def edit(t):
        del t["model.norm.weight"]
        t["model.layers.0.mlp.extra.weight"] = torch.zeros(2)

    msg = _hf_to_mcore_fails(_edited_hf(tiny_hf, tmp_path / "in", edit), outs, "do not match the Qwen3MoeForCausalLM")
    assert "missing ['model.norm.weight'] (1)" in msg and "unmapped ['model.layers.0.mlp.extra.weight'] (1)" in msg


def test_floating_dtypes_the_converter_casts_are_accepted(tiny_hf, tmp_path):
    def edit(t):
        t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"].bfloat16()
        t["lm_head.weight"] = t["lm_head.weight"].half()

    hf = _edited_hf(tiny_hf, tmp_path / "in", edit)
    adapter, spec = load_spec(hf)
    check_hf_tensors(HFCheckpoint(hf), adapter, spec, hf / "config.json")  # no error


# ---- mcore-to-hf: damaged torch_dist files, before any process group ---------------------------------------
@pytest.fixture
def torch_dist(tmp_path):
    """A small torch_dist checkpoint in the files' real formats: torch.distributed.checkpoint's .metadata and
    __0_0.distcp, Megatron's metadata.json and common.pt, the Learner's common_state.pt and COMPLETE."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    from megatron_sparse_rl.learner.checkpoint import COMMON, DONE

    d = tmp_path / "mc"
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": one process is the intent here
        warnings.simplefilter("ignore")
        dcp.save({"decoder.w": torch.randn(16, 8, generator=g), "embedding.w": torch.randn(32, 8, generator=g)},
                 checkpoint_id=str(d))
    save_config(CheckpointingConfig("torch_dist"), str(d))
    torch.save({}, d / "common.pt")
    torch.save({"step": 0}, d / COMMON)
    (d / DONE).write_text("ok\n")
    return d


def _mcore_to_hf_fails(mcore: Path, outs: Path, exc=ValueError) -> str:
    before_out, before_in = snapshot(outs), snapshot(mcore)
    with pytest.raises(exc) as err:
        convert.mcore_to_hf(mcore, outs / "existing", overwrite=True)
    assert snapshot(outs) == before_out and snapshot(mcore) == before_in
    return str(err.value)


def test_healthy_torch_dist_files_pass(torch_dist):
    meta = check_torch_dist_files(torch_dist)
    assert damaged_torch_dist_file(torch_dist, meta) is None


def test_truncated_distcp_is_named(torch_dist, outs, no_layout):
    shard = torch_dist / "__0_0.distcp"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])
    msg = _mcore_to_hf_fails(torch_dist, outs)
    assert msg.startswith(f"{shard}: damaged torch_dist shard file: {size // 2} bytes")
    assert f"up to byte {size}" in msg


@pytest.mark.parametrize("keep", [0, 40])  # empty (EOFError) and cut short (UnpicklingError)
def test_damaged_metadata_is_named(keep, torch_dist, outs, no_layout):
    path = torch_dist / ".metadata"
    path.write_bytes(path.read_bytes()[:keep])
    assert _mcore_to_hf_fails(torch_dist, outs).startswith(f"{path}: damaged torch_dist metadata (")


def test_damaged_megatron_common_state_is_named_not_a_bare_eoferror(torch_dist, outs, no_layout):
    (torch_dist / "common.pt").write_bytes(b"")
    msg = _mcore_to_hf_fails(torch_dist, outs)
    assert msg == f"{torch_dist / 'common.pt'}: damaged Megatron common state (EOFError: )"


def test_damaged_megatron_config_is_named(torch_dist, outs, no_layout):
    path = torch_dist / "metadata.json"
    path.write_text(path.read_text()[:20])
    assert _mcore_to_hf_fails(torch_dist, outs).startswith(f"{path}: damaged dist_checkpointing config (")


def test_damaged_item_of_a_whole_size_distcp_is_found(torch_dist):
    """Bytes flipped inside an item (the file keeps its size): the read-back scan names the file and the item."""
    meta = check_torch_dist_files(torch_dist)
    _, info = next((i, s) for i, s in meta.storage_data.items() if i.fqn == "embedding.w")
    shard = torch_dist / info.relative_path
    data = bytearray(shard.read_bytes())
    middle = info.offset + info.length // 2
    data[middle:middle + 8] = bytes(b ^ 0xFF for b in data[middle:middle + 8])
    shard.write_bytes(bytes(data))
    msg = damaged_torch_dist_file(torch_dist, check_torch_dist_files(torch_dist))
    assert msg.startswith(f"{shard}: damaged torch_dist shard file: item 'embedding.w' at byte {info.offset} "
                          "does not read ("), msg
