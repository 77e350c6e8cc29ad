"""Checks of a conversion's inputs, run before anything is built, loaded or written; each error names the file or
tensor at fault, and for a tensor the shape expected from the model config and the one found.

    check_hf_files(ckpt)                             # every shard exists and opens, the index names only
                                                     # tensors its files hold
    check_hf_tensors(ckpt, adapter, spec, config)    # headers (no data read) against the config: names,
                                                     # shapes, dtypes
    meta = check_torch_dist_files(mcore)             # complete; .metadata, metadata.json and common.pt read
                                                     # (pickles through safe_load.py's allowlists); every shard
                                                     # file present and as long as .metadata says
    check_saved_tensors(mcore, meta, expected, config)   # torch_dist shapes/dtypes against the built model's
    damaged_torch_dist_file(mcore, meta)             # after a failed load: the file whose data does not read

The HF checks need no process group and run before Megatron is imported. The expected HF shapes come from the
adapter (`GPTAdapter.hf_shapes`, derived from config.json); the expected torch_dist shapes from the Megatron model
built from the same config (its sharded state dict, `shard.py:sharded_shapes`), because Megatron's checkpoint keys
and stacking (fused layer norms, stacked experts) are Megatron's own facts.

Tensor dtypes allowed: bfloat16, float16, float32 (`WEIGHT_DTYPES`), which the converter casts without loss.
float64 would lose bits on the way through the Megatron parameters; an integer or bool tensor where a weight
belongs is a wrong file. Either is refused, naming the tensor. fp8 (F8_E4M3) weights are allowed only in a
block-wise quantised checkpoint (config.json `quantization_config`, `formats/fp8.py`), each with its
`<name>_scale_inv` of the ceil-divided shape; the reader dequantises them exactly to float32. Tensors of the
multi-token-prediction layers such a release checkpoint carries are skipped (`hf_io.skip_mtp_layers`).
"""
from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import torch

from megatron_sparse_rl.formats import fp8
from megatron_sparse_rl.formats.hf_io import DTYPE_CODES, HFCheckpoint, skip_mtp_layers
from megatron_sparse_rl.formats.safe_load import (TORCH_DIST_METADATA, UnsafeFileError, check_byte_items,
                                                  load_torch_file, read_dcp_metadata)
from megatron_sparse_rl.learner.checkpoint import COMMON, has_common_state, is_complete

WEIGHT_DTYPES = ("bfloat16", "float16", "float32")
_SHOWN = 3  # problems quoted in one message (the count says how many there are)


def _listing(problems: list[str]) -> str:
    more = f"; and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
    return "; ".join(problems[:_SHOWN]) + more


def _dtype_problem(found: str) -> str | None:
    if found not in WEIGHT_DTYPES:
        return f"dtype {found} (allowed: {', '.join(WEIGHT_DTYPES)})"
    return None


def _code_problem(code: str) -> str | None:
    """`_dtype_problem` of a safetensors dtype code; an fp8 one says where fp8 weights are read."""
    bad = _dtype_problem(DTYPE_CODES.get(code, (code,))[0])
    if bad and code.startswith("F8_"):
        bad += (f"; {fp8.FP8_CODE} weights are read only from a block-wise quantised checkpoint (quantization_config "
                "in config.json, a <name>_scale_inv per weight)")
    return bad


# ---- HF safetensors ---------------------------------------------------------------------------------
def check_hf_files(ckpt: HFCheckpoint) -> None:
    """Open every shard named by the checkpoint (missing or corrupt files fail here, before any work)."""
    from safetensors import safe_open

    for file in sorted(set(ckpt.weight_map.values())):
        path = ckpt.dir / file
        if not path.is_file():
            raise FileNotFoundError(f"{ckpt.dir}: shard {file!r} named in the index is missing")
        try:
            with safe_open(str(path), "pt") as f:
                keys = set(f.keys())
        except Exception as e:  # safetensors has its own error types
            raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
        absent = [n for n, fl in ckpt.weight_map.items() if fl == file and n not in keys]
        if absent:
            raise ValueError(f"{path}: index names {len(absent)} tensors the file lacks, e.g. {absent[:3]}")


