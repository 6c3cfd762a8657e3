"""Configuration of a Ghosted Layers model (arXiv 2605.15491).

This file is copied next to the weights and loaded with ``trust_remote_code=True``: it imports only the
standard library and transformers.

A ghosted model is a decoder-only causal LM of a family transformers ships (its `text_config`) with whole layers
removed, attention or MLP sub-blocks replaced, or both. At each pruning boundary a C x C operator ``W`` maps the
residual stream that reaches the first surviving layer (or the final norm, when the last layers were removed) as
``x -> x @ W``; a replaced sub-block is a C x C map ``A`` of the input it read, ``h -> h @ A``, in its place. The saved format is specified in
docs/reference/format.md; `ghost_format_version` says which version a checkpoint follows.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig

try:  # transformers >= 5.20: composite configs declare sub-configs with a spec that names a default model type
    from transformers.configuration_utils import SubConfigSpec
except ImportError:  # 4.x and 5.0-5.19: a plain {key: config class} map; the dict -> config conversion is ours
    SubConfigSpec = None

OPERATOR_DTYPES = ("float32", "bfloat16")
NORM_TARGET = "norm"
LAYER_TARGET = "layer"
# The saved format's version, "MAJOR.MINOR". This code reads every checkpoint of its major version (a minor
# version only adds what older readers may ignore) and refuses a newer major version.
FORMAT_VERSION = "1.3"
# 1.1 adds the normed term of a boundary, ``x -> x @ operator + n(x) @ normed`` with n(x) = x / rms(x), read with
# this epsilon (fitted with it too: part of the format, not of the base model).
NORMED_EPS = 1e-6
# 1.2 adds replaced sub-blocks (`ghost_subblocks`): the attention or MLP module of a kept layer is a linear map.
SUBBLOCK_KINDS = ("attention", "mlp")
# 1.3 adds `ghost_layout`: where a family keeps its decoder layers and final norm when not where Llama does (GPT-2's
# `transformer.h` and `transformer.ln_f`); the ghost tensors' names follow it. Absent: Llama's layout.
DEFAULT_LAYOUT = {"layers": "model.layers", "norm": "model.norm"}
_READY = "_ghosted_init_done"
# Sizes a config states that something proportional to is built: each must be a positive integer where present.
SIZE_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size", "num_attention_heads",
               "num_key_value_heads", "head_dim")
_EMBEDDING = "model.embed_tokens.weight"


class GhostedConfig(PretrainedConfig):
    r"""Configuration of a [`GhostedForCausalLM`].

    Args:
        text_config (`dict` or `PretrainedConfig`):
            Config of the *pruned* base decoder: `num_hidden_layers` is the kept count and every per-layer list
            (`layer_types`) is already sliced to the kept layers.
        original_num_hidden_layers (`int`):
            Layer count of the dense model the pruned one came from.
        removed_layers (`list[int]`):
            Removed layer indices, in the dense model's numbering.
        ghost_boundaries (`list[dict]`):
            One record per run of consecutive removed layers: `removed` (their original indices), `target`
            (`"layer"` or `"norm"`), `layer` (index of the fed layer in the pruned model, `None` for the norm),
            `original_layer` (its index in the dense model), `operator` (the operator kind that fitted the
            tensor, e.g. `"ghost"`), `sha256` of the operator's bytes and free-form `fit` figures. Format 1.1: `normed`
            (`True` when the boundary also adds ``n(x) @ normed``, n the RMS normalisation with `NORMED_EPS`) and
            `normed_sha256` of that tensor's bytes.
        ghost_layout (`dict`, *optional*):
            Format 1.3: the module paths of the decoder layers (`layers`) and of what reads the last one's output
            (`norm`: the final norm, or the output layer of a family without one) in the family's causal LM, where they are not Llama's `model.layers` and `model.norm` (GPT-2:
            `transformer.h`, `transformer.ln_f`). The ghost tensors are named under these paths.
        base_config (`dict` or `PretrainedConfig`, *optional*):
            Format 1.3: a multimodal base's config (Gemma 3's, Llama 4's: vision tower, projector, image tokens)
            without its text config, which `text_config` is; absent for a text-only base.
        operator_dtype (`str`):
            Storage and compute dtype of the operators, `"float32"` (default, whatever the model dtype) or
            `"bfloat16"`.
        ghost_subblocks (`list[dict]`):
            Format 1.2: one record per replaced sub-block of a kept layer: `layer` (its index in the pruned model),
            `original_layer` (in the dense model), `block` (`"attention"` or `"mlp"`), `module` (the attribute of the
            layer it replaces, e.g. `"self_attn"`), `outputs` (how many values the module returned: 0 for a bare
            tensor), `sha256` of the map's bytes and free-form `fit` figures.
        ghost_provenance (`dict`):
            How the operators were obtained (selection, calibration data and hash, solver settings, versions).
        ghost_format_version (`str`):
            Version of the saved format, "MAJOR.MINOR": the oldest that describes the checkpoint
            (`required_format_version`); this code reads every 1.x up to `FORMAT_VERSION`.
    """

    model_type = "ghosted"

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any):
        # Before the base decoder's config is built: some build per-layer lists as long as the claimed depth.
        if args and isinstance(args[0], (str, os.PathLike)):
            check_sizes_against_weights(str(args[0]), kwargs)
        return super().from_pretrained(*args, **kwargs)
    if SubConfigSpec is not None:
        sub_configs_defaults = {"text_config": SubConfigSpec(config_class=AutoConfig, model_type="llama")}
    else:
        sub_configs = {"text_config": AutoConfig}

    def __init__(
        self,
        text_config: dict | PretrainedConfig | None = None,
        original_num_hidden_layers: int | None = None,
        removed_layers: list[int] | None = None,
        ghost_boundaries: list[dict[str, Any]] | None = None,
        operator_dtype: str = "float32",
        ghost_provenance: dict[str, Any] | None = None,
        ghost_subblocks: list[dict[str, Any]] | None = None,
        ghost_format_version: str = "1.0",  # a config.json written before the field existed is 1.0
        ghost_layout: dict[str, str] | None = None,
        base_config: dict | PretrainedConfig | None = None,
        **kwargs: Any,
    ) -> None:
        # Set before the parent init (recent versions read it there). Turned into a config object here on every
        # version: older parents leave a dict as it is.
        self.text_config = _text_config_object(text_config)
        self.original_num_hidden_layers = original_num_hidden_layers
        self.removed_layers = [int(i) for i in (removed_layers or [])]
        self.ghost_boundaries = [dict(b) for b in (ghost_boundaries or [])]
        self.operator_dtype = operator_dtype
        self.ghost_provenance = dict(ghost_provenance or {})
        self.ghost_subblocks = [dict(b) for b in (ghost_subblocks or [])]
        self.ghost_format_version = ghost_format_version
        self.ghost_layout = dict(ghost_layout) if isinstance(ghost_layout, dict) else ghost_layout
        self.base_config = _base_config_object(base_config, self.text_config)
        tie = kwargs.pop("tie_word_embeddings", None)
        super().__init__(**kwargs)
        if self.original_num_hidden_layers is None:
            self.original_num_hidden_layers = self.text_config.num_hidden_layers + len(self.removed_layers)
        # Generation and weight tying read these from the top-level config: keep one source of truth.
        tied_by = self.base_config if self.base_config is not None else self.text_config
        self.tie_word_embeddings = getattr(tied_by, "tie_word_embeddings", False) if tie is None else tie
        # Our own end-of-init marker: the parent's `_post_init_done` only exists from transformers 5.22 on.
        self.__dict__[_READY] = True

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: expose the base decoder's fields (hidden_size, vocab_size, ...)
        # so that generic tools (generate, PEFT, lm-eval) can read them from `model.config`.
        # Not during __init__, where the parent probes optional fields with hasattr(); never a private attribute
        # (a heterogeneous text config's `_heterogeneity_spec` would make this config claim per-layer configs).
        if name.startswith("_") or not self.__dict__.get(_READY):
            raise AttributeError(name)
        # A multimodal base's own fields (vision_config, image_token_id, ...) after the language decoder's.
        for source in (self.__dict__["text_config"], self.__dict__.get("base_config")):
            try:
                return getattr(source, name)
            except AttributeError:
                pass
            except RuntimeError as error:  # a size that differs by layer (Gemma 4's head_dim): no one value here
                raise AttributeError(f"{name}: {error}") from error
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        output.pop(_READY, None)  # older versions serialise every instance attribute
        return _without_nested_text(output, self.base_config)

    def to_diff_dict(self) -> dict[str, Any]:
        # config.json is written as the difference from a default config, which would drop the version
        # (it equals the default): a checkpoint always says which format it is.
        output = super().to_diff_dict()
        output.pop(_READY, None)
        output["ghost_format_version"] = self.ghost_format_version
        return _without_nested_text(output, self.base_config)

    def validate_ghost_layout(self) -> None:
        """Raise a ValueError naming the problem if the pruning metadata contradicts itself."""
        check_format_version(self.ghost_format_version)
        decoder_paths(self)
        text = self.text_config
        if self.operator_dtype not in OPERATOR_DTYPES:
            raise ValueError(f"operator_dtype must be one of {OPERATOR_DTYPES}, got {self.operator_dtype!r}.")
        total, removed = self.original_num_hidden_layers, self.removed_layers
        if not isinstance(total, int) or sorted(set(removed)) != removed or any(not 0 <= i < total for i in removed):
            raise ValueError(f"removed_layers must be sorted, unique and in [0, {total}); got {removed}.")
        kept = total - len(removed)
        if text.num_hidden_layers != kept:  # before anything as long as `total` is built
            raise ValueError(
                f"Config mismatch: {total} original layers minus {len(removed)} removed leaves {kept}, "
                f"but text_config.num_hidden_layers is {text.num_hidden_layers}."
            )
        layer_types = getattr(text, "layer_types", None)
        if layer_types is not None and len(layer_types) != kept:
            raise ValueError(f"text_config.layer_types has {len(layer_types)} entries for {kept} layers.")
        for b in self.ghost_boundaries:
            if not isinstance(b.get("normed", False), bool):
                raise ValueError(f"ghost_boundaries: `normed` must be true or false, got {b['normed']!r}.")
        check_subblocks(self.ghost_subblocks, original=[i for i in range(total) if i not in set(removed)])
        found = [(b.get("target"), b.get("layer"), list(b.get("removed", []))) for b in self.ghost_boundaries]
        expected = expected_boundaries(total, removed)
        if found != [(b["target"], b["layer"], b["removed"]) for b in expected]:
            raise ValueError(
                f"ghost_boundaries {found} do not match removed_layers {removed} "
                f"(expected {[(b['target'], b['layer'], b['removed']) for b in expected]})."
            )


def _text_config_object(text_config: dict | PretrainedConfig | None) -> PretrainedConfig:
    """The base decoder's config object, from a dict (as read from config.json) or None (Llama defaults)."""
    if isinstance(text_config, PretrainedConfig):
        return text_config
    values = dict(text_config or {})
    model_type = values.pop("model_type", "llama")
    config = AutoConfig.for_model(model_type, **values)
    # transformers 5 writes the rotary settings as `rope_parameters`; 4.x reads `rope_theta` / `rope_scaling` and
    # would silently use its defaults: carry them over where this version's config has its own `rope_theta`.
    rope = values.get("rope_parameters")
    if isinstance(rope, dict) and hasattr(config, "rope_theta") and "rope_theta" in rope \
            and config.rope_theta != rope["rope_theta"]:
        config.rope_theta = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default" and getattr(config, "rope_scaling", None) is None:
            config.rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    return config


