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


class _Item:
    """A mapping seen as an object whose attributes are its items (for the journal)."""

    def __init__(self, mapping: Any) -> None:
        object.__setattr__(self, "mapping", mapping)

    @property
    def __dict__(self) -> Any:  # type: ignore[override]  # vars() reads the items
        return self.mapping

    def __setattr__(self, name: str, value: Any) -> None:
        self.mapping[name] = value

    def __delattr__(self, name: str) -> None:
        try:
            del self.mapping[name]
        except KeyError:
            raise AttributeError(name) from None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, _Item) and isinstance(b, _Item):
        return a.mapping is b.mapping
    return a is b


class Journal:
    def __init__(self) -> None:
        self._entries: list[tuple[Any, str, Any]] = []

    def __len__(self) -> int:
        return len(self._entries)

    def set(self, owner: Any, name: str, value: Any) -> None:
        """``owner.name = value``, remembering the original (from ``__dict__``)."""
        if not any(_same(o, owner) and n == name for o, n, _ in self._entries):
            # Read through __dict__, not getattr: an inherited attribute must not
            # be copied onto the subclass on undo, and descriptors stay intact.
            original = vars(owner).get(name, NOTSET)
            self._entries.append((owner, name, original))
        setattr(owner, name, value)

    def set_item(self, mapping: Any, key: str, value: Any) -> None:
        """``mapping[key] = value`` (e.g. a ``sys.modules`` entry), journaled
        the same way; undo restores the original entry or deletes the key."""
        self.set(_Item(mapping), key, value)

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
