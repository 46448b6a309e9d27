"""One journal for every change made to a foreign object.

Each entry is ``(owner, name, original)`` where ``original`` is the value
found in ``owner.__dict__`` before the first change, or ``NOTSET`` when the
attribute did not exist there.  The first original saved wins (patching the
same attribute twice keeps the true original); :meth:`Journal.undo` replays
the entries backwards, restoring the very objects (identity) and deleting
what did not exist.  A second undo is a no-op.  (The shape is the one of
pytest's ``MonkeyPatch`` and gevent's monkey journal.)
"""

from __future__ import annotations

from typing import Any

__all__ = ["NOTSET", "Journal"]


class _NotSet:
    def __repr__(self) -> str:
        return "NOTSET"


NOTSET: Any = _NotSet()


class Journal:
    def __init__(self) -> None:
        self._entries: list[tuple[Any, str, Any]] = []

    def __len__(self) -> int:
        return len(self._entries)

    def set(self, owner: Any, name: str, value: Any) -> None:
        """``owner.name = value``, remembering the original (from ``__dict__``)."""
        if not any(o is owner and n == name for o, n, _ in self._entries):
            # Read through __dict__, not getattr: an inherited attribute must not
            # be copied onto the subclass on undo, and descriptors stay intact.
            original = vars(owner).get(name, NOTSET)
            self._entries.append((owner, name, original))
        setattr(owner, name, value)

    def mark(self) -> int:
        return len(self._entries)

    def undo(self, to: int = 0) -> None:
        """Restore every entry after ``mark`` ``to``, newest first."""
        while len(self._entries) > to:
            owner, name, original = self._entries.pop()
            if original is NOTSET:
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass
            else:
                setattr(owner, name, original)
