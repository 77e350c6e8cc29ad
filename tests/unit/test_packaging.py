"""What the installed distribution claims: only the top-level name `megatron_sparse_rl` (moe/, launch/ and tools/
live inside the package as megatron_sparse_rl.moe / .launch / .tools, never as generic top-level modules that would
collide with other packages), every source file of the package, the `msrl` console script, and no source file
importing the bare names.

    .venv/bin/python -m pytest -q tests/unit/test_packaging.py

The wheel is built from a copy of the packaging inputs (no build/ or egg-info left in the checkout, no stale
build/lib folded in), installed with `pip --target` into a temp folder and imported from there with a temp cwd,
so neither the checkout nor its editable install can stand in for it. About 5 s.
"""
from __future__ import annotations

import ast
import configparser
import email.message
import email.parser
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

REPO = Path(__file__).resolve().parents[2]
MAPPED = ("moe", "launch", "tools")
"""Generic folder names that must never install, or sit in the repository, at the top level."""
PACKAGING = ("setup.py", "setup.cfg", "pyproject.toml", "MANIFEST.in")
PIP_ENV = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}


def _pip(*args: str, cwd: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, env=PIP_ENV, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in PACKAGING:
        if (REPO / name).exists():
            shutil.copy2(REPO / name, src / name)
    for folder in ("megatron_sparse_rl",):
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheel")
    _pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), ".", cwd=src)
    (found,) = out.glob("*.whl")
    return found


def test_wheel_claims_only_megatron_sparse_rl(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"megatron_sparse_rl", "megatron_sparse_rl-0.1.0.dist-info"}
    for folder in MAPPED:  # the folders with generic names are inside the package, none at the top
        assert not (REPO / folder).exists(), f"{folder}/ at the top of the repository"
        assert any(n.startswith(f"megatron_sparse_rl/{folder}/") for n in names), folder


def test_wheel_holds_every_source_file_of_the_package(wheel):
    """A folder without __init__.py is a namespace package that find_packages skips: its modules would be missing
    from an installed (not editable) package."""
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {p.relative_to(REPO).as_posix() for p in (REPO / "megatron_sparse_rl").rglob("*.py")}
    assert expected and expected <= names, sorted(expected - names)


def test_wheel_console_script_and_top_level(wheel):
    with zipfile.ZipFile(wheel) as z:
        entry_points = z.read("megatron_sparse_rl-0.1.0.dist-info/entry_points.txt").decode()
        top_level = "megatron_sparse_rl-0.1.0.dist-info/top_level.txt"
        if top_level in z.namelist():
            assert z.read(top_level).decode().split() == ["megatron_sparse_rl"]
    parsed = configparser.ConfigParser()
    parsed.read_string(entry_points)
    assert dict(parsed["console_scripts"]) == {"msrl": "megatron_sparse_rl.tools.cli:main"}


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as z:
        return email.parser.Parser().parsestr(z.read("megatron_sparse_rl-0.1.0.dist-info/METADATA").decode())


def test_wheel_python_range_and_trackers_extra(wheel):
    """Python 3.11-3.13 install (README, "Python versions": megatron-core 0.16.1 has no 3.14 wheel), and the
    `trackers` extra brings W&B, the MLflow client and its sqlite store (logging.trackers)."""
    meta = _metadata(wheel)
    allowed = SpecifierSet(meta["Requires-Python"])
    assert [v for v in ("3.10", "3.11.0", "3.12.1", "3.13.5", "3.14.0") if v in allowed] == ["3.11.0", "3.12.1",
                                                                                          "3.13.5"]
    extra = {Requirement(r).name for r in meta.get_all("Requires-Dist")
             if 'extra == "trackers"' in str(Requirement(r).marker)}
    assert extra == {"wandb", "mlflow-skinny", "sqlalchemy", "alembic"}


def test_installed_wheel_imports_from_its_own_folder(wheel, tmp_path):
    site = tmp_path / "site"
    _pip("install", "--no-deps", "-q", "--target", str(site), str(wheel), cwd=tmp_path)
    assert {p.name for p in site.iterdir()} <= {"megatron_sparse_rl", "megatron_sparse_rl-0.1.0.dist-info", "bin"}
    assert "from megatron_sparse_rl.tools.cli import main" in (site / "bin" / "msrl").read_text()
    # A temp cwd and PYTHONPATH=site: the checkout is not on the path; torch, megatron-core come from this venv.
    code = ("import megatron_sparse_rl.launch.torchrun, megatron_sparse_rl.moe.storage\n"
            "from megatron_sparse_rl.tools.cli import main\n"
            "for m in ('megatron_sparse_rl.launch.torchrun', 'megatron_sparse_rl.moe.storage', main.__module__):\n"
            "    print(__import__('sys').modules[m].__file__)\n")
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [Path(f).relative_to(site).as_posix() for f in done.stdout.split()] == [
        "megatron_sparse_rl/launch/torchrun.py", "megatron_sparse_rl/moe/storage.py", "megatron_sparse_rl/tools/cli.py"]
    for name in MAPPED:  # nothing installed answers to the bare names
        probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({name!r}) is not None)"
        assert subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, timeout=60).returncode == 0, name


def _sources() -> list[Path]:
    """Every .py file of the checkout, skipping hidden folders (.venv, .git) and build or run outputs."""
    skip = {"__pycache__", "build", "dist", "runs"}
    found = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in skip and not d.endswith(".egg-info")]
        found += [Path(root) / f for f in files if f.endswith(".py")]
    return found


def _imported(node: ast.AST) -> list[str]:
    """The absolute module names `node` imports or runs: import / from-import statements,
    importlib.import_module("..."), and "-m", "..." in a literal command list."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        return [node.module] if node.level == 0 else []
    if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module":
        first = node.args[0] if node.args else None
        return [first.value] if isinstance(first, ast.Constant) and isinstance(first.value, str) else []
    if isinstance(node, (ast.List, ast.Tuple)):
        values = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
        return [v for flag, v in zip(values, values[1:]) if flag == "-m" and isinstance(v, str)]
    return []


def test_no_source_imports_the_bare_names():
    bad = [f"{path.relative_to(REPO)}:{node.lineno}: {name}"
           for path in _sources() for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
           for name in _imported(node) if name.split(".")[0] in MAPPED]
    assert not bad, "\n".join(bad)
