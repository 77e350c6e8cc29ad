"""Route torch's and Megatron-Core's reads of a torch_dist checkpoint's pickles through the allowlisted loaders of
`formats/safe_load.py`, so that loading a checkpoint never runs code from its files.

Upstream, for torch 2.13.0 (and 2.11.0, the GPU machine's: `FileSystemReader.read_metadata` / `_get_metadata_path`
and `DefaultLoadPlanner.load_bytes` have the same source there, and torch.distributed.checkpoint the same
`pickle.load` / `torch.load(` call sites) and megatron-core 0.16.1:
1. `torch.distributed.checkpoint.FileSystemReader.read_metadata` reads `.metadata` with a bare `pickle.load`:
   a pickle naming any function runs it. Replaced: the restricted unpickler (`read_dcp_metadata`).
2. `DefaultLoadPlanner.load_bytes` (Megatron's `MCoreLoadPlanner` inherits it) reads each byte item of the
   `*.distcp` files (Megatron's ShardedObjects) with `torch.load(weights_only=False)`. Replaced: `load_torch_file`
   (weights_only=True), the item set where upstream sets it.
3. Megatron's `TorchCommonLoadStrategy.load_common` reads `common.pt` with torch.load's default, which an
   environment variable (TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD) turns unrestricted. Replaced: `load_torch_file`.

`apply()` checks the versions it was written for, is idempotent, and is called by the functions that load a
torch_dist checkpoint (`learner/checkpoint.py:load_learner`, `checkpoint/shard.py:load_model_only`), never at import.
"""
from __future__ import annotations

import logging
from pathlib import Path

from megatron_sparse_rl.formats.safe_load import load_torch_file, read_dcp_metadata

log = logging.getLogger(__name__)

TORCH_VERSIONS = ("2.13.0", "2.11.0")
MEGATRON_VERSION = "0.16.1"
_APPLIED: set[str] = set()


def _read_metadata(self, *args, **kwargs):
    """FileSystemReader.read_metadata, unpickling through the allowlist."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    path = self._get_metadata_path(kwargs.get("rank"))
    with self.fs.create_stream(path, "rb") as stream:
        metadata = read_dcp_metadata(path, stream)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = self.load_id
    return metadata


def _load_bytes(self, read_item, value) -> None:
    """DefaultLoadPlanner.load_bytes, loading the item with weights_only=True."""
    from torch.distributed.checkpoint._traverse import set_element

    fqn = read_item.dest_index.fqn
    obj = load_torch_file(value, f"torch_dist item {fqn!r}")
    if self.flatten_state_dict:
        set_element(self.original_state_dict, self.mappings[fqn], obj)
    else:
        self.state_dict[fqn] = obj


def _load_common(self, checkpoint_dir):
    """TorchCommonLoadStrategy.load_common, loading common.pt with weights_only=True."""
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

    path = Path(checkpoint_dir) / COMMON_STATE_FNAME
    try:
        return load_torch_file(path)
    except FileNotFoundError as e:
        raise CheckpointingException(f"Common file {path} does not exist") from e


def _check_versions() -> None:
    import megatron.core
    import torch

    found = {"torch": torch.__version__.split("+")[0], "megatron-core": megatron.core.__version__}
    wanted = {"torch": TORCH_VERSIONS, "megatron-core": MEGATRON_VERSION}
    if found["torch"] not in TORCH_VERSIONS or found["megatron-core"] != MEGATRON_VERSION:
        raise RuntimeError(f"megatron_sparse_rl's safe checkpoint loading was written for {wanted}, found {found}: "
                           f"check that {__name__} still covers every read of a checkpoint's pickles, then update it")


def apply() -> None:
    """Install the three replacements (idempotent). Raises RuntimeError on other torch / megatron-core versions."""
    if "torch_dist" in _APPLIED:
        return
    _check_versions()
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    missing = [name for cls, name in ((FileSystemReader, "_get_metadata_path"), (FileSystemReader, "read_metadata"),
                                      (DefaultLoadPlanner, "load_bytes"), (TorchCommonLoadStrategy, "load_common"))
               if not hasattr(cls, name)]
    if missing:
        raise RuntimeError(f"{__name__}: upstream lacks {missing}; the patch no longer fits")
    FileSystemReader.read_metadata = _read_metadata
    DefaultLoadPlanner.load_bytes = _load_bytes
    TorchCommonLoadStrategy.load_common = _load_common
    _APPLIED.add("torch_dist")
    log.debug("torch_dist checkpoint reads go through the allowlisted loaders")
