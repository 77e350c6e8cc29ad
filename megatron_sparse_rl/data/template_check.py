"""The check of a model's own chat template before a run renders anything with it (`msrl validate`, and `msrl train`'s
preflight: training/preflight.py).

A chat template is code that comes with the model: Jinja run in transformers' sandbox (`ImmutableSandboxedEnvironment`,
which refuses attribute access like `__class__` and `__globals__`). It is refused, with a message naming the file it
came from and no traceback, when rendering a few probe conversations
- is stopped by the sandbox, or raises (e.g. `raise_exception('roles must alternate')`);
- does not finish within `RENDER_TIMEOUT_S` seconds (the renderer is killed);
- leaves out the content of a role the run needs (user and assistant; tool too for multi-turn episodes), or renders
  the messages out of order;
- for episodes, does not render a model turn as a continuation of the generation prompt, or a tool message as a
  continuation of the conversation before it (data/templates.py `encode_demo`, `tool_observation`).

Why a child process: a template can loop for hours inside one `render` call (two nested `range(100000)` loops pass the
sandbox), and a Python thread cannot be stopped, so only a process can be killed at the deadline. It is a fresh
interpreter (`python -m megatron_sparse_rl.data.template_check`), not a fork, because `msrl train` runs this check
after joining the process group (gloo threads). It imports transformers' renderer (the function
`apply_chat_template` calls, given the same arguments: the template and the tokenizer's special tokens; loading the
tokenizer there would import torch, 4-15 s), caps its address space, says "ready", and only then is the render timed,
so a loaded machine's import time does not count against the template. A template that passes the probes but hangs on
one record's content is not caught here.

    problem = chat_template_problem(tokenizer, "runs/m/tokenizer_config.json", ("user", "assistant", "tool"))
"""
from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

RENDER_TIMEOUT_S = 5.0
"""Seconds the probe conversations may take to render, all together (a sound template takes milliseconds)."""
START_TIMEOUT_S = 120.0
"""Seconds the renderer may take to start (import transformers) before it is given up on."""
ADDRESS_SPACE_HEADROOM = 2 << 30
"""Bytes of address space the renderer may add after its imports: a template building a huge string fails with
MemoryError instead of taking the machine's memory before its deadline."""
_READY = "ready"


def template_file(model_dir: str | Path) -> Path:
    """The file a model directory's chat template comes from (transformers reads chat_template.jinja first)."""
    d = Path(model_dir)
    return d / "chat_template.jinja" if (d / "chat_template.jinja").is_file() else d / "tokenizer_config.json"


def _probes(roles: Sequence[str]) -> list[tuple[list[dict], bool]]:
    """(messages, add_generation_prompt): the conversations a run renders, each content distinct."""
    def m(role: str) -> dict:
        return {"role": role, "content": f"msrl probe {role} message"}

    out = [([m("user")], True)]
    if "assistant" in roles:
        out.append(([m("user"), m("assistant")], False))
    if "tool" in roles:
        out.append(([m("user"), m("assistant"), m("tool")], True))
    return out


def chat_template_problem(tokenizer, source: str | Path, roles: Sequence[str], *, timeout_s: float = RENDER_TIMEOUT_S,
                          start_timeout_s: float = START_TIMEOUT_S) -> str | None:
    """What is wrong with `tokenizer`'s own chat template (read from the file `source`) for a run whose conversations
    hold `roles` (None: nothing), as one sentence naming `source`. `roles` holding "tool" also checks the
    continuations an episode needs (the module docstring)."""
    where = f"the chat template in {source}"
    probes = _probes(roles)
    job = {"template": tokenizer.get_chat_template(), "specials": tokenizer.special_tokens_map, "probes": probes}
    rendered = _render(job, timeout_s, start_timeout_s)
    if isinstance(rendered, str):
        return f"{where} {rendered}"
    for (messages, generation), text in zip(probes, rendered):
        problem = _content_problem(messages, text, generation)
        if problem:
            return f"{where} {problem}"
    if "tool" in roles:
        first, turn, tool = rendered
        if not turn.startswith(first):
            return (f"{where} does not render an assistant turn as a continuation of the generation prompt before it; "
                    "an episode appends the model's turn to that prompt")
        if not tool.startswith(turn):
            return (f"{where} does not render a tool message as a continuation of the conversation before it; an "
                    "episode appends the tool's answer to the sequence so far")
    return None


