"""The registry of tools an environment may offer, by name, and the built-in `calc`.

A tool is a function `(arguments: str) -> str`; it raises `ToolError` for arguments it cannot take (the environment
answers the model with an error message and counts a tool error). `env.tools` names tools of this registry;
`msrl validate` refuses a name that is not registered.

    register_tool("upper", lambda args: args.upper())
    call_tool("calc", "4738291*5821")   # '27581591911'
"""
from __future__ import annotations

import re
from collections.abc import Callable

Tool = Callable[[str], str]


class ToolError(ValueError):
    """A tool call the tool cannot answer (bad arguments, unknown tool); the message is what the model is told."""


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


def call_tool(name: str, arguments: str) -> str:
    """The result of tool `name` on `arguments`; `ToolError` for an unknown tool or arguments it refuses."""
    fn = TOOLS.get(name)
    if fn is None:
        raise ToolError(f"no tool {name}")
    return fn(arguments)


def calc(arguments: str) -> str:
    """Integer arithmetic `a op b` with op one of + - * and operands of at most `CALC_MAX_DIGITS` digits, exact:
    "4738291*5821" -> "27581591911". Anything else is a `ToolError` (no expression evaluator runs)."""
    m = _CALC.match(arguments)
    if m is None:
        raise ToolError("bad expression")
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


register_tool("calc", calc)
