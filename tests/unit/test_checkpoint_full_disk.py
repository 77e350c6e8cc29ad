"""A checkpoint written onto a full filesystem fails with a message naming the checkpoint and its directory, removes
what it had written, and leaves the older checkpoints as they were (listing and sha256 of every file).

The full filesystem is simulated where the operating system reports it: `os.statvfs` answers no free blocks, and the
write fails the two ways a full disk shows, an OSError(ENOSPC) from a plain write and the CheckpointException
Megatron's checkpoint writer raises when PyTorch's zip writer loses bytes (what a real 3.5 MB tmpfs gave:
"Worker failure: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"). tests/e2e/test_full_disk.py
runs the real thing on a tmpfs.

    .venv/bin/python -m pytest -q tests/unit/test_checkpoint_full_disk.py
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

from megatron_sparse_rl.training import state
from megatron_sparse_rl.run.run_dir import RunDirError
from tests.snapshot import snapshot

TORN = "Worker failure: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"


def _older(root: Path) -> Path:
    old = root / "step_000001_sft_000000"
    (old / "hf").mkdir(parents=True)
    for name, data in [("__0_0.distcp", b"w" * 4096), ("common_state.json", b'{"step": 1}\n'), ("COMPLETE", b"ok\n"),
                       ("hf/config.json", b"{}\n")]:
        (old / name).write_bytes(data)
    return old


def _full(monkeypatch, free_blocks: int = 0):
    """os.statvfs reports `free_blocks` 4 KiB blocks available (0: the filesystem is full)."""
    real = os.statvfs

    class Full:
        def __init__(self, stat):
            self.f_frsize, self.f_bavail, self.f_blocks = 4096, free_blocks, stat.f_blocks

    monkeypatch.setattr(os, "statvfs", lambda p: Full(real(p)))


def _torn_write() -> CheckpointException:
    """What Megatron's finalize raises when a writer process failed, as torch.distributed.checkpoint builds it."""
    try:
        raise RuntimeError(TORN)
    except RuntimeError as e:
        return CheckpointException("write", {0: _wrap_exception(e)})


@pytest.mark.parametrize("failure", ["checkpoint_exception", "enospc"])
def test_a_save_onto_a_full_filesystem_names_the_directory_and_keeps_the_older_checkpoint(tmp_path, monkeypatch,
                                                                                            failure):
    root = tmp_path / "checkpoints"
    _older(root)
    before = snapshot(root)
    path = root / "step_000002_sft_000000"
    tmp = root / ".step_000002_sft_000000.tmp"
    _full(monkeypatch)
    with pytest.raises(RunDirError) as err:
        with state._writing(path, "checkpoint", cleanup=tmp):
            tmp.mkdir()
            (tmp / "__0_0.distcp").write_bytes(b"x" * 1000)  # half of the new checkpoint is on disk
            enospc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            raise _torn_write() if failure == "checkpoint_exception" else enospc
    message = str(err.value)
    assert message.startswith(f"could not write the checkpoint '{path}': No space left on device (0 bytes free on the "
                              f"filesystem of '{root}'; ")
    assert (TORN if failure == "checkpoint_exception" else "[Errno 28] No space left on device") in message
    assert "nothing of it was kept, and the older checkpoints are as they were" in message
    assert snapshot(root) == before  # the partial directory is gone, the older checkpoint byte for byte as it was


def test_enospc_on_a_filesystem_with_room_left_still_names_the_checkpoint(tmp_path, monkeypatch):
    """A quota or a file-size limit says ENOSPC while the filesystem has room: the OS's words, the path named."""
    root = tmp_path / "checkpoints"
    _older(root)
    before = snapshot(root)
    path, tmp = root / "step_000002_sft_000000", root / ".step_000002_sft_000000.tmp"
    _full(monkeypatch, free_blocks=1 << 20)
    with pytest.raises(RunDirError, match=rf"^could not write the checkpoint '{path}': No space left on device; "):
        with state._writing(path, "checkpoint", cleanup=tmp):
            tmp.mkdir()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert snapshot(root) == before


def test_a_writer_failure_with_room_left_is_not_called_a_full_disk(tmp_path, monkeypatch):
    """Any other failure is raised as it was (with its traceback), after the partial directory is removed."""
    root = tmp_path / "checkpoints"
    _older(root)
    before = snapshot(root)
    path, tmp = root / "step_000002_sft_000000", root / ".step_000002_sft_000000.tmp"
    _full(monkeypatch, free_blocks=1 << 20)
    torn = _torn_write()
    with pytest.raises(CheckpointException) as err:
        with state._writing(path, "checkpoint", cleanup=tmp):
            tmp.mkdir()
            (tmp / "common.pt").write_bytes(b"x")
            raise torn
    assert err.value is torn
    assert snapshot(root) == before
