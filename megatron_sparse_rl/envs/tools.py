"""The registry of tools an environment may offer, by name, and the built-in `calc`.

A tool is a function `(arguments: str) -> str`; it raises `ToolError` for arguments it cannot take (the environment
answers the model with an error message and counts a tool error). `env.tools` names tools of this registry;
`msrl validate` refuses a name that is not registered.

A tool is untrusted code: `call_tool` turns whatever goes wrong in it into a `ToolError` the model is told about, so
that no tool kills or hangs a run. A tool that raises any other exception, returns what is not a `str`, or (with
`timeout_s`) has not returned after `timeout_s` seconds (`ToolTimeout`) is a failed call. Its result is text: the
environment tokenizes it as text, so a special-token string in it (`<eos>`, `<|im_end|>`) stays characters
(data/templates.py `encode_pieces`).

    register_tool("upper", lambda args: args.upper())
    call_tool("calc", "4738291*5821")                  # '27581591911'
    call_tool("upper", "x", timeout_s=10.0)            # run in a worker thread, ToolTimeout after 10 s
"""
from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

Tool = Callable[[str], str]


class ToolError(ValueError):
    """A tool call the tool cannot answer (bad arguments, unknown tool, a tool that failed); the message is what the
    model is told."""


class ToolTimeout(ToolError):
    """A tool call that did not return within its time limit (`call_tool`'s `timeout_s`)."""


_DETAIL_CHARS = 200
"""Most characters of a failed tool's exception message that the model is told (its first line)."""

TOOLS: dict[str, Tool] = {}
"""Registered tools by name."""

CALC_MAX_DIGITS = 12
"""Longest operand `calc` takes (digits): bounds the work a model's call can ask for."""
_CALC = re.compile(rf"^\s*(-?\d{{1,{CALC_MAX_DIGITS}}})\s*([+\-*])\s*(-?\d{{1,{CALC_MAX_DIGITS}}})\s*$")


def register_tool(name: str, fn: Tool) -> None:
    """Register `fn` under `name` (a lowercase identifier); refuses a name taken by another function."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise ValueError(f"tool name {name!r} must be a lowercase identifier (letters, digits, _)")
    if TOOLS.get(name, fn) is not fn:
        raise ValueError(f"tool {name!r} is already registered")
    TOOLS[name] = fn


def call_tool(name: str, arguments: str, *, timeout_s: float | None = None) -> str:
    """The result of tool `name` on `arguments`; `ToolError` for an unknown tool, arguments it refuses, an exception
    of any other kind it raised, or a result that is not a `str`; `ToolTimeout` when it has not returned after
    `timeout_s` seconds (None: run in the caller's thread, unbounded; for trusted callers and tests).

    Why a thread: a Python thread cannot be stopped from outside, so a call past its time is abandoned, not killed:
    it keeps running as a daemon thread (which does not keep the interpreter from exiting) and its result, if any
    ever comes, is dropped. A subprocess could be killed, but a tool is any registered callable (closures and
    lambdas do not pickle), forking a process that holds vLLM's and torch's threads is unsafe, and spawning an
    interpreter per call costs seconds; a tool that must be killable should run its own subprocess inside itself.
    (concurrent.futures' workers are not daemons: the interpreter joins them at exit, so a hung tool there would
    hang the run's exit.)"""
    fn = TOOLS.get(name)
    if fn is None:
        raise ToolError(f"no tool {name}")
    result = _run(name, fn, arguments) if timeout_s is None else _run_bounded(name, fn, arguments, timeout_s)
    if not isinstance(result, str):
        raise _failed(name, "returned", f"{type(result).__name__}, not text")
    return result


def _run(name: str, fn: Tool, arguments: str):
    try:
        return fn(arguments)
    except ToolError:
        raise
    except Exception as e:  # untrusted code: whatever it raises is the call's failure, not the run's
        raise _failed(name, "raised", _describe(e)) from None


def _run_bounded(name: str, fn: Tool, arguments: str, timeout_s: float):
    """`fn(arguments)` in a daemon thread, waited for `timeout_s` seconds (see `call_tool`)."""
    outcome: list = []

    def target() -> None:
        try:
            outcome.append((True, fn(arguments)))
        except BaseException as e:  # a SystemExit in the tool ends only this thread; report it like any other
            outcome.append((False, e))

    worker = threading.Thread(target=target, name=f"tool-{name}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not outcome:
        _log(name, "timed out", f"after {timeout_s:g} s; its thread is left running as a daemon")
        raise ToolTimeout(f"tool {name} did not answer within {timeout_s:g} s")
    ok, value = outcome[0]
    if ok:
        return value
    if isinstance(value, ToolError):
        raise value
    raise _failed(name, "raised", _describe(value))


def _describe(e: BaseException) -> str:
    first = str(e).strip().split("\n")[0][:_DETAIL_CHARS]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _failed(name: str, verb: str, detail: str) -> ToolError:
    """The error of a tool that failed (a tool's own bug, not the model's arguments), logged for the operator."""
    _log(name, verb, detail)
    return ToolError(f"tool {name} {verb} {detail}")


_LOGGED: set[tuple[str, str]] = set()
"""(tool, kind of failure) already logged at WARNING in this process: later ones go to DEBUG (the episode metrics
count every one), so a broken tool does not flood the log once per call."""


def _log(name: str, verb: str, detail: str) -> None:
    first = (name, verb) not in _LOGGED
    _LOGGED.add((name, verb))
    logger.log(logging.WARNING if first else logging.DEBUG, "tool %s %s %s%s", name, verb, detail,
               " (later failures of this kind are logged at DEBUG; episode/tool_errors counts them)" if first else "")


def calc(arguments: str) -> str:
    """Integer arithmetic `a op b` with op one of + - * and operands of at most `CALC_MAX_DIGITS` digits, exact:
    "4738291*5821" -> "27581591911". Anything else is a `ToolError` (no expression evaluator runs)."""
    m = _CALC.match(arguments)
    if m is None:
        raise ToolError("bad expression")
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


register_tool("calc", calc)