def _base_config_object(base_config: dict | PretrainedConfig | None, text_config: PretrainedConfig
                        ) -> PretrainedConfig | None:
    """A multimodal base's config (vision tower, projector, image tokens) holding `text_config`, the very object, as
    its language decoder's: the pruned text config is stored once (as `text_config`)."""
    if base_config is None:
        return None
    if not isinstance(base_config, PretrainedConfig):
        values = {k: v for k, v in dict(base_config).items() if k != "text_config"}
        base_config = AutoConfig.for_model(values.pop("model_type"), text_config=text_config.to_dict(), **values)
    base_config.text_config = text_config
    return base_config


def _without_nested_text(output: dict[str, Any], base_config: PretrainedConfig | None) -> dict[str, Any]:
    """config.json's `base_config` without its text config, which `text_config` holds."""
    if base_config is None:
        output.pop("base_config", None)
    elif isinstance(output.get("base_config"), dict):
        output["base_config"] = {k: v for k, v in output["base_config"].items() if k != "text_config"}
    else:
        output["base_config"] = {k: v for k, v in base_config.to_dict().items() if k != "text_config"}
    return output


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
    """The oldest format version that describes a checkpoint: 1.3 with a layout other than Llama's (a multimodal
    base's included), 1.2 with replaced sub-blocks, 1.1 where a boundary has a normed term, else 1.0 (which every 1.x
    reader loads)."""
    if layout:
        return "1.3"
    if subblocks:
        return "1.2"
    return "1.1" if any(b.get("normed") for b in boundaries) else "1.0"