def _roles(messages: list[dict]) -> str:
    return ", ".join(m["role"] for m in messages)


def _content_problem(messages: list[dict], text: str, generation: bool) -> str | None:
    """A message whose content the rendering lacks, or contents out of order."""
    at = [text.find(m["content"]) for m in messages]
    missing = [m["role"] for m, k in zip(messages, at) if k < 0]
    if missing:
        return (f"leaves out the content of the {' and '.join(map(repr, missing))} message (rendering "
                f"{_roles(messages)}{', generation prompt' if generation else ''})")
    if at != sorted(at):
        order = [m["role"] for _, m in sorted(zip(at, messages), key=lambda p: p[0])]
        return f"moves the messages out of order (given {_roles(messages)}; rendered {', '.join(order)})"
    return None


def _render(job: dict, timeout_s: float, start_timeout_s: float) -> list[str] | str:
    """The probes rendered by a child process, or what went wrong (a phrase)."""
    with tempfile.TemporaryFile("w+") as errors:  # a file, not a pipe: a chatty import cannot block the child
        child = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=errors, text=True)
        try:
            if _line(child, time.monotonic() + start_timeout_s) != _READY:
                errors.seek(0)
                why = _tail(errors.read(), child) if child.poll() is not None else f"not ready in {start_timeout_s:g} s"
                return f"could not be checked: its renderer did not start ({why})"
            child.stdin.write(json.dumps(job, default=str) + "\n")
            child.stdin.flush()
            answer = _line(child, time.monotonic() + timeout_s)
            if answer is None and child.poll() is None:
                return f"did not finish rendering within {timeout_s:g} s (stopped)"
        finally:
            if child.poll() is None:
                child.kill()
            child.wait()
        try:
            answer = json.loads(answer or "")
        except ValueError:
            errors.seek(0)
            return f"could not be checked: its renderer ended without an answer ({_tail(errors.read(), child)})"
    return answer.get("error") or answer["rendered"]


def _line(child: subprocess.Popen, deadline: float) -> str | None:
    """The child's next line of output, stripped; None when none came by `deadline` or the child ended."""
    with selectors.DefaultSelector() as sel:
        sel.register(child.stdout, selectors.EVENT_READ)
        if not sel.select(max(deadline - time.monotonic(), 0.0)):
            return None
    line = child.stdout.readline()
    return line.strip() if line else None


def _tail(stderr: str, child: subprocess.Popen) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return lines[-1] if lines else f"exit code {child.poll()}"


def _cap_address_space(headroom: int) -> None:
    """Limit this process's address space to what it uses now plus `headroom` bytes (Linux; elsewhere nothing)."""
    try:
        import resource

        status = Path("/proc/self/status").read_text()
        used = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmSize:"))) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (used + headroom, resource.getrlimit(resource.RLIMIT_AS)[1]))
    except (ImportError, OSError, StopIteration, ValueError):
        pass


def _serve() -> None:
    """The child: import the renderer, say ready, render the probes of the job read from stdin as
    `apply_chat_template` would, print the answer as one JSON line and leave at once (no interpreter teardown)."""
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError as e:  # written for transformers 5.16-5.19, where apply_chat_template calls it
        print(_READY, json.dumps({"error": f"could not be checked: transformers has no renderer to call ({e})"}),
              sep="\n", flush=True)
        os._exit(0)
    _cap_address_space(ADDRESS_SPACE_HEADROOM)
    print(_READY, flush=True)
    job = json.loads(sys.stdin.readline())
    answer: dict = {"rendered": []}
    for messages, generation in job["probes"]:
        try:
            rendered, _ = render_jinja_template(conversations=[messages], chat_template=job["template"],
                                                add_generation_prompt=generation, **job["specials"])
            answer["rendered"].append(rendered[0])
        except Exception as e:  # the template's failure is the answer: the sandbox's SecurityError, raise_exception...
            detail = str(e).strip().split("\n")[0][:300]
            what = "was stopped by the sandbox:" if type(e).__name__ == "SecurityError" else "raised"
            error = f"{type(e).__name__}: {detail}" if detail else type(e).__name__
            answer = {"error": f"{what} {error} (rendering {_roles(messages)})"}
            break
    print(json.dumps(answer), flush=True)
    os._exit(0)


if __name__ == "__main__":
    _serve()
