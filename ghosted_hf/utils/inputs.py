"""The paths a command reads, decided in one place: every reader of a local path notes it here, so that no output of
the same command (`--overwrite` included) is, lies inside or contains something it read, however the path was reached
(typed, resolved from a config like heal's teacher 'base', a packaged model's cache, llama.cpp's converter, a
checkpoint resumed from). The CLI opens one ledger per command; the Python API keeps none (its caller holds the model
it loaded and decides where to save it)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import GhostedError

PathLike = str | os.PathLike


@dataclass
class _Ledger:
    reads: dict[Path, tuple[str, str]] = field(default_factory=dict)  # resolved -> (what it is, the path as given)
    outputs: dict[Path, str] = field(default_factory=dict)  # resolved -> the flag that named it


_LEDGER: ContextVar[_Ledger | None] = ContextVar("ghosted_hf_command_paths", default=None)


@contextlib.contextmanager
def command_paths() -> Iterator[None]:
    """Scope of one command: reads and outputs noted inside it are compared with each other."""
    token = _LEDGER.set(_Ledger())
    try:
        yield
    finally:
        _LEDGER.reset(token)


def relation(path: PathLike, other: PathLike) -> str | None:
    """How `path` stands to `other` on the disk ("is", "lies inside", "contains"), None when apart (links resolved;
    neither needs to exist)."""
    where, found = Path(path).resolve(), Path(other).resolve()
    return ("is" if where == found else "lies inside" if found in where.parents
            else "contains" if where in found.parents else None)


def check_apart(output: PathLike, source: PathLike, what: str = "input", flag: str = "--output") -> None:
    """Refuse an output that is, lies inside or contains `source` (`what` it is, in the message)."""
    how = relation(output, source)
    if how:
        raise GhostedError(f"{flag} {output} {how} the {what} {source}; write it somewhere else.")


def note_read(path: PathLike | None, what: str) -> None:
    """Record that the running command reads `path` (a local file or folder; anything else, a Hub id say, is no
    path), refusing at once when a declared output would replace it."""
    ledger = _LEDGER.get()
    if ledger is None or path is None or not Path(path).exists():
        return
    for output, flag in ledger.outputs.items():
        check_apart(output, path, what, flag)
    ledger.reads.setdefault(Path(path).resolve(), (what, str(path)))


def note_output(path: PathLike, flag: str = "--output") -> None:
    """Declare where the running command will write, refusing at once when that replaces a path it read."""
    ledger = _LEDGER.get()
    if ledger is None:
        return
    check_write(path, flag)
    ledger.outputs.setdefault(Path(path).resolve(), flag)


def check_write(target: PathLike, flag: str = "--output") -> None:
    """The last guard of every write helper: `target` is none of the paths the running command read."""
    ledger = _LEDGER.get()
    for what, source in ([] if ledger is None else ledger.reads.values()):
        check_apart(target, source, what, flag)
