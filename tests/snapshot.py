"""`snapshot(root)`: every path under `root` -> the sha256 of its bytes ("dir" for a directory). The tests of bad
inputs take one before and one after the failing call: equal means nothing was written or removed."""
import hashlib
from pathlib import Path


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(root).rglob("*"))}