def check_hf_tensors(ckpt: HFCheckpoint, adapter, spec, config: Path) -> None:
    """Every tensor the adapter maps is present, nothing else is (fp8 scales of mapped weights and MTP layers
    aside), and each has the shape `config` implies and an allowed dtype (an fp8 weight: a fitting scale). Reads
    the safetensors headers only."""
    expected = adapter.hf_shapes(spec)
    consumed = skip_mtp_layers(ckpt, adapter, spec)
    if ckpt.fp8 is not None:
        consumed |= {fp8.scale_name(n) for n in expected}
    missing = [n for n in expected if n not in ckpt.weight_map]
    extra = sorted(set(ckpt.weight_map) - set(expected) - consumed)
    if missing or extra:
        raise ValueError(f"{ckpt.dir}: tensors do not match the {spec.architecture} map of {config}: missing "
                         f"{missing[:_SHOWN]} ({len(missing)}), unmapped {extra[:_SHOWN]} ({len(extra)})")
    problems = []
    for name, shape in expected.items():
        code, found = ckpt.raw_header(name)
        where = f"{name} (in {ckpt.weight_map[name]})"
        if found != shape:
            problems.append(f"{where}: expected shape {shape}, found {found}")
        elif ckpt.fp8 is not None and (bad := ckpt.fp8_problem(name)):
            problems.append(f"{where}: {bad}")
        elif not (ckpt.fp8 is not None and code == fp8.FP8_CODE) and (bad := _code_problem(code)):
            problems.append(f"{where}: {bad}")
    if problems:
        raise ValueError(f"{ckpt.dir}: {len(problems)} tensor(s) do not fit the model of {config}: "
                         f"{_listing(problems)}")


# ---- Megatron torch_dist ----------------------------------------------------------------------------
def check_torch_dist_files(mcore: Path):
    """A complete torch_dist checkpoint whose metadata and common files read and whose every shard file holds
    the bytes the metadata places in it. Returns the torch.distributed.checkpoint Metadata."""
    if not mcore.is_dir():
        raise FileNotFoundError(f"{str(mcore)!r} is not a directory")
    if not is_complete(mcore) or not has_common_state(mcore):
        raise FileNotFoundError(f"{str(mcore)!r} is not a complete Megatron checkpoint (no COMPLETE marker or "
                                f"{COMMON})")
    meta = _read_metadata(mcore)
    _check_megatron_files(mcore)
    _check_shard_sizes(mcore, meta)
    check_byte_items(mcore, meta)  # Megatron's ShardedObjects, pickles inside the shard files
    return meta


