"""What a generator's engine on vLLM's CUDA platform starts with.

Two settings of the engine's processes, each applied only where the user has
not set the variable, while the engine starts (its processes inherit them),
and restored afterwards so the user's process keeps its own environment:

``VLLM_WORKER_MULTIPROC_METHOD=spawn``
    vLLM forks its engine-core (and worker) processes unless it sees torch's
    CUDA initialised in this process (``torch.cuda.is_initialized()``,
    ``vllm/utils/system_utils.py::_maybe_force_spawn``).  A process can be
    unfit to fork without that flag being set: torch marks a process's
    forked children "bad fork" as soon as it asks the CUDA runtime for the
    device count (``torch.cuda.is_available()`` does, and Hugging Face
    transformers, accelerate and speculators' scripts call it), and a forked
    engine core then fails in ``init_device`` with "Cannot re-initialize
    CUDA in forked subprocess".  Nothing public tells whether that mark is
    set, so the engine is always spawned on CUDA; a script needs the
    ``if __name__ == "__main__":`` guard it already needs on the CPU
    platform, where vLLM spawns too.

``TRITON_F32_DEFAULT=ieee`` (float32 engines only)
    Triton's ``tl.dot`` multiplies float32 inputs in TF32 (10-bit mantissa)
    unless told otherwise; vLLM's Triton attention, chosen for float32 on
    CUDA (FlashAttention has no float32 kernels), does not say, so a float32
    engine's attention is only TF32-accurate (~1e-3 relative, seen on an
    H100).  A user who asks for float32 asks for float32 products.

Pure: nothing here imports torch or vLLM.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, MutableMapping

from .logs import get_logger

__all__ = ["START_METHOD_ENV", "TRITON_FP32_ENV", "cuda_engine_environment", "cuda_engine_updates"]

log = get_logger("eagle3_compat.cuda_engine")

START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
TRITON_FP32_ENV = "TRITON_F32_DEFAULT"
FLOAT32_NAMES = frozenset({"float32", "float", "torch.float32"})

_WHY = {
    START_METHOD_ENV: "vLLM would fork its engine processes, which fails once this process has asked "
                      "CUDA for its devices (torch.cuda.is_available(), transformers, accelerate); "
                      "scripts need an `if __name__ == \"__main__\":` guard",
    TRITON_FP32_ENV: "float32 engine: Triton kernels (vLLM's float32 attention) multiply float32 in "
                     "full precision rather than TF32",
}


def cuda_engine_updates(environ: MutableMapping[str, str], dtype: str | None) -> dict[str, str]:
    """The variables :func:`cuda_engine_environment` sets for an engine of
    ``dtype`` (the generator's ``dtype`` option): those of the module's list
    that ``environ`` does not set (an empty value counts as unset)."""
    wanted = {START_METHOD_ENV: "spawn"}
    if dtype is not None and str(dtype).lower() in FLOAT32_NAMES:
        wanted[TRITON_FP32_ENV] = "ieee"
    return {name: value for name, value in wanted.items() if not environ.get(name, "").strip()}


@contextlib.contextmanager
def cuda_engine_environment(
    dtype: str | None, environ: MutableMapping[str, str] | None = None
) -> Iterator[dict[str, str]]:
    """While a CUDA engine starts: :func:`cuda_engine_updates` set in
    ``environ`` (``os.environ``), each logged at INFO with its reason;
    removed afterwards where still as set.  Yields what it set."""
    env = os.environ if environ is None else environ
    updates = cuda_engine_updates(env, dtype)
    for name, value in updates.items():
        env[name] = value
        log.info("starting vLLM's CUDA engine with %s=%s (%s; set %s yourself to choose otherwise)",
                 name, value, _WHY[name], name)
    try:
        yield updates
    finally:
        for name, value in updates.items():
            if env.get(name) == value:
                del env[name]
