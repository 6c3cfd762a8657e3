"""A name -> entry registry, the way operator kinds and selection criteria are declared: one class per
entry, registered with a decorator; the lists of allowed names and the errors for unknown ones come from it."""

from __future__ import annotations

from typing import Generic, TypeVar

from ..errors import GhostedError

T = TypeVar("T")


class Registry(dict[str, T], Generic[T]):
    """Named entries of one kind (operator kinds, criteria); lookups of unknown names list the known ones."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def register(self, cls: type[T]) -> type[T]:
        """Class decorator: adds one instance of `cls` under `cls.name`."""
        self[cls.name] = cls()
        return cls

    def lookup(self, name: str) -> T:
        if name not in self:
            raise GhostedError(f"Unknown {self.what} {name!r}; choose one of: {', '.join(self)}.")
        return self[name]
