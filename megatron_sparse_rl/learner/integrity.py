"""What a checkpoint directory held when it was saved: every file's size and sha256, and which run wrote it,
in `MANIFEST.json`, so a truncated, corrupted or foreign checkpoint is recognised before anything loads it.

    files = digest_files(tmp_dir)                          # collective: each rank hashes a share of the files
    write_manifest(tmp_dir, files, owner="run-3f2a...")     # rank 0
    problems = verify_files(path)                           # [] when every file is as saved (collective)
    owner_of(path)                                          # the run id recorded at save, None without a manifest

Hashing is split over the ranks of the default process group (file i goes to rank i % world) and gathered,
so a checkpoint of many shards is hashed at the aggregate read bandwidth of all ranks, not of one.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch.distributed as dist

MANIFEST = "MANIFEST.json"
DONE = "COMPLETE"
"""The marker written last into a checkpoint, after its manifest: the checkpoint is complete."""
FORMAT = "msrl-checkpoint-manifest"
_CHUNK = 8 << 20


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _gather(mine: dict) -> dict:
    """Union of every rank's dict (each rank computed a disjoint share)."""
    rank, world = _world()
    if world == 1:
        return mine
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    return {k: v for part in every for k, v in part.items()}


def _listing(root: Path) -> list[str]:
    """Every regular file under `root` (relative POSIX paths, sorted), less the manifest and the marker."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_file() and p.name not in (MANIFEST, DONE))


def digest_files(root: str | Path) -> dict[str, dict]:
    """{relative path: {"size": bytes, "sha256": hex}} for every file under `root`. Collective when a process
    group is up: every rank must call it with the same directory (on a filesystem they all see)."""
    root = Path(root)
    rank, world = _world()
    names = _listing(root) if rank == 0 else None
    if world > 1:
        box = [names]
        dist.broadcast_object_list(box, src=0)
        names = box[0]
    mine = {n: {"size": (root / n).stat().st_size, "sha256": _sha256(root / n)}
            for i, n in enumerate(names) if i % world == rank}
    return _gather(mine)


def write_manifest(root: str | Path, files: dict[str, dict], *, owner: str | None) -> None:
    """Write `<root>/MANIFEST.json` atomically (temp file, then rename)."""
    root = Path(root)
    tmp = root / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"format": FORMAT, "owner": owner, "files": files}, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, root / MANIFEST)


def read_manifest(root: str | Path) -> dict | None:
    """The manifest as saved; None when the directory has none or it is unreadable."""
    try:
        data = json.loads((Path(root) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == FORMAT else None


def owner_of(root: str | Path) -> str | None:
    """The id of the run that saved this checkpoint (None: no manifest, or saved outside a run)."""
    manifest = read_manifest(root)
    return manifest.get("owner") if manifest else None


def verify_files(root: str | Path) -> list[str]:
    """What is wrong with the checkpoint's files against its manifest, one line per file ([] = intact):
    missing, wrong size (truncated or grown), or wrong sha256 (corrupted). Collective like `digest_files`
    (each rank hashes a share); a missing or unreadable manifest is itself a problem."""
    root = Path(root)
    manifest = read_manifest(root)
    if manifest is None:
        return [f"{root / MANIFEST}: missing or unreadable (the checkpoint cannot be checked)"]
    rank, world = _world()
    mine = {}
    for i, (name, want) in enumerate(sorted(manifest["files"].items())):
        if i % world != rank:
            continue
        path = root / name
        if not path.is_file():
            mine[name] = f"{path}: missing"
        elif (size := path.stat().st_size) != want["size"]:
            mine[name] = f"{path}: {size} bytes, {want['size']} at save (truncated or overwritten)"
        elif _sha256(path) != want["sha256"]:
            mine[name] = f"{path}: sha256 differs from the one recorded at save (corrupted)"
    problems = _gather(mine)
    return [problems[k] for k in sorted(problems)]
