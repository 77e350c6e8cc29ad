"""Math-equivalence reward through `math-verify` (pip install math-verify, or the "math" extra).

With math-verify the whole response (up to <eos>) is parsed (LaTeX, \\boxed{}, plain expressions) and
compared with the parsed reference, so "1/2", "0.5" and "\\frac{1}{2}" agree. Without it the fallback
does only exact or numeric equality of the answer text (`exact.numeric_answer`); `math_scorer` says
so with a warning when it picks the fallback.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

from megatron_sparse_rl._optional import _has
from megatron_sparse_rl.models.char_tokenizer import EOS
from megatron_sparse_rl.rewards.exact import numeric_answer

log = logging.getLogger(__name__)


def has_math_verify() -> bool:
    return _has("math_verify")


def math_verify_equal(response: str, answer: str) -> float:
    """1.0 if math-verify finds the response's answer equivalent to `answer`, else 0.0 (never raises on
    unparsable text). Its timeouts use SIGALRM, so they are on only in the main thread."""
    from math_verify import parse, verify

    text = response.split(EOS, 1)[0]
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(answer, parsing_timeout=timeout)
    pred = parse(text, parsing_timeout=timeout)
    if not gold or not pred:
        return numeric_answer(response, answer)
    return 1.0 if verify(gold, pred, timeout_seconds=timeout) else 0.0


def math_scorer() -> Callable[[str, str], float]:
    """math-verify's equivalence when installed, else exact-or-numeric equality (with a warning)."""
    if has_math_verify():
        return math_verify_equal
    log.warning("reward.kind 'math': math-verify is not installed, so answers are compared only for exact or "
                "numeric equality (pip install math-verify, or pip install -e .[math])")
    return numeric_answer
