"""Process-wide logging set-up: one `init_logging(rank)` with a rank prefix, then `attach_log_file` once the run
directory is known.

The console stays readable: this project's own messages at `level` (rank 0; WARNING elsewhere); the libraries'
(vLLM, Megatron-Core, transformers, torch) only from `library_level` up (`msrl train` and the tools: ERROR), less
the known-benign start-up warnings in `BENIGN`, unless `verbose`. Libraries that print through their own console
handlers (torch's logging module, vLLM's, transformers') are rerouted to the root logger's handlers; the C++
warnings of torch and of the extensions built on it (vLLM's "NUMA binding" TORCH_WARN) go straight to fd 2, so
`quiet_native_logs` raises their level to ERROR before torch is imported (cli.py, unless --verbose). The log file
gets everything from every logger at INFO (DEBUG with level DEBUG), so nothing is lost by keeping the console short, except the listings of the `QUIET` loggers (Megatron's per-parameter
gradient buckets), which only `verbose` keeps. Python `warnings` are routed into logging (logger "py.warnings").

The tools other than `msrl train` (`msrl bench`, `msrl convert`, `msrl compare`) call `init_tool_logging` instead:
their console shows only this project's lines and the libraries' errors; the libraries' warnings go to
`tool_log_path(command)` (all of them, with `verbose` on the console too). Their spawned ranks (parallel/spawn.py `run_ranks`) do the same
through `RankLogging`, appending to the same file with a `[rank N]` prefix.
"""
from __future__ import annotations

import logging
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from megatron_sparse_rl._optional import _has

OWN = ("megatron_sparse_rl", "moe", "tools", "launch", "__main__")
# Warnings the libraries print on every start of this stack that need no action (docs/launch.md, "Logs"):
BENIGN = (
    "Apex is not installed", "Transformer Engine and Apex are not installed",  # Megatron-Core: local torch fallbacks
    "Transformer Engine is not installed",  # Megatron-Core's local layer spec is the CPU path by design
    "full scope is deprecated",  # Megatron-Core's own TransformerConfig default
    "Failed to load weights",  # vLLM reload: RotaryEmbedding's cos/sin cache is derived, not a checkpoint tensor
    "FutureWarning:", "DeprecationWarning:",  # library-internal deprecations
    # vLLM on CPU: settings this project chooses (eager, in-process engine, no Triton) and tuning hints
    "The global random seed is set to", "Enforce eager set", "Inductor compilation was disabled",
    "Triton is not installed", "Model Runner V2 requires Triton", "Reset SSM cache type",
    "is not found in LD_PRELOAD", "doesn't allow to use `torch.set_num_threads`",
)
# vLLM's reload lists the weights no checkpoint tensor filled; for MLA these are the absorbed projections it derives
# from kv_b_proj after loading. Benign only when every listed name is one of those.
_NOT_LOADED = "Following weights were not loaded from checkpoint: "
_DERIVED = (".W_UK_T", ".W_UV")


def _benign(message: str) -> bool:
    if any(b in message for b in BENIGN):
        return True
    if message.startswith(_NOT_LOADED):
        names = [n.strip(" '\"") for n in message[len(_NOT_LOADED):].strip("{} ").split(",")]
        return bool(names) and all(n.endswith(_DERIVED) for n in names)
    return False


# Library loggers whose INFO records are listings nobody reads, kept at WARNING (console and log file) unless
# verbose: Megatron-Core's DDP lists every parameter of every gradient bucket at INFO when it builds its buffers.
QUIET = ("megatron.core.distributed.param_and_grad_buffer",)

# Libraries that install their own console handler: their records are sent to the root logger instead. torch's
# logging module attaches a stderr handler (and propagate=False) to each of its registered loggers at import
# ("torch", "torch.distributed", ...; "Triton not available" comes through "torch"): `_reroute_console_handlers`
# sends those to the root too, keeping the levels torch set (WARNING).
_OWN_HANDLERS = ("vllm", "transformers")
_FORMAT = "[rank {rank}] %(levelname)s %(name)s: %(message)s"


class ConsoleFilter(logging.Filter):
    """Drop library records below `library_level` (WARNING) and the known-benign warnings (unless verbose)."""

    def __init__(self, verbose: bool, library_level: int = logging.WARNING):
        super().__init__()
        self.verbose = verbose
        self.library_level = library_level

    def filter(self, record: logging.LogRecord) -> bool:
        if self.verbose or record.name.split(".")[0] in OWN:
            return True
        if record.levelno < self.library_level:
            return False
        return record.levelno >= logging.ERROR or not _benign(record.getMessage())


def reroute(name: str) -> None:
    """Send library logger `name`'s records to the root logger's handlers (the console filter and the log file)
    instead of its own console handler; for a library imported after `init_logging` (MLflow, at a tracker's
    start: observability/trackers.py), call it after the import."""
    lib = logging.getLogger(name)
    lib.handlers[:] = []
    lib.propagate = True
    lib.setLevel(logging.NOTSET)


