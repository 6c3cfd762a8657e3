"""Small files read and written whole: one atomic write (a reader sees the old file or the new one, never half of
one) and one JSON reader that names the file, and the field, whatever is wrong with it."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from safetensors import SafetensorError

from ..errors import GhostedError
from ..remote.staging_ghosted import process_tag, remove_leftovers
from .inputs import check_write


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Have `write` write a sibling file of `path`, then move it into place: a kill or a full disk leaves the
    previous file whole (and the sibling is removed, or by the next write if the process was killed)."""
    path = Path(path)
    check_write(path)
    remove_leftovers(path.parent, f".{path.name}.writing-")
    staged = path.with_name(f".{path.name}.writing-{process_tag()}-{os.urandom(4).hex()}")
    try:
        write(staged)
        with open(staged, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(staged, path)
    except (OSError, SafetensorError) as error:  # safetensors reports its I/O errors as its own type
        reason = getattr(error, "strerror", None) or str(error).splitlines()[0][:200]
        raise GhostedError(f"Cannot write {path} ({reason}); check the disk space and the folder's permissions.") \
            from None
    finally:
        staged.unlink(missing_ok=True)
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """`atomic_write` of `text` in UTF-8."""
    return atomic_write(path, lambda staged: staged.write_bytes(text.encode()))


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


def read_json_object(path: str | os.PathLike, what: str, fields: dict[str, Any] | None = None) -> dict[str, Any]:
    """A JSON object from `path` with the shape `fields` describes (a `check_shape` object schema)."""
    return check_shape(read_json(path, what), fields or {}, f"{what.capitalize()} {path}")


_MISSING = object()
_JSON_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number",
               bool: "true or false", type(None): "null"}


class _Optional(NamedTuple):
    schema: Any


def optional(schema: Any) -> Any:
    """A field of a `check_shape` object schema that may be absent (or null)."""
    return _Optional(schema)


def check_shape(value: Any, schema: Any, where: str) -> Any:
    """`value` if it has the shape `schema` describes, else one line naming `where` (the file and field path) and
    what the field should hold. A schema is a type or tuple of types, a dict of field -> schema (fields wrapped in
    `optional` may be missing or null; other fields are not checked), or a one-item list: a list of that."""
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            raise _wrong(where, "an object", value)
        for name, inner in schema.items():
            may_lack = isinstance(inner, _Optional)
            inner = inner.schema if may_lack else inner
            if name not in value or value[name] is None:
                if not may_lack:
                    raise _wrong(f"{where}.{name}", _describe(inner), _MISSING)
                continue
            check_shape(value[name], inner, f"{where}.{name}")
        return value
    if isinstance(schema, list):
        if not isinstance(value, list):
            raise _wrong(where, f"a list of {_describe(schema[0])}", value)
        for index, item in enumerate(value):
            check_shape(item, schema[0], f"{where}[{index}]")
        return value
    types = schema if isinstance(schema, tuple) else (schema,)
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise _wrong(where, _describe(schema), value)
    return value


def _describe(schema: Any) -> str:
    if isinstance(schema, dict):
        return "an object"
    if isinstance(schema, list):
        return f"a list of {_describe(schema[0])}"
    types = schema if isinstance(schema, tuple) else (schema,)
    return " or ".join(_JSON_NAMES.get(t, t.__name__) for t in types)


def _wrong(where: str, expected: str, value: Any) -> GhostedError:
    found = "nothing" if value is _MISSING else _JSON_NAMES.get(type(value), f"a {type(value).__name__}")
    return GhostedError(f"{where} should hold {expected}, and holds {found}: the file is damaged; write it again.")
