"""Saved folders that are complete or untouched (`staged_folder`), and verified before they are shared
(`verify_folder`)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import GhostedError, MissingFileError, one_line
from ..model.checkpoint import check_folder, index_weight_map, made_as, weight_map
from ..remote.format_ghosted import (check_sizes_against_weights, decoder_paths, ghost_tensor_keys, ghost_tensor_shapes,
                                     operator_sha256)
from ..remote.staging_ghosted import staged_folder as remote_staged_folder
from ..utils.inputs import check_apart, check_write, note_output

logger = logging.getLogger(__name__)

# The remote code, copied next to the weights (transformers copies the files modeling_ghosted.py imports with it)
REMOTE_FILES = tuple(sorted(path.name for path in (Path(__file__).parents[1] / "remote").glob("*_ghosted.py")))


def check_output(output: str | os.PathLike | None, inputs: tuple[str | os.PathLike | None, ...] = (), *,
                 overwrite: bool = False, file: bool = False) -> Path:
    """The one rule for what a command may write: an existing output is replaced only with `overwrite`, and no
    output is, lies inside or contains one of the command's inputs (whatever `overwrite` says)."""
    if output is None:
        raise GhostedError("--output is required.")
    path = Path(output)
    for source in inputs:
        if source is not None and Path(source).exists():  # not a Hub id, a packaged model's name
            check_apart(path, source)
    note_output(path)  # and every path the command reads later, however reached (utils.inputs)
    what = "file" if file else "folder"
    if path.exists() and (path.is_dir() if file else not path.is_dir()):
        raise GhostedError(f"--output {path} exists and is not a {what}; name a {what}.")
    if path.exists() and not overwrite and (file or any(path.iterdir())):
        raise GhostedError(f"--output {path} already exists; pass --overwrite to replace it, or name a new {what}.")
    if file and not path.parent.exists():
        raise GhostedError(f"--output {path}: folder {path.parent} does not exist; create it first.")
    check_creatable(path, "--output")
    return path


def check_creatable(path: Path, flag: str) -> None:
    """Refuse, now rather than after the work, a path whose nearest existing ancestor is a file or not writable."""
    nearest = next((p for p in (path.parent, *path.parents) if p.exists()), None)
    if nearest is not None and not nearest.is_dir():
        raise GhostedError(f"{flag} {path}: {nearest} is a file, not a folder; name a path in a folder.")
    if nearest is not None and not os.access(nearest, os.W_OK):  # said now, not after the calibration pass
        raise GhostedError(f"{flag} {path}: {nearest} is not writable; name a folder you can write to.")


@contextlib.contextmanager
def staged_folder(target: str | os.PathLike) -> Iterator[Path]:
    """The remote save's `staged_folder` (a whole folder written beside `target`, or nothing), refusing a file."""
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise GhostedError(f"{target} is an existing file; save to a folder.")
    check_write(target)
    with remote_staged_folder(target) as staging:
        yield staging


def verify_folder(folder: str | os.PathLike) -> dict[str, Any]:
    """The folder's config, once every weight file was read whole and checked against its index and operator hashes."""
    from safetensors import safe_open

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise MissingFileError(f"{folder} is not a saved model folder (no config.json).")
    config = check_folder(folder)  # sizes against the headers first: seconds, before reading every byte
    index = index_weight_map(folder)  # None when unsharded
    found: dict[str, str] = {}
    tensors: dict[str, Any] = {}
    for file in [folder / name for name in sorted(set((weight_map(folder) if index is None else index).values()))]:
        if not file.is_file():
            raise MissingFileError(f"{file.name} is listed in the safetensors index of {folder} but missing.")
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    tensor = handle.get_tensor(key)  # reads the bytes: a truncated file fails here
                    found[key] = file.name
                    if ".ghost." in key:
                        tensors[key] = tensor
        except Exception as error:  # safetensors raises its own error type for damaged files
            raise GhostedError(f"{file} is damaged or truncated ({error}); save the model again.") from None
    if index is not None and found != index:
        missing = sorted(set(index) - set(found))[:3]
        raise GhostedError(f"The safetensors index of {folder} does not match its files (e.g. {missing}); save again.")
    if made_as(config) == "ghosted":
        check_ghosted_layout(folder, config, tensors)
        check_operator_hashes(config, tensors)
    return config


def check_ghosted_layout(folder: Path, config: dict[str, Any], operators: dict[str, Any]) -> None:
    """What `from_pretrained` refuses about a ghosted folder's layout, said before any load: a config that
    contradicts itself or the weights' depth, operators of the wrong shape or number."""
    from ..remote.configuration_ghosted import GhostedConfig

    try:
        ghosted = GhostedConfig.from_dict(config)
        ghosted.validate_ghost_layout()
    except Exception as error:  # whatever transformers' config classes raise about a field: the file is at fault
        reason = one_line(error)
        raise GhostedError(f"The folder's config.json is inconsistent: {reason}") from None
    try:
        check_sizes_against_weights(str(folder), {})  # the check from_pretrained makes: layers, vocabulary, width
    except ValueError as error:
        raise GhostedError(f"{error} Save the model again.") from None
    expected = ghost_tensor_shapes(ghosted, ghosted.get_text_config().hidden_size)
    if set(operators) != set(expected):
        raise GhostedError(f"The weight files hold the operators {sorted(operators)}, but config.json has boundaries "
                           f"and sub-blocks for {sorted(expected)}; save the model again.")
    for key, tensor in operators.items():
        if tuple(tensor.shape) != expected[key]:
            raise GhostedError(f"Operator tensor {key} has shape {tuple(tensor.shape)}, not {expected[key]}; save the "
                               "model again.")


def check_operator_hashes(config: dict[str, Any], tensors: dict[str, Any]) -> None:
    """Compare each ghost tensor with the sha256 its config recorded."""
    for boundary in [*(config.get("ghost_boundaries") or []), *(config.get("ghost_subblocks") or [])]:
        for field, key in ghost_tensor_keys(boundary, decoder_paths(config)).items():
            if key not in tensors:
                raise GhostedError(f"Operator tensor {key} is missing from the weight files; save the model again.")
            expected = boundary.get(field)
            if not expected:
                raise GhostedError(f"Operator tensor {key} has no {field} in config.json, so it cannot be verified; "
                                   "save the model again with save_pretrained.")
            if operator_sha256(tensors[key], config.get("operator_dtype", "float32")) != expected:
                raise GhostedError(f"Operator tensor {key} does not match the {field} in config.json: the file was "
                                   "changed or damaged after saving; save the model again.")
