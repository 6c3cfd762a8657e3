"""Small files read and written whole: one atomic write (a reader sees the old file or the new one, never half of
one) and one JSON reader that names the file, and the field, whatever is wrong with it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .errors import GhostedError
from .remote.modeling_ghosted import process_tag


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to a sibling file of `path` and move it into place: a kill leaves the previous file whole."""
    path = Path(path)
    staged = path.with_name(f".{path.name}.writing-{process_tag()}")
    try:
        with open(staged, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staged, path)
    except OSError as error:
        raise GhostedError(f"Cannot write {path} ({error.strerror or error}); check the disk space and the folder's "
                           "permissions.") from None
    finally:
        staged.unlink(missing_ok=True)
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """`atomic_write_bytes` of `text` in UTF-8."""
    return atomic_write_bytes(path, text.encode())


def read_json(path: str | os.PathLike, what: str) -> Any:
    """The JSON value of `path`, or one line naming `what` the file is and why it cannot be read."""
    path = Path(path)
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        raise GhostedError(f"{what.capitalize()} {path} does not exist.") from None
    except (OSError, UnicodeDecodeError, RecursionError, ValueError) as error:
        reason = getattr(error, "strerror", None) or str(error).splitlines()[0][:200] or type(error).__name__
        raise GhostedError(f"{what.capitalize()} {path} is not readable JSON ({reason}); it is damaged: write it "
                           "again.") from None


def read_json_object(path: str | os.PathLike, what: str, fields: dict[str, type | tuple[type, ...]] | None = None,
                     ) -> dict[str, Any]:
    """A JSON object from `path` whose `fields` (name -> accepted types) are present with those types."""
    value = read_json(path, what)
    if not isinstance(value, dict):
        raise GhostedError(f"{what.capitalize()} {path} holds a JSON {type(value).__name__}, not an object; it is "
                           "damaged: write it again.")
    for name, types in (fields or {}).items():
        check_field(value, name, types, f"{what} {path}")
    return value


def check_field(record: dict[str, Any], name: str, types: type | tuple[type, ...], where: str) -> Any:
    """`record[name]`, refused with a line naming `where`, the field and the expected type unless it has one of
    `types` (a bool is not an int here)."""
    types = types if isinstance(types, tuple) else (types,)
    value = record.get(name, _MISSING)
    wrong_bool = isinstance(value, bool) and bool not in types
    if value is _MISSING or not isinstance(value, types) or wrong_bool:
        expected = " or ".join(_JSON_NAMES.get(t, t.__name__) for t in types)
        found = "nothing" if value is _MISSING else f"a {_JSON_NAMES.get(type(value), type(value).__name__)}"
        raise GhostedError(f"{where[0].upper()}{where[1:]}: field {name!r} should hold {expected}, and holds {found}; "
                           "it is damaged: write it again.")
    return value


_MISSING = object()
_JSON_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number",
               bool: "true or false", type(None): "null"}
