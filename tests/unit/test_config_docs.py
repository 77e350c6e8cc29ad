"""docs/configuration.md matches the code: every config field it names exists in the schema.

    .venv/bin/python -m pytest -q tests/unit/test_config_docs.py
"""
from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from megatron_sparse_rl.config import RunConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
SECTIONS = [f.name for f in dataclasses.fields(RunConfig)]
# A dotted name that starts with a section, not inside a path or a longer name (`x.model.path`) and not
# quoted (`'parallel.tpp'`).
FIELD = re.compile(rf"(?<![\w./'-])(?:{'|'.join(SECTIONS)})(?:\.\w+)+")
# The doc's example of a misspelt key (`unknown key model.tiny.hiden`) names a field that must not exist.
UNKNOWN_KEY_EXAMPLE = re.compile(r"unknown key \S+")


def resolve(dotted: str) -> None:
    """Walk `dotted` through the dataclasses from RunConfig; raise KeyError naming the first missing part."""
    cls = RunConfig
    for i, part in enumerate(dotted.split(".")):
        if cls is None:
            raise KeyError(f"{'.'.join(dotted.split('.')[:i])} is a value, not a section")
        fields = {f.name for f in dataclasses.fields(cls)}
        if part not in fields:
            raise KeyError(f"{dotted}: no field {part!r} (has {sorted(fields)})")
        tp = typing.get_type_hints(cls)[part]
        cls = next((c for c in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(c)), None)


def named_fields() -> set[str]:
    return set(FIELD.findall(UNKNOWN_KEY_EXAMPLE.sub("", DOC.read_text())))


def test_doc_names_fields():
    names = named_fields()
    assert {"model.path", "model.tiny.experts", "parallel.tp", "rollout.sampling.n", "launch.nproc_per_node"} <= names


@pytest.mark.parametrize("dotted", sorted(named_fields()))
def test_every_field_named_in_the_doc_exists(dotted):
    resolve(dotted)


def test_resolve_rejects_what_does_not_exist():
    with pytest.raises(KeyError, match="no field 'tpp'"):
        resolve("parallel.tpp")
    with pytest.raises(KeyError, match="is a value"):
        resolve("model.path.x")


def test_generated_reference_has_a_row_for_every_field_it_lists():
    from megatron_sparse_rl.tools.gen_config_docs import sections

    rows = [d for _, _, rs in sections(RunConfig) for d, *_ in rs]
    assert "rollout.kv.budget" in rows and "algorithm.corrections.sparse_rl.weight_cap" in rows
    for dotted in rows:
        resolve(dotted)
