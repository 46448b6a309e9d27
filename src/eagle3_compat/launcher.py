"""``eagle3-compat run``: an unmodified Python program with ``apply()`` in effect.

In the manner of ``ddtrace-run`` and ``opentelemetry-instrument``: the
launcher sets ``EAGLE3_COMPAT_APPLIED`` (the options of :func:`apply`) and
puts a folder holding our own ``sitecustomize.py`` first on ``PYTHONPATH``,
then replaces itself with ``python SCRIPT ARGS...`` (or ``python -m MODULE
ARGS...``).  The program therefore runs exactly as it would without us
(``sys.argv``, ``__main__``, ``multiprocessing`` spawn children), and in it
and in every Python child it starts, ``sitecustomize`` registers the same
post-import hook the wheel's ``.pth`` line registers
(:mod:`eagle3_compat._inherit`): ``apply()`` runs with those options as soon as
speculators' generator module is imported.  It does not rely on the ``.pth``
file, which editable installs do not have.

A ``sitecustomize`` that ours shadows (a distribution's own) is still run:
ours executes the next one found on ``sys.path``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from ._inherit import ENV

__all__ = ["BOOT_DIR", "launch", "launch_command"]

BOOT_DIR = Path(__file__).resolve().parent / "_boot"
_DTYPES = (None, "auto", "float32", "bfloat16", "float16")


def launch_command(
    target: str, *, module: bool = False, args: Sequence[str] = (), dtype: str | None = None,
    environ: dict[str, str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment :func:`launch` executes (no side effects)."""
    if dtype not in _DTYPES:
        raise ValueError(f"--dtype must be one of {_DTYPES[1:]}, got {dtype!r}")
    if not module and not Path(target).is_file():
        raise ValueError(f"{target}: no such script (use -m for a module)")
    env = dict(os.environ if environ is None else environ)
    env[ENV] = json.dumps({"dtype": dtype})
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != BOOT_DIR]
    env["PYTHONPATH"] = os.pathsep.join([str(BOOT_DIR), *paths])
    argv = [sys.executable, *(["-m", target] if module else [target]), *args]
    return argv, env


def launch(target: str, *, module: bool = False, args: Sequence[str] = (), dtype: str | None = None) -> int:
    """Replace this process with the program, ``apply(dtype=dtype)`` in effect
    there and in its children.  Returns only on a usage error (exit status 2)."""
    try:
        argv, env = launch_command(target, module=module, args=args, dtype=dtype)
    except ValueError as exc:
        print(f"eagle3-compat run: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)
    raise AssertionError("unreachable")  # pragma: no cover
