"""The ghosted checkpoint format's names and checks, with no model: its constants, the boundaries a removal makes,
where each ghost tensor sits and its hash, and the sizes a config.json claims checked against its weight files before
anything of that size is built. Copied next to the weights with the model code; imports only torch and the standard
library (transformers' file lookup where a checkpoint is located)."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

OPERATOR_DTYPES = ("float32", "bfloat16")
NORM_TARGET = "norm"
LAYER_TARGET = "layer"
# The saved format's version, "MAJOR.MINOR". This code reads every checkpoint of its major version (a minor
# version only adds what older readers may ignore) and refuses a newer major version.
FORMAT_VERSION = "1.5"
# 1.1 adds the normed term of a boundary, ``x -> x @ operator + n(x) @ normed`` with n(x) = x / rms(x), read with
# this epsilon (fitted with it too: part of the format, not of the base model).
NORMED_EPS = 1e-6
# 1.2 adds replaced sub-blocks (`ghost_subblocks`): the attention or MLP module of a kept layer is a linear map.
SUBBLOCK_KINDS = ("attention", "mlp")
# 1.3 adds `ghost_layout`: where a family keeps its decoder layers and final norm when not where Llama does (GPT-2's
# `transformer.h` and `transformer.ln_f`); the ghost tensors' names follow it. Absent: Llama's layout.
DEFAULT_LAYOUT = {"layers": "model.layers", "norm": "model.norm"}
# 1.4 adds rank-r sub-block maps: a record with `rank` r holds its map as two factors, `....ghost.down` (C, r) and
# `....ghost.up` (r, C), applied as h -> (h @ down) @ up: 2 C r values where the full map holds C^2.
GHOST_DOWN, GHOST_UP = "down", "up"
# 1.5 adds `streams` to `ghost_layout`: a residual of k hidden_size-wide streams between layers (hyper-connections),
# so each boundary's operator is (k C) x (k C), and `norm` names what reads the last layer's output (a stream mixer).
# Sizes a config states that something proportional to is built: each must be a positive integer where present.
SIZE_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size", "num_attention_heads",
               "num_key_value_heads", "head_dim")
_EMBEDDING = "model.embed_tokens.weight"
# A ghost tensor lives in a child module `ghost` of what it acts on (a layer, the final norm, a replaced sub-block):
# `....ghost.operator`, and a normed boundary's `....ghost.normed`.
GHOST_MODULE = "ghost"
GHOST_PARAM = "operator"
GHOST_NORMED = "normed"


def check_format_version(version: Any) -> None:
    """Refuse a checkpoint written in a newer major version of the format (or with no readable version)."""
    major = str(version).split(".")[0]
    if not major.isdigit() or len(str(version).split(".")) != 2:
        raise ValueError(f"ghost_format_version {version!r} is not of the form MAJOR.MINOR (this code writes "
                         f"{FORMAT_VERSION!r}): the config.json is damaged.")
    if int(major) > int(FORMAT_VERSION.split(".")[0]):
        raise ValueError(f"This checkpoint uses Ghosted format {version}, newer than this code reads "
                         f"({FORMAT_VERSION.split('.')[0]}.x): update ghosted_hf (pip install -U ghosted_hf), or load "
                         "with the remote code saved beside the checkpoint (trust_remote_code=True, without "
                         "ghosted_hf imported).")


def required_format_version(boundaries: list[dict[str, Any]], subblocks: list[dict[str, Any]] = (),
                            layout: dict[str, str] | None = None) -> str:
    """The oldest format version that describes a checkpoint: 1.5 with several residual streams, 1.4 with a rank-r
    sub-block map, 1.3 with a layout other than Llama's (a multimodal base's included), 1.2 with replaced sub-blocks,
    1.1 where a boundary has a normed term, else 1.0 (which every 1.x reader loads)."""
    if layout and layout.get("streams", 1) > 1:
        return "1.5"
    if any(s.get("rank") for s in subblocks):
        return "1.4"
    if layout:
        return "1.3"
    if subblocks:
        return "1.2"
    return "1.1" if any(b.get("normed") for b in boundaries) else "1.0"


def decoder_paths(config: Any) -> dict[str, str]:
    """{"layers": path, "norm": path} of a ghosted config (a `GhostedConfig` or its dict): its `ghost_layout`, or
    Llama's; a ValueError naming a malformed one."""
    layout = _ghost_layout(config)
    return {key: layout[key] for key in DEFAULT_LAYOUT} if layout is not None else dict(DEFAULT_LAYOUT)


