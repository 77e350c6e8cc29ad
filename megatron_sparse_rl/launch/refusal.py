"""A refusal inside the ranks of a torchrun launch reaches the user once, from the launcher, instead of once per rank.

A rank that refuses to start (a ConfigError: `msrl train` would print `error: ...` and exit 2) under torchrun
writes the message to its error file instead of printing it (`record`; TORCHELASTIC_ERROR_FILE, in the JSON shape
torch's own `record` decorator writes for an exception, marked as a refusal). torchrun collects the failed ranks'
files; launch/torchrun.py prints each distinct message once (`messages`) as `error: ...` and exits 2, as `msrl
train` does alone. Stock torchrun shows the message in its failure summary. No torch import here: tools/cli.py
calls `record` on every refusal.

    if not record(str(error)):        # not a torchrun rank (or the file cannot be written): say it here
        print(f"error: {error}", file=sys.stderr)
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Mapping

ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
"""The variable torchrun sets for each rank: where the rank's failure is described."""
MARK = "msrl_refusal"
"""The key in the error file's extraInfo that marks a refusal (its value: the message)."""


def record(message: str) -> bool:
    """Write `message` as this rank's refusal to its torchrun error file; False when this is not a torchrun rank or the
    file cannot be written (the caller then prints the message itself)."""
    path = os.environ.get(ERROR_FILE)
    if not path:
        return False
    data = {"message": {"message": f"error: {message}",
                        "extraInfo": {"timestamp": str(int(time.time())), MARK: message}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        return False
    return True


def messages(failures: Mapping[int, Any]) -> list[str]:
    """The distinct refusal messages of the failed ranks (`failures`: rank -> torch's ProcessFailure, whose `message`
    is the error file's), in rank order; [] when no rank refused (a crash, a signal)."""
    found: list[str] = []
    for rank in sorted(failures):
        message = getattr(failures[rank], "message", None)
        extra = message.get("extraInfo") if isinstance(message, dict) else None
        text = extra.get(MARK) if isinstance(extra, dict) else None
        if isinstance(text, str) and text not in found:
            found.append(text)
    return found