def decoder_paths(config: Any) -> dict[str, str]:
    """{"layers": path, "norm": path} of a ghosted config (a `GhostedConfig` or its dict): its `ghost_layout`, or
    Llama's; a ValueError naming a malformed one."""
    layout = config.get("ghost_layout") if isinstance(config, dict) else getattr(config, "ghost_layout", None)
    if layout is None:
        return dict(DEFAULT_LAYOUT)
    if not isinstance(layout, dict) or set(layout) != set(DEFAULT_LAYOUT) or not all(
            isinstance(v, str) and all(part.isidentifier() for part in v.split(".")) for v in layout.values()) \
            or "." not in layout["layers"]:
        raise ValueError(f"ghost_layout must map 'layers' and 'norm' to module paths such as 'transformer.h', got "
                         f"{layout!r}: the config.json is damaged.")
    return dict(layout)


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


def pruned_index(layer: int, removed: list[int]) -> int:
    """Index in the pruned model of kept dense layer `layer`."""
    return layer - sum(1 for i in removed if i < layer)


__all__ = ["GhostedConfig"]


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


def _checkpoint_layout(locate) -> tuple[list[str], list[int] | None] | None:
    """(the tensor names of a checkpoint's safetensors files, the embedding's shape), reading only the index and
    headers; None where they cannot be located here. Every name an index lists must be in its file's header."""
    try:
        index = locate("model.safetensors.index.json")
        single = None if index is not None else locate("model.safetensors")
    except OSError:
        return None
    if index is None and single is None:
        return None
    if index is None:
        header = safetensors_header(single)
        return [k for k in header if k != "__metadata__"], (header.get(_EMBEDDING) or {}).get("shape")
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
    holder = weight_map.get(_EMBEDDING)
    return list(weight_map), (headers[holder].get(_EMBEDDING) or {}).get("shape") if holder else None


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
    names, embedding = layout
    claimed = text.get("num_hidden_layers")
    prefix = decoder_paths(config)["layers"] + "."
    held = {int(index) for index, _, rest in (n[len(prefix):].partition(".") for n in names if n.startswith(prefix))
            if index.isdigit() and rest}
    if isinstance(claimed, int) and (len(held) != claimed or (held and max(held) != claimed - 1)):
        raise ValueError(f"config.json claims {claimed} decoder layers (text_config.num_hidden_layers), but the "
                         f"weight files hold {len(held)}: the config does not belong to these weights.")
    sizes = [text.get("vocab_size"), text.get("hidden_size")]
    if embedding is not None and sizes != list(embedding):
        raise ValueError(f"config.json claims a vocabulary of {sizes[0]} and a hidden size of {sizes[1]}, but the "
                         f"weight files' embedding is {list(embedding)}: the config does not belong to these weights.")
