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

import os
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from .format_ghosted import (OPERATOR_DTYPES, check_format_version, check_sizes_against_weights, check_subblocks,
                             decoder_paths, expected_boundaries, kept_layers)

try:  # transformers >= 5.20: composite configs declare sub-configs with a spec that names a default model type
    from transformers.configuration_utils import SubConfigSpec
except ImportError:  # 4.x and 5.0-5.19: a plain {key: config class} map; the dict -> config conversion is ours
    SubConfigSpec = None

_READY = "_ghosted_init_done"


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
        check_subblocks(self.ghost_subblocks, original=kept_layers(total, removed))
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


__all__ = ["GhostedConfig"]


