"""Reading a safetensors checkpoint's layout without loading it: which file holds which tensor.

Every file name an index lists must be a plain safetensors file name inside the folder: an index cannot
send a reader elsewhere on the disk.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import GhostedError, MissingFileError

INDEX_SUFFIX = ".safetensors.index.json"


def index_weight_map(folder: Path) -> dict[str, str] | None:
    """The weight map of the folder's safetensors index (tensor name -> file name), None without an index."""
    indexes = sorted(folder.glob(f"*{INDEX_SUFFIX}"))
    if not indexes:
        return None
    try:
        weight_map = json.loads(indexes[0].read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise GhostedError(f"{indexes[0]} is not a safetensors index ({error}); save the model again.") from None
    outside = sorted({name for name in weight_map.values() if not _plain_file_name(name)})
    if outside:
        raise GhostedError(f"{indexes[0]} names files that are not plain safetensors files of {folder}: {outside}.")
    return weight_map


def weight_map(folder: Path) -> dict[str, str]:
    """Tensor name -> file name, from the index or the single model.safetensors (its header only)."""
    from_index = index_weight_map(folder)
    if from_index is not None:
        return from_index
    single = folder / "model.safetensors"
    if not single.is_file():
        raise MissingFileError(f"{folder} holds no model.safetensors and no safetensors index: save the model first.")
    from safetensors import safe_open

    try:
        with safe_open(str(single), framework="pt") as handle:
            return {k: single.name for k in handle.keys()}
    except Exception as error:  # safetensors' own error types
        raise GhostedError(f"{single} cannot be read ({type(error).__name__}: {error}): the checkpoint is damaged "
                           "or incomplete; re-download or re-save it.") from None


def _plain_file_name(name: object) -> bool:
    return isinstance(name, str) and name.endswith(".safetensors") and Path(name).name == name and name not in (
        ".", "..")
