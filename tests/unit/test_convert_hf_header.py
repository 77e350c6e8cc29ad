"""HFCheckpoint.header: dtype, shape and byte size read from the safetensors header (no data read), against the
tensors that were saved; an unsupported dtype is named with the supported ones."""
import pytest
import torch
from safetensors.torch import save_file

from megatron_sparse_rl.formats.hf_io import HFCheckpoint


def test_header_matches_the_saved_tensors(tmp_path):
    tensors = {"a": torch.randn(3, 5, dtype=torch.bfloat16), "b": torch.randn(7), "c": torch.zeros(2, 2, 2,
                                                                                                  dtype=torch.int64)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ckpt = HFCheckpoint(tmp_path)
    for name, t in tensors.items():
        assert ckpt.header(name) == (str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size())
    with pytest.raises(KeyError, match="'nope' is not in the checkpoint"):
        ckpt.header("nope")


def test_unsupported_dtype_is_named(tmp_path):
    save_file({"x": torch.zeros(2, dtype=torch.complex64)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'x' has dtype C64; supported: F32, BF16"):
        HFCheckpoint(tmp_path).header("x")
