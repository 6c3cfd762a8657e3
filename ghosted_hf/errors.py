"""One base class for every error that bad input can cause, so that callers (and `ghosted`) can tell
a problem the user can fix from a bug."""

from __future__ import annotations


class GhostedError(ValueError):
    """Bad input or an unusable model, file or option; the message names the value and the fix. A ValueError, so
    code written against earlier versions that caught ValueError still does."""


class NonFiniteError(GhostedError, FloatingPointError):
    """NaN or Inf in activations, statistics or operators."""


class MissingFileError(GhostedError, FileNotFoundError):
    """A file or folder the user named does not exist (or is of the wrong kind)."""


class MissingDependencyError(GhostedError, ImportError):
    """An optional package a feature needs is not installed; the message says how to install it."""


class UnknownOptionError(GhostedError, TypeError):
    """A keyword that is not an option (a TypeError, as for any unexpected keyword argument)."""


def one_line(error: BaseException, limit: int | None = 300) -> str:
    """An exception's message on one line, cut at `limit` characters (its type's name where it has none): what a
    refusal quotes of an error raised by code ghosted_hf does not own (a family's config or forward, a converter)."""
    return " ".join(str(error).split())[:limit] or type(error).__name__
