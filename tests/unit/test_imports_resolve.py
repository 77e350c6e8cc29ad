"""Every `from megatron_sparse_rl... import name` in the tree resolves, including the imports inside functions that
only a full run reaches (benchmarks/, experiments/, scripts/, tests/, the package): a moved or renamed name fails
here in seconds, naming the file and line, instead of in the one command that imports it (`msrl bench kv` once
raised ImportError for ten days because its function-level import named a module the name had left).

    .venv/bin/python -m pytest -q tests/unit/test_imports_resolve.py
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("megatron_sparse_rl", "benchmarks", "experiments", "scripts", "tests")
OWN = ("megatron_sparse_rl", "benchmarks", "experiments", "tests")


def _imports():
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                        and node.module.split(".")[0] in OWN:
                    for alias in node.names:
                        yield f"{path.relative_to(REPO)}:{node.lineno}", node.module, alias.name
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        if alias.name.split(".")[0] in OWN:
                            yield f"{path.relative_to(REPO)}:{node.lineno}", alias.name, None


IMPORTS = list(_imports())


def test_the_tree_has_function_level_imports_to_check():
    assert len(IMPORTS) > 500, len(IMPORTS)


def test_every_own_import_resolves():
    broken = []
    for where, module, name in IMPORTS:
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            broken.append(f"{where}: import {module}: {e}")
            continue
        if name is not None and name != "*" and not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                broken.append(f"{where}: from {module} import {name}: no such name")
    assert not broken, "\n".join(broken)
