"""Reading a safetensors checkpoint's layout without loading it: which file holds which tensor, and whether the
config describes those tensors (`check_folder`, run before any model is built).

Every file an index lists must be a plain safetensors file of the folder: an index cannot send a reader elsewhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..architectures import checked_shapes, layer_of
from ..errors import GhostedError, MissingFileError
from ..utils.diskio import read_json_object

INDEX_SUFFIX = ".safetensors.index.json"


def made_as(config: Any) -> str | None:
    """What ghosted_hf made a config's model as (a config object or its config.json dict): "ghosted" (a
    GhostedForCausalLM), "stock" (a stock checkpoint it exported; the provenance keeps the pruned layout), or None
    (a model ghosted_hf did not make). The one answer every command asks."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    if get("model_type") == "ghosted":
        return "ghosted"
    provenance = get("ghost_provenance")
    return "stock" if isinstance(provenance, dict) and "stock_export" in provenance else None


def index_weight_map(folder: Path) -> dict[str, str] | None:
    """The weight map of the folder's safetensors index (tensor name -> file name), None without an index."""
    indexes = sorted(folder.glob(f"*{INDEX_SUFFIX}"))
    if not indexes:
        return None
    weight_map = read_json_object(indexes[0], "safetensors index", {"weight_map": dict})["weight_map"]
    outside = sorted({name for name in weight_map.values() if not _plain_file_name(name)})
    if outside:
        raise GhostedError(f"{indexes[0]} names files that are not plain safetensors files of {folder}: {outside}.")
    return weight_map


def _header(file: Path, keys: list[str] | None = None) -> dict[str, list[int]]:
    """Tensor name -> shape of `keys` (default: every tensor), from a safetensors file's header only."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            return {key: list(handle.get_slice(key).get_shape()) for key in (handle.keys() if keys is None else keys)}
    except Exception as error:  # safetensors' own error types
        raise GhostedError(f"{file} is damaged or truncated ({type(error).__name__}: {error}); re-download or "
                           "re-save the model.") from None


def weight_map(folder: Path) -> dict[str, str]:
    """Tensor name -> file name, from the index or the single model.safetensors (its header only)."""
    from_index = index_weight_map(folder)
    if from_index is not None:
        return from_index
    single = folder / "model.safetensors"
    if single.exists() and not single.is_file():
        raise GhostedError(f"{single} is not a regular file (a folder, a FIFO or a device): re-save the model.")
    if not single.is_file():
        raise MissingFileError(f"{folder} holds no model.safetensors and no safetensors index: save the model first.")
    return dict.fromkeys(_header(single), single.name)


def _plain_file_name(name: object) -> bool:
    return isinstance(name, str) and name.endswith(".safetensors") and Path(name).name == name


def check_folder(folder: str | Path) -> dict[str, Any]:
    """Refuse a model folder whose config.json does not describe its weight files (missing files, another number of
    decoder layers, vocabulary, hidden or MLP size), from the index and the headers alone: seconds, before any model
    of the claimed size is built. Returns the config."""
    folder = Path(folder)
    config = read_json_object(folder / "config.json", "model config")
    names = weight_map(folder)
    for file in sorted(set(names.values())):
        if not (folder / file).is_file():
            raise MissingFileError(f"{file} is listed in the safetensors index of {folder} but missing (or not a "
                                   "file); re-download or re-save the model.")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    claimed = text.get("num_hidden_layers")
    if claimed is not None:
        if not isinstance(claimed, int) or isinstance(claimed, bool) or claimed < 1:
            raise GhostedError(f"{folder / 'config.json'}: num_hidden_layers should be a positive integer, and is "
                               f"{claimed!r}; the config is damaged.")
        held = {layer_of(name) for name in names} - {None}
        if not held >= set(range(claimed)) or (made_as(config) is not None and len(held) != claimed):
            raise GhostedError(f"{folder / 'config.json'} claims {claimed} decoder layers, but the weight files hold "
                               f"{len(held)}: the config does not belong to these weights; re-save the model.")
    expected = checked_shapes(text)
    for key in [key for key in expected if key in names]:
        shape = _header(folder / names[key], [key])[key]
        sizes, fields = [text.get(field) for field in expected[key]], ", ".join(expected[key])
        if all(isinstance(v, int) for v in sizes) and shape != sizes:
            raise GhostedError(f"{folder / 'config.json'} claims ({fields}) = {tuple(sizes)}, but {key} in the weight "
                               f"files is {tuple(shape)}: the config does not belong to these weights; re-save the "
                               "model.")
    return config
