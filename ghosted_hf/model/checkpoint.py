"""Reading a safetensors checkpoint's layout without loading it: which file holds which tensor, and whether the
config describes those tensors (`check_folder`, run before any model is built).

Every file an index lists must be a plain safetensors file of the folder: an index cannot send a reader elsewhere.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..architectures import ARCHITECTURES, Layout, checked_shapes, checkpoint_layer, derived_layout, refuse_non_decoder
from ..errors import GhostedError, MissingFileError, one_line
from ..remote.format_ghosted import decoder_paths, size_field_problems
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
    """Refuse a model folder whose config.json does not describe its weight files (missing files, an index naming
    tensors its files lack, a size that is no positive integer, another number of decoder layers, vocabulary, hidden
    or MLP size, a model far larger than the weights), from the index and the headers alone: seconds, and nothing
    proportional to a claimed size allocated. Returns the config."""
    folder = Path(folder)
    where = folder / "config.json"
    config = read_json_object(where, "model config")
    names = weight_map(folder)
    headers = {}
    for file in sorted(set(names.values())):
        if not (folder / file).is_file():
            raise MissingFileError(f"{file} is listed in the safetensors index of {folder} but missing (or not a "
                                   "file); re-download or re-save the model.")
        headers[file] = _header(folder / file)
    absent = [key for key, file in names.items() if key not in headers[file]]
    if absent:
        raise GhostedError(f"The safetensors index of {folder} names {len(absent)} tensors that its files do not hold "
                           f"(e.g. {absent[:3]}): the index does not belong to these files; re-save the model.")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    refuse_non_decoder(config.get("model_type"), config.get("is_encoder_decoder") is True)
    problems = [*_auto_map_problems(config.get("auto_map", {})),
                *size_field_problems(text, "text_config" if text is not config else "config")]
    if problems:
        raise GhostedError(f"{where}: {'; '.join(problems)}; the config is damaged.")
    claimed = text.get("num_hidden_layers")
    if claimed is not None:
        layout = _stored_layout(config)
        held = {checkpoint_layer(name, layout) for name in names} - {None}
        # counted, not compared with set(range(claimed)): a claim of 10**9 layers must cost nothing
        if sum(1 for i in held if i < claimed) != claimed or (made_as(config) is not None and len(held) != claimed):
            raise GhostedError(f"{where} claims {claimed} decoder layers, but the weight files hold {len(held)}: the "
                               "config does not belong to these weights; re-save the model.")
        original, removed = config.get("original_num_hidden_layers"), config.get("removed_layers")
        if made_as(config) == "ghosted" and original is not None and \
                original != claimed + len(removed if isinstance(removed, list) else ()):
            raise GhostedError(f"{where}: original_num_hidden_layers is {original!r}, not the {claimed} kept layers "
                               "plus the removed ones; the config is damaged.")
    expected = checked_shapes(text)
    for key in [key for key in expected if key in names]:
        shape = headers[names[key]][key]
        sizes, fields = [text.get(field) for field in expected[key]], ", ".join(expected[key])
        if all(isinstance(v, int) for v in sizes) and shape != sizes:
            raise GhostedError(f"{where} claims ({fields}) = {tuple(sizes)}, but {key} in the weight "
                               f"files is {tuple(shape)}: the config does not belong to these weights; re-save the "
                               "model.")
    held_values = sum(math.prod(shape) for header in headers.values() for shape in header.values())
    built = claimed_parameters(config, where)
    if built is not None and built > 2 * held_values + 1_000_000:  # an untied head at most doubles a small model
        raise GhostedError(f"{where} describes a {config.get('model_type')} model of {built:,} parameters, but the "
                           f"weight files hold {held_values:,} values: the config does not belong to these weights "
                           "(nothing was built); re-save the model.")
    return config


def _stored_layout(config: dict[str, Any]) -> Layout:
    """Where a config.json's model keeps its decoder layers: a ghosted model's `ghost_layout`, else its family's,
    derived from the family's default config (never from the claimed sizes)."""
    if made_as(config) == "ghosted":
        try:
            return Layout(**decoder_paths(config))
        except ValueError as error:
            raise GhostedError(str(error)) from None
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type in ARCHITECTURES or isinstance(config.get("text_config"), dict):
        return Layout()
    from transformers import AutoConfig

    try:
        return derived_layout(AutoConfig.for_model(model_type))
    except Exception:  # no layout derived for the type: Llama's (the derived check refuses the type when it is used)
        return Layout()


def _auto_map_problems(auto_map: Any) -> list[str]:
    """An `auto_map` entry is a class reference ("module.Class") or a list of them (a tokenizer's pair)."""
    if not isinstance(auto_map, dict):
        return [f"auto_map should hold an object of class references, and holds {auto_map!r}"]
    return [f"auto_map.{key} should name a class (\"module.Class\", or a list of them), and holds {value!r}"
            for key, value in auto_map.items() if not isinstance(value, str)
            and not (isinstance(value, list) and all(isinstance(v, (str, type(None))) for v in value))]


def claimed_parameters(config: dict[str, Any], where: Path) -> int | None:
    """How many parameters the model a config dict describes would have, counted on the meta device (nothing
    allocated); None where transformers has no class for it here (remote code, a quantized checkpoint)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = config.get("model_type")
    if config.get("quantization_config") is not None or not isinstance(model_type, str) \
            or model_type not in CONFIG_MAPPING:
        return None
    try:
        built = CONFIG_MAPPING[model_type].from_dict(config)
        if type(built) not in AutoModelForCausalLM._model_mapping:
            return None
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(built)
    except Exception as error:  # the family's own config and model classes: whatever they raise, the file is at fault
        reason = one_line(error)
        raise GhostedError(f"{where} does not describe a model transformers can build ({type(error).__name__}: "
                           f"{reason}); the config is damaged.") from None
    return sum(p.numel() for p in model.parameters())