def stream_count(config: Any) -> int:
    """How many hidden_size-wide streams a ghosted config's residual carries between layers (format 1.5): 1 but for
    hyper-connections."""
    layout = _ghost_layout(config)
    return layout.get("streams", 1) if layout is not None else 1


def _ghost_layout(config: Any) -> dict[str, Any] | None:
    layout = config.get("ghost_layout") if isinstance(config, dict) else getattr(config, "ghost_layout", None)
    if layout is None:
        return None
    streams = layout.get("streams", 1) if isinstance(layout, dict) else None
    if not isinstance(layout, dict) or set(layout) - {"streams"} != set(DEFAULT_LAYOUT) or not all(
            isinstance(layout[k], str) and all(part.isidentifier() for part in layout[k].split("."))
            for k in DEFAULT_LAYOUT) or "." not in layout["layers"] \
            or not isinstance(streams, int) or isinstance(streams, bool) or streams < 1:
        raise ValueError(f"ghost_layout must map 'layers' and 'norm' to module paths such as 'transformer.h' (and "
                         f"'streams' to a positive count where there are several), got {layout!r}: the config.json "
                         "is damaged.")
    return layout


def check_subblocks(records: list[dict[str, Any]], original: list[int]) -> None:
    """Raise a ValueError naming the problem in `ghost_subblocks` records (`original`: the dense index of each kept
    layer)."""
    seen = set()
    for record in records:
        layer, block, module = record.get("layer"), record.get("block"), record.get("module")
        if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < len(original):
            raise ValueError(f"ghost_subblocks: layer must be a kept layer's index in [0, {len(original)}), got "
                             f"{layer!r}.")
        if block not in SUBBLOCK_KINDS:
            raise ValueError(f"ghost_subblocks: block must be one of {SUBBLOCK_KINDS}, got {block!r}.")
        if not isinstance(module, str) or not module.isidentifier():
            raise ValueError(f"ghost_subblocks: module must name the layer's attribute it replaces, got {module!r}.")
        if record.get("original_layer", original[layer]) != original[layer]:
            raise ValueError(f"ghost_subblocks: pruned layer {layer} is dense layer {original[layer]}, but the record "
                             f"says {record['original_layer']}.")
        outputs = record.get("outputs", 0)
        if not isinstance(outputs, int) or isinstance(outputs, bool) or outputs < 0:
            raise ValueError(f"ghost_subblocks: outputs must be a count (0 for a bare tensor), got {outputs!r}.")
        rank = record.get("rank")
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 1):
            raise ValueError(f"ghost_subblocks: rank must be a positive count (absent for a full map), got {rank!r}.")
        if (layer, block) in seen:
            raise ValueError(f"ghost_subblocks: the {block} of layer {layer} is listed twice.")
        seen.add((layer, block))


def expected_boundaries(total_layers: int, removed: list[int]) -> list[dict[str, Any]]:
    """One boundary per run of consecutive removed layers, pointing at what it feeds in the pruned model."""
    removed = sorted(removed)
    runs: list[list[int]] = []
    for i in removed:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    boundaries = []
    for run in runs:
        fed = run[-1] + 1
        if fed >= total_layers:
            boundaries.append({"removed": run, "target": NORM_TARGET, "layer": None, "original_layer": None})
        else:
            boundaries.append({"removed": run, "target": LAYER_TARGET, "layer": pruned_index(fed, removed),
                               "original_layer": fed})
    return boundaries


def kept_layers(total_layers: int, removed: Iterable[int]) -> list[int]:
    """The dense numbers of the kept layers, in order: the pruned model's layer i is dense layer kept_layers(...)[i]."""
    removed = set(removed)
    return [i for i in range(total_layers) if i not in removed]


def pruned_index(layer: int, removed: list[int]) -> int:
    """Index in the pruned model of kept dense layer `layer`."""
    return layer - sum(1 for i in removed if i < layer)


