"""Generate the field reference of docs/configuration.md from the config dataclasses and their docstrings.

The reference sits between the GENERATED markers of the document; the hand-written text around it is kept.

    python -m megatron_sparse_rl.tools.gen_config_docs            # rewrite docs/configuration.md
    python -m megatron_sparse_rl.tools.gen_config_docs --check    # exit 1 if the document is out of date
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

BEGIN = "<!-- BEGIN GENERATED: python -m megatron_sparse_rl.tools.gen_config_docs -->"
END = "<!-- END GENERATED -->"
DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def field_docstrings(cls: type) -> dict[str, str]:
    """{field: docstring} from the string literal under each annotated attribute of `cls`."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " \\| ".join(type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return "list of " + type_name(typing.get_args(tp)[0])
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _dataclass_of(tp: Any):
    """The dataclass inside `tp` (itself, or X of `X | None`), else None."""
    for cand in (tp, *typing.get_args(tp)):
        if dataclasses.is_dataclass(cand):
            return cand
    return None


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:  # as YAML would spell it
        return json.dumps(list(f.default) if isinstance(f.default, tuple) else f.default)
    return "(section)" if f.default_factory is not dataclasses.MISSING else "required"


def sections(cls: type, path: str = "") -> list[tuple[str, str, list[tuple[str, str, str, str]]]]:
    """[(section path, section docstring, [(dotted field, type, default, doc)])], depth first."""
    hints, docs = typing.get_type_hints(cls), field_docstrings(cls)
    rows, nested = [], []
    for f in dataclasses.fields(cls):
        dotted, sub = f"{path}.{f.name}" if path else f.name, _dataclass_of(hints[f.name])
        if sub is not None:
            nested += sections(sub, dotted)
            if path:  # a nested section still gets a row in its parent, pointing at its table
                rows.append((dotted, type_name(hints[f.name]), _default(f), docs.get(f.name, "")))
        else:
            rows.append((dotted, type_name(hints[f.name]), _default(f), docs.get(f.name, "")))
    own = [(path, " ".join((cls.__doc__ or "").split()), rows)] if path and rows else []
    return own + nested


def render() -> str:
    from megatron_sparse_rl.config.schema import RunConfig

    docs = field_docstrings(RunConfig)
    out = [BEGIN, "", "| section | what it holds |", "|---|---|"]
    out += [f"| `{f.name}` | {docs.get(f.name, '')} |" for f in dataclasses.fields(RunConfig)]
    out.append("")
    for path, doc, rows in sections(RunConfig):
        out += [f"### `{path}`", "", doc, "", "| field | type | default | meaning |", "|---|---|---|---|"]
        out += [f"| `{d}` | {t} | `{v}` | {m.replace('|', chr(92) + '|')} |" for d, t, v, m in rows]
        out.append("")
    return "\n".join(out + [END])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is out of date")
    args = parser.parse_args(argv)
    text = DOC.read_text()
    if BEGIN not in text or END not in text:
        print(f"error: {DOC} lacks the markers {BEGIN!r} ... {END!r}", file=sys.stderr)
        return 2
    head, rest = text.split(BEGIN, 1)
    new = head + render() + rest.split(END, 1)[1]
    if args.check:
        if new != text:
            print(f"{DOC} is out of date: run python -m megatron_sparse_rl.tools.gen_config_docs", file=sys.stderr)
            return 1
        return 0
    tmp = DOC.with_suffix(".md.tmp")
    tmp.write_text(new)
    tmp.replace(DOC)
    return 0


if __name__ == "__main__":
    sys.exit(main())
