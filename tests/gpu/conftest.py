"""The GPU suite's environment: vLLM's CUDA engine as a user starts it.

``tests/conftest.py`` sets variables for vLLM's CPU platform before any
engine starts (MLA disabled, spawned workers, a CPU KV-cache size).  On a
machine with a CUDA GPU they are removed again where they hold exactly those
values, so the engines here run MLA (FlashMLA / FA3-MLA) and the start
method the library chooses itself (``eagle3_compat.cuda_engine``).  Nothing
changes on a machine without a GPU (the suite is skipped there).
"""

from __future__ import annotations

import importlib.util
import os

from eagle3_compat.testing import gpu_unavailable

CPU_PLATFORM_ENV = {"VLLM_MLA_DISABLE": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
                    "VLLM_CPU_KVCACHE_SPACE": "1"}

if gpu_unavailable() is None:
    for _name, _value in CPU_PLATFORM_ENV.items():
        if os.environ.get(_name) == _value:
            del os.environ[_name]
    # vLLM 0.25's sampler probes FlashInfer at load time; a `pip install vllm`
    # brings it, a vLLM without it (the device bundle) needs the probe off.
    if importlib.util.find_spec("flashinfer") is None:
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
