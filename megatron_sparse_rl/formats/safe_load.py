"""Reading checkpoint files without running code from them.

A pickle can name any importable function and have the loader call it, so a checkpoint file is read only by a
loader that resolves the names on an explicit allowlist and refuses every other one, naming the file and the
name, before anything from the file has run (`UnsafeFileError`, which the CLIs print as `error: ...`).

    meta = read_dcp_metadata(ckpt / ".metadata")        # torch.distributed.checkpoint's metadata (a plain pickle)
    obj = load_torch_file(ckpt / "common.pt")            # torch.save files: torch.load(weights_only=True)
    check_checkpoint_files(ckpt)                          # every pickle of a torch_dist checkpoint, before a load

The torch_dist metadata is read by a restricted `pickle.Unpickler` that resolves only the
torch.distributed.checkpoint metadata classes, `torch.Size`, a `PosixPath` and torch's dtype/layout/memory-format
values (`DCP_METADATA_TYPES`). torch.save files (Megatron's `common.pt`, the byte items inside `*.distcp`, checkpoints
of ours written before `common_state.json`) are read with `torch.load(weights_only=True)`: tensors, storages,
builtin containers and scalars, plus the types a call names in `allow` (inside `torch.serialization.safe_globals`)
and the plain data classes Megatron-Core registers when it is imported (`megatron/core/safe_globals.py`: an
argparse/SimpleNamespace, a path, its config dataclasses and enums, BytesIO, numpy arrays); none of them runs code
when rebuilt. `patches/torch_dist_safe_load.py` routes torch's and Megatron's own reads of these files here.
docs/runs.md lists every file a checkpoint load reads and how.
"""
from __future__ import annotations

import io
import pickle
import re
from pathlib import Path
from typing import Any, BinaryIO

import torch

from megatron_sparse_rl.config.loader import ConfigError

TORCH_DIST_METADATA = ".metadata"  # torch.distributed.checkpoint's FileSystemWriter metadata file
MEGATRON_COMMON = "common.pt"  # Megatron dist_checkpointing's common (non-sharded) state

_DCP = "torch.distributed.checkpoint"
DCP_METADATA_TYPES: frozenset[tuple[str, str]] = frozenset({
    *((f"{_DCP}.metadata", n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                        "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                        "_MEM_FORMAT_ENCODING")),
    (f"{_DCP}.filesystem", "_StorageInfo"),
    *((f"{_DCP}.planner", n) for n in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData",
                                       "BytesIOWriteData")),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a torch.layout up by its name
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id of a checkpoint saved with a path as its id
    # empty classes Megatron-Core keeps so that metadata written by older versions unpickles
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata"),
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan"),
})
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)  # `torch.float32` etc.: values, never called


class UnsafeFileError(ConfigError):
    """A checkpoint file needs a type or function outside the allowlist of what such a file may hold: loading it
    could run code, so it is not loaded."""


def _refusal(path, what: str) -> UnsafeFileError:
    return UnsafeFileError(f"{path}: refused to load: it needs {what}, which a checkpoint file may not hold "
                           "(loading it could run code from the file; only tensors, plain containers and the "
                           "listed checkpoint types are read, docs/runs.md)")


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: BinaryIO, path):
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in DCP_METADATA_TYPES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(value := getattr(torch, name, None), _TORCH_VALUES):
            return value
        raise _refusal(self._path, f"{module}.{name}")


def read_dcp_metadata(path: str | Path, stream: BinaryIO | None = None):
    """The torch.distributed.checkpoint `Metadata` pickled at `path` (read from `stream` when given), resolving only
    `DCP_METADATA_TYPES`. Raises UnsafeFileError for any other name or for a shard path outside the checkpoint's
    directory; a damaged file raises what unpickling raised (EOFError, UnpicklingError, ...)."""
    from torch.distributed.checkpoint.metadata import Metadata

    if stream is None:
        with open(path, "rb") as f:
            meta = _MetadataUnpickler(f, path).load()
    else:
        meta = _MetadataUnpickler(stream, path).load()
    if isinstance(meta, Metadata) and isinstance(meta.storage_data, dict):
        for info in meta.storage_data.values():
            name = getattr(info, "relative_path", None)
            if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
                raise UnsafeFileError(f"{path}: refused to load: it places data in {name!r}, which is not a file "
                                      "of the checkpoint's own directory")
    return meta


def _weights_only_reason(message: str) -> str:
    """What torch's weights_only unpickler refused, without its advice to load the file unrestricted."""
    if found := re.search(r"GLOBAL ([\w.]+)", message):
        return found.group(1)
    parts = [p.strip() for p in message.split("\n\n") if p.strip()]
    body = [p for p in parts[1:] if not p.startswith("Check the documentation")]
    return "; ".join(body) or parts[-1]


def load_torch_file(source: str | Path | BinaryIO, path: str | Path | None = None, *, allow: tuple = ()) -> Any:
    """`torch.load(source, map_location="cpu", weights_only=True)` with the types in `allow` allowed besides
    torch's own (see the module doc). `path` names the file in errors (default: `source`). A name outside the
    allowlist raises UnsafeFileError naming the file and the name; a damaged file raises what torch.load raised."""
    path = source if path is None else path
    try:
        with torch.serialization.safe_globals(list(allow)):
            return torch.load(source, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" not in str(e):
            raise
        raise _refusal(path, _weights_only_reason(str(e))) from None


def check_checkpoint_files(root: str | Path) -> None:
    """Read every pickle a load of the torch_dist checkpoint at `root` would unpickle, through the loaders above:
    `.metadata`, Megatron's `common.pt` and every byte item (Megatron's ShardedObjects) inside the `*.distcp` files.
    Raises UnsafeFileError naming the first file that needs anything outside the allowlists. A missing or damaged
    file is left for the load (or the conversion's checks) to report."""
    root = Path(root)
    try:
        meta = read_dcp_metadata(root / TORCH_DIST_METADATA)
    except UnsafeFileError:
        raise
    except Exception:  # noqa: BLE001 - missing or damaged: named by the checks or the load that follows
        meta = None
    try:
        load_torch_file(root / MEGATRON_COMMON)
    except UnsafeFileError:
        raise
    except Exception:  # noqa: BLE001 - missing or damaged: named by the checks or the load that follows
        pass
    check_byte_items(root, meta)


def check_byte_items(root: Path, meta) -> None:
    """Load every byte item the torch_dist `meta` (read from `root`'s .metadata) places in `root`'s files with
    `load_torch_file`; UnsafeFileError names the file and the item. Unreadable items are skipped (the load or
    `checks.damaged_torch_dist_file` names them)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    if not isinstance(meta, Metadata) or not isinstance(meta.storage_data, dict):
        return
    for index, info in meta.storage_data.items():
        if not isinstance(meta.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        if info.transform_descriptors:  # transformed (e.g. compressed): the patched load reads it once decoded
            continue
        file = Path(root) / info.relative_path
        try:
            with open(file, "rb") as f:
                f.seek(info.offset)
                data = f.read(info.length)
            load_torch_file(io.BytesIO(data), f"{file} (item {index.fqn!r})")
        except UnsafeFileError:
            raise
        except Exception:  # noqa: BLE001 - missing or damaged: named by the checks or the load that follows
            continue