def _reroute_library_handlers(verbose: bool, libraries: bool = True) -> None:
    """Send vLLM's and transformers' records to the root logger's handlers (the console filter and the
    log file) instead of their own console handlers. The variable covers a later `import vllm` (and spawned
    engine processes); transformers sets its handler up at its first import and never again, so it is imported
    here (when installed: it comes with vLLM) and its handler rewired."""
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    if libraries and _has("transformers"):
        from transformers.utils import logging as hf_logging

        hf_logging.get_logger()  # its console handler, installed now so that reroute removes it
        if not verbose:
            hf_logging.disable_progress_bar()  # "Writing model shards" bars of the tiny builder
    for name in _OWN_HANDLERS:
        reroute(name)
    if libraries and _has("torch"):
        import torch  # noqa: F401  (installs torch's logging handlers now, so that they are rerouted)
    _reroute_console_handlers()


def _reroute_console_handlers() -> None:
    """Every library logger that writes to the console itself (a StreamHandler on stderr or stdout, as torch's
    logging module installs) sends its records to the root logger's handlers instead; its level stays."""
    root = logging.getLogger()
    for name, lib in list(logging.root.manager.loggerDict.items()):
        if not isinstance(lib, logging.Logger) or lib is root or name.split(".")[0] in OWN:
            continue
        console = [h for h in lib.handlers if type(h) is logging.StreamHandler or
                   getattr(h, "stream", None) in (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)]
        if console:
            lib.handlers[:] = [h for h in lib.handlers if h not in console]
            lib.propagate = True


def quiet_native_logs() -> None:
    """Keep the C++ warnings of torch and its extensions (c10's TORCH_WARN / LOG(WARNING): vLLM's CPU worker
    prints "NUMA binding: ..." at every engine start) off fd 2: TORCH_CPP_LOG_LEVEL=ERROR, unless the user set it.
    c10 reads it when torch is imported, so call this first (cli.py does, unless --verbose); C++ errors still
    show, and the spawned ranks and engine processes inherit it."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def init_logging(rank: int = 0, level: int | str | None = None, *, verbose: bool = False,
                 library_level: int = logging.WARNING, libraries: bool = True) -> None:
    """Configure the root logger once per process: `[rank N] LEVEL name: message` on stderr.

    Rank 0 shows this project's messages from `level` (default INFO), the others from WARNING; the libraries'
    from `library_level` (unless verbose). `libraries` False: a process that never imports torch or transformers
    (`msrl compare`) skips importing them to rewire their handlers."""
    if level is None:
        level = logging.INFO if rank == 0 else logging.WARNING
    level = logging.getLevelName(level) if isinstance(level, str) else level
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter(_FORMAT.format(rank=rank)))
    console.setLevel(level if rank == 0 else max(level, logging.WARNING))
    console.addFilter(ConsoleFilter(verbose, library_level))
    root = logging.getLogger()
    root.handlers[:] = [console]
    root.setLevel(min(level, logging.INFO))
    # captureWarnings(True) does nothing while an earlier capture is recorded, even when warnings.showwarning was
    # replaced since (warnings.catch_warnings, a second init in one process): release it, then capture again
    logging.captureWarnings(False)
    logging.captureWarnings(True)
    _reroute_library_handlers(verbose, libraries)
    for name in QUIET:
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else logging.WARNING)


def attach_log_file(path: str | Path, *, rank: int | None = None) -> Path:
    """Also write every record (all loggers, INFO and up; DEBUG when the root is at DEBUG) to `path`,
    appending (a resumed run continues its log); with `rank`, each line says `[rank N]` after the time."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    prefix = "" if rank is None else f"[rank {rank}] "
    handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.getLogger().level)
    logging.getLogger().addHandler(handler)
    return path


def tool_log_path(command: str) -> Path:
    """Where `msrl <command>` keeps the libraries' lines: <temp dir>/msrl/<command>.log."""
    return Path(tempfile.gettempdir()) / "msrl" / f"{command}.log"


def init_tool_logging(command: str, *, verbose: bool = False, path: str | Path | None = None,
                      libraries: bool = True) -> Path:
    """Logging for a tool other than `msrl train`: this project's lines on the console, the libraries' (vLLM,
    Megatron-Core, transformers, torch, Python warnings) in the log file `path` (default `tool_log_path`) and,
    below ERROR, on the console only when `verbose`. Returns the log file's path. (`libraries`: `init_logging`.)"""
    init_logging(0, verbose=verbose, library_level=logging.ERROR, libraries=libraries)
    return attach_log_file(tool_log_path(command) if path is None else path)


@dataclass(frozen=True)
class RankLogging:
    """`init_tool_logging` for the ranks a tool spawns (`run_ranks(..., rank_init=RankLogging(path, verbose))`,
    parallel/spawn.py): called with the rank first thing in each rank process, it sends the libraries' lines to
    the tool's log file `path` (appended, each line `[rank N]`) and keeps them off the console unless `verbose`.
    This project's lines reach the console as in `init_logging(rank)`: rank 0 from INFO, the others from WARNING."""

    path: str
    """The tool's log file: what `init_tool_logging` returned in the parent."""
    verbose: bool = False
    """Also show the libraries' warnings on the console (the tool's --verbose)."""

    def __call__(self, rank: int) -> None:
        init_logging(rank, verbose=self.verbose, library_level=logging.ERROR)
        attach_log_file(self.path, rank=rank)