def _read_metadata(mcore: Path):
    """The torch_dist metadata, unpickled through the allowlist of `safe_load.py` (never a bare pickle.load)."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = mcore / TORCH_DIST_METADATA
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (the torch_dist metadata)")
    try:
        meta = read_dcp_metadata(path)
    except UnsafeFileError:
        raise
    except Exception as e:  # noqa: BLE001 - any unreadable metadata is a damaged file
        raise ValueError(f"{path}: damaged torch_dist metadata ({type(e).__name__}: {e})") from None
    if not isinstance(meta, Metadata) or not isinstance(meta.storage_data, dict):
        raise ValueError(f"{path}: damaged torch_dist metadata (holds a {type(meta).__name__}, no storage index)")
    return meta


def _check_megatron_files(mcore: Path) -> None:
    """Megatron's dist_checkpointing config (metadata.json) and common state (common.pt, through the allowlist)."""
    from megatron.core.dist_checkpointing.core import CONFIG_FNAME
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

    config, common = mcore / CONFIG_FNAME, mcore / COMMON_STATE_FNAME
    for path in (config, common):
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing (written by Megatron's dist_checkpointing.save)")
    try:
        doc = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{config}: damaged dist_checkpointing config ({type(e).__name__}: {e})") from None
    backend = doc.get("sharded_backend") if isinstance(doc, dict) else None
    if backend != "torch_dist":
        raise ValueError(f"{config}: sharded_backend {backend!r}; only torch_dist checkpoints convert")
    try:
        load_torch_file(common)  # weights_only, through the allowlist
    except UnsafeFileError:
        raise
    except Exception as e:  # noqa: BLE001 - EOFError, UnpicklingError, RuntimeError: a damaged file
        raise ValueError(f"{common}: damaged Megatron common state ({type(e).__name__}: {e})") from None


def _check_shard_sizes(mcore: Path, meta) -> None:
    ends: dict[str, int] = {}
    for info in meta.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    absent = sorted(f for f in ends if not (mcore / f).is_file())
    if absent:
        raise FileNotFoundError(f"{mcore}: torch_dist shard file(s) missing: {absent[:_SHOWN]}")
    for file, end in sorted(ends.items()):
        size = (mcore / file).stat().st_size
        if size < end:
            raise ValueError(f"{mcore / file}: damaged torch_dist shard file: {size} bytes, but "
                             f"{TORCH_DIST_METADATA} places data up to byte {end} (truncated)")


def check_saved_tensors(mcore: Path, meta, expected: dict, config: Path) -> None:
    """The checkpoint's tensors against the Megatron model built from `config`: `expected` maps each sharded key
    of the model to (global shape or None where Megatron allows a mismatch, dtype name). Tensors under the
    model's top-level names that the model lacks are refused too (they would be dropped); others (optimizer
    state of a training checkpoint) are ignored."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = {k: v for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    roots = {k.split(".")[0] for k in expected}
    missing = sorted(k for k in expected if k not in saved)
    extra = sorted(k for k in saved if k not in expected and k.split(".")[0] in roots)
    adapters = [k for k in extra if ".lora." in k]
    if adapters and not missing and len(adapters) == len(extra):
        raise ValueError(f"{mcore}: a LoRA run's checkpoint (model.lora: {len(adapters)} adapter tensors, e.g. "
                         f"{adapters[0]}); converting it is not supported. Its adapters are in {mcore / 'adapter'} "
                         "(PEFT's format): `msrl convert merge-lora --base <the run's model.path> --adapter "
                         f"{mcore / 'adapter'} --out DIR` writes the merged model (the run's hf_final is the same)")
    if missing or extra:
        raise ValueError(f"{mcore}: the torch_dist tensors do not match the model of {config}: missing "
                         f"{missing[:_SHOWN]} ({len(missing)}), not in the model {extra[:_SHOWN]} ({len(extra)})")
    problems = []
    for key, (shape, dtype) in expected.items():
        found, found_dtype = tuple(saved[key].size), str(saved[key].properties.dtype).removeprefix("torch.")
        if shape is not None and found != tuple(shape):
            problems.append(f"{key}: expected shape {tuple(shape)}, found {found}")
        elif dtype in WEIGHT_DTYPES and (bad := _dtype_problem(found_dtype)):
            problems.append(f"{key}: {bad}")
        elif dtype not in WEIGHT_DTYPES and found_dtype != dtype:
            problems.append(f"{key}: dtype {found_dtype}, the model's is {dtype}")
    if problems:
        raise ValueError(f"{mcore}: {len(problems)} torch_dist tensor(s) do not fit the model of {config}: "
                         f"{_listing(problems)}")


def damaged_torch_dist_file(mcore: Path, meta) -> str | None:
    """After a failed load: '<file>: <what>' for the first shard file (by name) holding an item that does not
    read back as torch.save data (short, not a zip archive, a CRC mismatch, an unloadable tensor); None when
    every item reads. Reads the whole checkpoint, so only worth it once a load has failed."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tensors = {k for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    by_file: dict[str, list] = {}
    for index, info in meta.storage_data.items():
        if not info.transform_descriptors:  # transformed (e.g. compressed) items are not plain torch.save data
            by_file.setdefault(info.relative_path, []).append((info.offset, info.length, index.fqn))
    for file in sorted(by_file):
        path = mcore / file
        try:
            with open(path, "rb") as f:
                for offset, length, fqn in sorted(by_file[file]):
                    f.seek(offset)
                    problem = _item_problem(f.read(length), length, fqn in tensors)
                    if problem:
                        return f"{path}: damaged torch_dist shard file: item {fqn!r} at byte {offset} {problem}"
        except OSError as e:
            return f"{path}: unreadable torch_dist shard file ({e})"
    return None


def _item_problem(data: bytes, length: int, is_tensor: bool) -> str | None:
    if len(data) != length:
        return f"is cut short ({len(data)} of {length} bytes)"
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            for member in archive.infolist():
                if member.CRC:  # torch.save records CRC-32s by default; reading checks them
                    archive.read(member)
        if is_tensor:
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - BadZipFile, RuntimeError, EOFError, UnpicklingError: damaged data
        return f"does not read ({type(e).__name__}: {e})"
    return None
