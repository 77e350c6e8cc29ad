"""The conversion manifest: what an HF checkpoint held (name, shape, dtype, sha256 of the raw bytes), written
beside a converted Megatron checkpoint so that converting back can prove it is bit-exact.

    m = read_manifest(mcore_dir)          # None when the directory has no manifest
    tensor_digest(t)                      # sha256 hex of t's bytes (C order)

The HF side files (config.json, generation_config.json, tokenizer files) travel in `<mcore_dir>/hf/`.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from megatron_sparse_rl.formats.json_file import read_json

MANIFEST = "conversion_manifest.json"
HF_FILES_DIR = "hf"
FORMAT = "msrl-convert-manifest"
VERSION = 1
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
INDEX_SUFFIX = ".index.json"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8,
          "int8": torch.int8, "bool": torch.bool}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of the tensor's raw bytes in C order (exact: any bit flip changes it)."""
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(raw.tobytes()).hexdigest()


def tensor_entry(t: torch.Tensor) -> dict:
    return {"shape": list(t.shape), "dtype": dtype_name(t.dtype), "sha256": tensor_digest(t)}


def is_side_file(path: Path) -> bool:
    """A small non-weight file of an HF model dir (config, generation config, tokenizer, chat template)."""
    name = path.name
    return path.is_file() and not name.startswith(".") and not name.endswith(WEIGHT_SUFFIXES) \
        and not name.endswith(INDEX_SUFFIX)


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy every side file of HF dir `src` into `dst` (created); returns their names."""
    dst.mkdir(parents=True, exist_ok=True)
    names = []
    for p in sorted(Path(src).iterdir()):
        if is_side_file(p):
            shutil.copy2(p, dst / p.name)
            names.append(p.name)
    if "config.json" not in names:
        raise FileNotFoundError(f"{src}: no config.json")
    return names


def write_manifest(out_dir: Path, *, architecture: str, param_dtype: str, layout: dict, tensors: dict,
                   side_files: list[str]) -> Path:
    path = Path(out_dir) / MANIFEST
    doc = {"format": FORMAT, "version": VERSION, "architecture": architecture, "param_dtype": param_dtype,
           "saved_layout": layout, "hf_files": side_files, "tensors": tensors}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def read_manifest(mcore_dir: str | Path) -> dict | None:
    path = Path(mcore_dir) / MANIFEST
    if not path.exists():
        return None
    doc = read_json(path, "unreadable conversion manifest")
    if doc.get("format") != FORMAT or doc.get("version") != VERSION or not isinstance(doc.get("tensors"), dict):
        raise ValueError(f"{path}: not a {FORMAT} v{VERSION} manifest")
    return doc
