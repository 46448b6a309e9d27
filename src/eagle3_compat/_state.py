"""Process-wide state of eagle3_compat (one journal, one record of apply())."""

from __future__ import annotations

from typing import Any

from ._journal import Journal

journal = Journal()
applied: bool = False
applying: bool = False  # inside apply(): its own imports must not re-enter it
options: dict[str, Any] = {}
report: Any = None  # the last Status
