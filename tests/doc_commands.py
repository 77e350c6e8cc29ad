"""The commands README.md and docs/*.md show: fenced and indented code lines, and inline `code` spans, that start
with `msrl`, `make`, `python` or `.venv/bin/...` (tests/unit/test_doc_commands.py checks that each one is run by a
test).

    from tests.doc_commands import documented_commands, command_keys
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
_START = r"(?:\.venv/bin/)?(?:msrl|make|python3?)(?=\s|$)"
_INLINE = re.compile(r"`(" + _START + r"[^`]*)`")
_LINE = re.compile(r"^\s*(?:\$\s+)?(" + _START + r".*)$")
SUBCOMMANDS = {"launch": ("local", "slurm"), "convert": ("hf-to-mcore", "mcore-to-hf", "merge-lora"),
               "routing": ("inspect", "compare"), "bench": ("kv", "sync", "learner", "routing", "convert", "async")}
"""msrl commands whose second word names what runs (tools/cli.py and each command's module)."""


@dataclass(frozen=True)
class DocCommand:
    file: str
    line: int
    text: str

    def where(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def concrete(self) -> bool:
        """No placeholder (CONFIG, N, ...), alternative (a|b), optional part ([...]) or elision (...)."""
        return not re.search(r"\[|\||\.\.\.|<|\b[A-Z][A-Z_]+\b", self.text)


def _code_lines(text: str):
    """(line number, line) of fenced code blocks and of indented (4+ spaces, after a blank line) code blocks."""
    fenced = indented = False
    previous_blank = True
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip().startswith("```"):
            fenced = not fenced
        elif fenced:
            yield number, line
        else:
            indented = (line.startswith("    ") and (indented or previous_blank)) and bool(line.strip())
            if indented:
                yield number, line
        previous_blank = not line.strip()


def _clean(command: str) -> str:
    command = command.split("  #")[0].split(" # ")[0].strip()
    command = re.split(r"\s{3,}", command)[0]  # a description column after the command
    return command.rstrip("\\ ").strip()


def documented_commands(files=DOCS) -> list[DocCommand]:
    found = []
    for path in files:
        text = path.read_text()
        name = path.relative_to(REPO).as_posix()
        code = dict(_code_lines(text))
        for number, line in code.items():
            match = _LINE.match(line)
            if match:
                found.append(DocCommand(name, number, _clean(match.group(1))))
        prose = "\n".join("" if n in code or line.strip().startswith("```") else line
                           for n, line in enumerate(text.splitlines(), 1))
        for match in _INLINE.finditer(prose):  # an inline span may wrap onto the next line
            number = prose.count("\n", 0, match.start()) + 1
            found.append(DocCommand(name, number, _clean(" ".join(match.group(1).split()))))
    return sorted(found, key=lambda c: (c.file, c.line))


def words(command: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError:
        return command.split()


def command_keys(command: str) -> list[str]:
    """What a command runs, as keys of tests/unit/test_doc_commands.py's SMOKES: 'msrl bench kv', 'make demo',
    'python -m megatron_sparse_rl.demo', 'python experiments/x.py', 'pytest'. A bare mention of a command group
    ('msrl bench ...') gives no key; alternatives ('kv|sync') give one key each."""
    w = [x.removeprefix(".venv/bin/") for x in words(command)]
    if not w:
        return []
    if w[0] == "msrl":
        if len(w) < 2 or w[1].startswith("-") or w[1] == "...":
            return ["msrl"] if len(w) > 1 and w[1] == "--help" else []
        heads = w[1].split("|")
        keys = []
        for head in heads:
            subs = SUBCOMMANDS.get(head)
            if subs is None:
                keys.append(f"msrl {head}")
            elif len(w) > 2 and not w[2].startswith("-") and w[2] != "...":
                keys += [f"msrl {head} {s}" for s in w[2].split("|")]
        return keys
    if w[0] == "make":
        return [f"make {w[1] if len(w) > 1 and not w[1].startswith('-') else ''}".strip()]
    if w[0] in ("python", "python3"):
        rest = [x for x in w[1:] if "=" not in x or x.startswith("-")]
        if rest[:2] == ["-m", "pytest"]:
            return ["pytest"]
        if rest[:1] == ["-m"] and len(rest) > 1:
            return [] if rest[1].startswith("<") else [f"python -m {rest[1]}"]
        return [f"python {rest[0]}"] if rest else []
    return []
