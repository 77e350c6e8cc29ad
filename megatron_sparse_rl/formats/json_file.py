"""One way to read a JSON file a checkpoint or model directory holds: any failure (missing, unreadable, not UTF-8,
not JSON, nested too deeply for the parser) is a ValueError naming the file.

    doc = read_json(path, "unreadable conversion manifest")    # ValueError: "<path>: unreadable ... (<why>)"
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: Path, what: str) -> Any:
    """The JSON value in `path`; ValueError "<path>: <what> (<why>)" when it cannot be read as one."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # RecursionError: deep nesting
        raise ValueError(f"{path}: {what} ({e})") from None