def size_field_problems(text: dict[str, Any], where: str = "text_config") -> list[str]:
    """What is wrong with a config dict's size fields (`SIZE_FIELDS`): each must be a positive integer."""
    return [f"{where}.{name} must be a positive integer, and is {text[name]!r}" for name in SIZE_FIELDS
            if text.get(name) is not None and (type(text[name]) is not int or text[name] < 1)]


def safetensors_header(file: str) -> dict[str, Any]:
    """A safetensors file's header (tensor name -> dtype, shape, offsets), read without the tensors."""
    with open(file, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise ValueError(f"{file} is empty or truncated ({len(head)} bytes): it is not a safetensors file; "
                             "download or save the model again.")
        (length,) = struct.unpack("<Q", head)
        if length > 100_000_000:  # a header of more than 100 MB is no safetensors header
            raise ValueError(f"{file} is not a safetensors file (header length {length}).")
        try:
            header = json.loads(handle.read(length))
        except ValueError:
            header = None
        if not isinstance(header, dict):
            raise ValueError(f"{file} is damaged: its safetensors header is not readable; download or save the model "
                             "again.")
        return header


def _locator(path: str, kwargs: dict[str, Any]):
    """A function from a file name of the checkpoint to its local path (None where it has no such file),
    with the location arguments `from_pretrained` was given."""
    from transformers.utils import cached_file

    options = {k: kwargs[k] for k in ("revision", "cache_dir", "token", "local_files_only", "subfolder") if k in kwargs}
    return lambda name: cached_file(path, name, _raise_exceptions_for_missing_entries=False, **options)


def _checkpoint_layout(locate) -> dict[str, list[int]] | None:
    """The tensor names of a checkpoint's safetensors files with their shapes, reading only the index and headers;
    None where they cannot be located here. Every name an index lists must be in its file's header."""
    try:
        index = locate("model.safetensors.index.json")
        single = None if index is not None else locate("model.safetensors")
    except OSError:
        return None
    if index is None and single is None:
        return None
    if index is None:
        header = safetensors_header(single)
        return {k: _shape(v) for k, v in header.items() if k != "__metadata__"}
    try:
        weight_map = json.loads(Path(index).read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ValueError(f"{index} is not a readable safetensors index; download or save the model again.") from None
    headers = {}
    for name in files:
        local = locate(name) if isinstance(name, str) and Path(name).name == name else None
        if local is None:
            return None  # not here (a Hub checkpoint not downloaded yet): from_pretrained fetches and checks it
        headers[name] = safetensors_header(local)
    absent = [key for key, name in weight_map.items() if key not in headers[name]]
    if absent:
        raise ValueError(f"{index} names {len(absent)} tensors that its files do not hold (e.g. {absent[:3]}): the "
                         "index does not belong to these files; download or save the model again.")
    return {key: _shape(headers[name][key]) for key, name in weight_map.items()}


def _shape(entry: Any) -> list[int] | None:
    return entry.get("shape") if isinstance(entry, dict) else None


def check_sizes_against_weights(path: str, kwargs: dict[str, Any]) -> None:
    """Refuse a config.json whose sizes (decoder layers, vocabulary, hidden size) are not those of its weight
    files, before anything of the claimed size is allocated."""
    locate = _locator(path, kwargs)
    try:
        config = json.loads(Path(locate("config.json")).read_text())
        text = config.get("text_config", {})
    except (OSError, ValueError, TypeError, AttributeError):
        return  # no readable config here: from_pretrained itself reports that
    if not isinstance(text, dict):
        return
    problems = size_field_problems(text)
    removed, original = config.get("removed_layers") or [], config.get("original_num_hidden_layers")
    if not problems and isinstance(removed, list) and text.get("num_hidden_layers") is not None \
            and original is not None and original != text["num_hidden_layers"] + len(removed):
        problems.append(f"original_num_hidden_layers is {original!r}, not the {text['num_hidden_layers']} kept layers "
                        f"plus the {len(removed)} removed")
    if problems:
        raise ValueError(f"config.json is damaged: {'; '.join(problems)}. Save the model again.")
    layout = _checkpoint_layout(locate)
    if layout is None:
        return
    claimed, embedding = text.get("num_hidden_layers"), layout.get(_EMBEDDING)
    prefix = decoder_paths(config)["layers"] + "."
    held = {int(index) for index, _, rest in (n[len(prefix):].partition(".") for n in layout if n.startswith(prefix))
            if index.isdigit() and rest}
    if isinstance(claimed, int) and (len(held) != claimed or (held and max(held) != claimed - 1)):
        raise ValueError(f"config.json claims {claimed} decoder layers (text_config.num_hidden_layers), but the "
                         f"weight files hold {len(held)}: the config does not belong to these weights.")
    sizes = [text.get("vocab_size"), text.get("hidden_size")]
    if embedding is not None and sizes != list(embedding):
        raise ValueError(f"config.json claims a vocabulary of {sizes[0]} and a hidden size of {sizes[1]}, but the "
                         f"weight files' embedding is {list(embedding)}: the config does not belong to these weights.")
    if isinstance(sizes[1], int):  # (each held ghost tensor's size, before one is built: a claimed stream count too)
        wrong = [f"{name} (checkpoint {tuple(layout[name])}, config {shape})" for name, shape
                 in ghost_tensor_shapes(config, sizes[1]).items() if layout.get(name, list(shape)) != list(shape)]
        if wrong:
            raise ValueError(f"Ghost tensors of the wrong shape: {wrong[:3]}: the config does not belong to these "
                             "weights.")


def operator_sha256(operator: torch.Tensor, dtype: str) -> str:
    """Hex sha256 of an operator's raw bytes in its storage dtype `dtype` (CPU, C-contiguous; bf16 as bytes)."""
    tensor = operator.detach().to(device="cpu", dtype=getattr(torch, dtype)).contiguous()
    return hashlib.sha256(tensor.view(torch.uint8).numpy().tobytes()).hexdigest()


def ghost_tensor_key(boundary: dict[str, Any], param: str = GHOST_PARAM, paths: dict[str, str] | None = None) -> str:
    """State-dict key of a boundary's operator (or of its other tensor `param`), or of a replaced sub-block's map,
    in a model whose decoder layers and final norm sit at `paths` (`decoder_paths`; Llama's by default)."""
    paths = paths or decoder_paths({})
    layers, norm = paths["layers"], paths["norm"]
    if "block" in boundary:
        return f"{layers}.{boundary['layer']}.{boundary['module']}.{GHOST_MODULE}.{param}"
    if boundary["target"] == LAYER_TARGET:
        return f"{layers}.{boundary['layer']}.{GHOST_MODULE}.{param}"
    return f"{norm}.{GHOST_MODULE}.{param}"


def ghost_tensor_keys(boundary: dict[str, Any], paths: dict[str, str] | None = None) -> dict[str, str]:
    """{the config field holding its sha256: state-dict key} of every tensor of a boundary (or sub-block record)."""
    if boundary.get("rank"):  # a rank-r map: its two factors
        return {f"{part}_sha256": ghost_tensor_key(boundary, part, paths) for part in (GHOST_DOWN, GHOST_UP)}
    keys = {"sha256": ghost_tensor_key(boundary, paths=paths)}
    if boundary.get("normed"):
        keys["normed_sha256"] = ghost_tensor_key(boundary, GHOST_NORMED, paths)
    return keys


def ghost_tensor_shapes(config: Any, hidden: int) -> dict[str, tuple[int, int]]:
    """The shape of every ghost tensor of a ghosted config (a `GhostedConfig` or its dict) whose language decoder is
    `hidden` wide: a boundary's operator and normed term map the residual stream (its streams x `hidden`), a
    sub-block's map what the sub-block reads and returns (`hidden`), as two factors where it has a rank."""
    get = config.get if isinstance(config, dict) else lambda name, default: getattr(config, name, default)
    width, paths, shapes = hidden * stream_count(config), decoder_paths(config), {}
    for record in get("ghost_boundaries", None) or []:
        shapes.update(dict.fromkeys(ghost_tensor_keys(record, paths).values(), (width, width)))
    for record in get("ghost_subblocks", None) or []:
        rank = record.get("rank")
        parts = ((hidden, rank), (rank, hidden)) if rank else ((hidden, hidden),)
        shapes.update(zip(ghost_tensor_keys(record, paths).values(), parts))
    return shapes


def ghost_records(config: Any) -> list[dict[str, Any]]:
    """Every record of a ghosted config that owns ghost tensors: the boundaries, then the replaced sub-blocks."""
    return [*config.ghost_boundaries, *getattr(config, "ghost_subblocks", [])]
