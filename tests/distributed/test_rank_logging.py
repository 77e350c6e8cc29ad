"""The ranks `msrl bench` and `msrl convert` spawn (parallel/spawn.py `run_ranks(..., rank_init=RankLogging(...))`)
log as the tool's own process does (issue 38): the libraries' warnings (a Megatron-Core logger's, transformers'
through its own logging set-up, a Python `warnings.warn`) go to the tool's log file with a `[rank N]` prefix and stay off the console unless verbose; this
project's lines and the libraries' errors reach the console. Two spawned gloo ranks (one for the verbose case); the console is the
file descriptors the ranks inherit (capfd).

    .venv/bin/python -m pytest -q tests/distributed/test_rank_logging.py
"""
import logging

import pytest

from megatron_sparse_rl.observability.logging import RankLogging
from tests.spawn import run_distributed

pytestmark = [pytest.mark.distributed]


def emit_lines(rank: int, world_size: int) -> int:
    import warnings

    from transformers.utils import logging as hf_logging  # transformers' own set-up, as its modules do

    logging.getLogger("megatron_sparse_rl.bench").warning("our line from rank %d", rank)
    logging.getLogger("megatron.core.transformer").warning("a Megatron warning from rank %d", rank)
    hf_logging.get_logger("transformers.modeling_utils").warning("a transformers warning from rank %d", rank)
    warnings.warn(f"a Python warning from rank {rank}", UserWarning)
    logging.getLogger("vllm.engine").error("a vLLM error from rank %d", rank)
    for handler in logging.getLogger().handlers:
        handler.flush()
    return rank


@pytest.mark.parametrize("verbose, world", [(False, 2), (True, 1)])  # one rank shows verbose (the machine is small)
def test_spawned_ranks_send_library_warnings_to_the_tool_log(tmp_path, capfd, verbose, world):
    log_file = tmp_path / "bench.log"
    log_file.write_text("a line the parent wrote\n")  # the ranks append to the parent's file
    ranks = list(range(world))
    assert run_distributed(emit_lines, world, timeout=120, rank_init=RankLogging(str(log_file), verbose)) == ranks
    console = capfd.readouterr().err
    in_file = log_file.read_text()
    assert in_file.startswith("a line the parent wrote\n")
    for rank in ranks:
        for text in ("our line", "a Megatron warning", "a transformers warning", "a Python warning", "a vLLM error"):
            line = [ln for ln in in_file.splitlines() if f"{text} from rank {rank}" in ln]
            assert len(line) == 1 and f"[rank {rank}] " in line[0], (text, rank, in_file)
        assert f"our line from rank {rank}" in console and f"a vLLM error from rank {rank}" in console
        assert (f"a Megatron warning from rank {rank}" in console) == verbose, console
        assert (f"a Python warning from rank {rank}" in console) == verbose, console
        assert (f"a transformers warning from rank {rank}" in console) == verbose, console
