"""Ghosted Layers causal LM (arXiv 2605.15491): a pruned decoder-only causal LM (any family transformers ships) whose
residual stream is mapped by a closed-form C x C operator at each pruning boundary.

This file is copied next to the weights (with the files it imports: the format's names, the integrity checks, the
staged folder write) and loaded with ``trust_remote_code=True``: it imports only torch, transformers, the standard
library and those files, and only defines the model.

Weight layout (``model.safetensors``): the base decoder keeps its standard names
(``model.layers.{i}.self_attn.q_proj.weight``, ``model.norm.weight``, ``lm_head.weight``); each operator is
the tensor ``model.layers.{i}.ghost.operator`` (applied to the hidden state entering pruned-model layer
``i``) or ``model.norm.ghost.operator`` (applied before the final norm), of shape (C, C), used as
``x -> x @ operator``. A boundary marked `normed` (format 1.1) also has ``....ghost.normed`` and maps
``x -> x @ operator + n(x) @ normed``, n(x) = x / sqrt(mean(x^2) + NORMED_EPS). A replaced sub-block (format 1.2)
is the tensor ``model.layers.{i}.{module}.ghost.operator`` (e.g. ``model.layers.3.self_attn.ghost.operator``): the
module returns ``h @ operator`` for the input ``h`` it was given, and an attention-free layer stores no keys or values
in the KV cache; a rank-r map (format 1.4) is ``....ghost.down`` (C, r) and ``....ghost.up`` (r, C), applied as
``(h @ down) @ up``. config.json records each tensor's sha256 and the format version (docs/reference/format.md).
"""

from __future__ import annotations

import inspect
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import (AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText, GenerationMixin, LlamaForCausalLM,
                          PreTrainedModel)

from .cache_ghosted import track_positions
from .configuration_ghosted import GhostedConfig
from .format_ghosted import (GHOST_MODULE, LAYER_TARGET, NORMED_EPS, check_sizes_against_weights, decoder_paths,
                             ghost_records, ghost_tensor_keys, stream_count)
from .integrity_ghosted import check_loaded, operator_value_problems, refresh_integrity
from .staging_ghosted import carry_over, staged_folder

logger = logging.getLogger(__name__)

# Oldest transformers this file is tested on. Support is decided by the features below, never by the version.
MIN_TRANSFORMERS = "4.57"
_lacking = [
    name
    for name, present in (
        ("PreTrainedModel.loss_function", hasattr(PreTrainedModel, "loss_function")),
        # keeps float32 operators float32 under from_pretrained(dtype=torch.bfloat16)
        ("PreTrainedModel._keep_in_fp32_modules_strict", hasattr(PreTrainedModel, "_keep_in_fp32_modules_strict")),
    )
    if not present
]
if _lacking:
    import transformers as _transformers

    raise ImportError(
        f"ghosted remote code needs transformers >= {MIN_TRANSFORMERS}; found {_transformers.__version__} "
        f"(no {', '.join(_lacking)}): pip install -U transformers"
    )

# How this transformers declares tied weights, read off its own Llama: a {tied: source} dict (5.x) or a list
# of tied names (4.x).
if isinstance(getattr(LlamaForCausalLM, "_tied_weights_keys", None), dict):
    TIED_WEIGHTS_KEYS: Any = {"lm_head.weight": "model.embed_tokens.weight"}
else:
    TIED_WEIGHTS_KEYS = ["lm_head.weight"]


def rms_normalized(x: torch.Tensor) -> torch.Tensor:
    """n(x) = x / sqrt(mean(x^2) + NORMED_EPS) over the channels: the normed term's input (an RMSNorm without
    a weight; the weight is part of `normed`)."""
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + NORMED_EPS)


class GhostOperator(nn.Module):
    """Maps the residual stream entering its parent module: ``x -> x @ operator`` (``+ n(x) @ normed`` with a
    normed term).

    Lives as a child of the layer (or final norm) it feeds, so the base weight names stay standard and
    device placement follows the parent. The products are computed in the operator's dtype (float32 by
    default) and cast back to the activation dtype.
    """

    def __init__(self, hidden_size: int, dtype: torch.dtype = torch.float32, normed: bool = False) -> None:
        super().__init__()
        self.operator = nn.Parameter(torch.empty(hidden_size, hidden_size, dtype=dtype))
        self.normed = nn.Parameter(torch.empty(hidden_size, hidden_size, dtype=dtype)) if normed else None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        operator = self.operator
        x = hidden_states.to(device=operator.device, dtype=operator.dtype)
        mapped = x @ operator
        if self.normed is not None:
            mapped = mapped + rms_normalized(x) @ self.normed
        return mapped.to(device=hidden_states.device, dtype=hidden_states.dtype)

    def extra_repr(self) -> str:
        normed = ", normed" if self.normed is not None else ""
        return f"{self.operator.shape[0]}, dtype={self.operator.dtype}{normed}"


class GhostMap(nn.Module):
    """The map that stands in for a removed sub-block, ``h -> h @ operator`` (C x C), or of rank r (format 1.4)
    ``h -> (h @ down) @ up`` with down (C, r) and up (r, C). A freshly built one is zero: the sub-block removed.
    Computed in the map's dtype and cast back, as a boundary's operator is."""

    def __init__(self, hidden_size: int, dtype: torch.dtype = torch.float32, rank: int | None = None) -> None:
        super().__init__()
        if rank is None:
            self.operator = nn.Parameter(torch.empty(hidden_size, hidden_size, dtype=dtype))
        else:
            self.down = nn.Parameter(torch.empty(hidden_size, rank, dtype=dtype))
            self.up = nn.Parameter(torch.empty(rank, hidden_size, dtype=dtype))

    @property
    def factors(self) -> tuple[nn.Parameter, ...]:
        """The map's tensors, applied one after the other: (operator,) or (down, up)."""
        return (self.operator,) if "operator" in self._parameters else (self.down, self.up)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        factors = self.factors
        mapped = hidden_states.to(device=factors[0].device, dtype=factors[0].dtype)
        for factor in factors:
            mapped = mapped @ factor
        return mapped.to(device=hidden_states.device, dtype=hidden_states.dtype)

    def extra_repr(self) -> str:
        factors = self.factors
        rank = f", rank={factors[0].shape[1]}" if len(factors) == 2 else ""
        return f"{factors[0].shape[0]}, dtype={factors[0].dtype}{rank}"


class SubBlockBypass(nn.Module):
    """A removed attention or MLP sub-block: returns ``h @ A`` for the input ``h`` it is given (its norm's output, or
    the stream in post-norm families), shaped as the sub-block's output was (`outputs` values, the rest None).

    The map is the child `ghost` (its tensor ``....ghost.operator``). In place of attention it gives the KV cache
    zero-width keys and values, so the cache's length (positions, masks) stays right and holds no bytes for it."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, block: str, layer_idx: int, outputs: int,
                 rank: int | None = None) -> None:
        super().__init__()
        self.ghost = GhostMap(hidden_size, dtype, rank)
        self.block, self.layer_idx, self.outputs = block, layer_idx, outputs

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden_states = args[0] if args else kwargs["hidden_states"]
        if self.block == "attention":
            track_positions(hidden_states, kwargs, self.layer_idx)
        mapped = self.ghost(hidden_states)
        return (mapped, *([None] * (self.outputs - 1))) if self.outputs else mapped

    def extra_repr(self) -> str:
        return f"{self.block} replaced by a linear map"


def apply_ghost_operator(parent: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook of a layer (or the final norm): map its input hidden state with its `ghost` child.

    The child is looked up at call time, so a wrapper put in its place (e.g. PEFT's `modules_to_save`)
    is the one applied.
    """
    ghost = getattr(parent, GHOST_MODULE)
    if args:
        return (ghost(args[0]), *args[1:]), kwargs
    kwargs["hidden_states"] = ghost(kwargs["hidden_states"])
    return args, kwargs


class GhostedPreTrainedModel(PreTrainedModel):
    """Loading, saving and integrity checks shared by the ghosted model classes."""

    config_class = GhostedConfig
    config: GhostedConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_attention_backend = True

    # The attention kernels are the family's: transformers picks one from these before the base model exists, and a
    # kernel the family refuses would reach it (Gemma 2 has no fused attention, which cannot soft-cap the scores).
    @property
    def _supports_sdpa(self) -> bool:
        return _family_supports(self.config, "_supports_sdpa")

    @property
    def _supports_flash_attn(self) -> bool:
        return _family_supports(self.config, "_supports_flash_attn")

    @property
    def _supports_flex_attn(self) -> bool:
        return _family_supports(self.config, "_supports_flex_attn")

    def _init_weights(self, module: nn.Module) -> None:
        # A freshly built model is the plainly pruned one. Loading never relies on this: `from_pretrained`
        # refuses checkpoints whose operators are missing.
        if isinstance(module, GhostMap):
            for factor in module.factors:
                nn.init.zeros_(factor)
        elif isinstance(module, GhostOperator):
            nn.init.eye_(module.operator)
            if module.normed is not None:
                nn.init.zeros_(module.normed)
        else:
            super()._init_weights(module)

    def _install_operators(self, config: GhostedConfig) -> None:
        """An operator before every boundary and a bypass in every replaced sub-block of the pruned base decoder this
        model holds under the family's own module names (`ghost_layout`, Llama's by default)."""
        text_config = config.text_config  # the language decoder's (a multimodal base's text config)
        paths = decoder_paths(config)
        layers = _submodule(self, paths["layers"])
        if not isinstance(layers, nn.ModuleList):
            raise ValueError(f"This {text_config.model_type} model has no decoder layers at `{paths['layers']}` "
                             "(ghost_layout): the config does not match this model family.")
        operator_dtype = getattr(torch, config.operator_dtype)
        if operator_dtype == torch.float32:
            # from_pretrained(dtype=torch.bfloat16) must not round the operators.
            self._keep_in_fp32_modules_strict = [GHOST_MODULE]
        for boundary in config.ghost_boundaries:
            parent = layers[boundary["layer"]] if boundary["target"] == LAYER_TARGET else _submodule(self, paths["norm"])
            if parent is None:
                raise ValueError(f"This {text_config.model_type} model has no `{paths['norm']}`, which the boundary "
                                 f"after removed layers {boundary['removed']} feeds (ghost_layout): load it with the "
                                 "class of its config's auto_map that has it (AutoModelForCausalLM).")
            parent.add_module(GHOST_MODULE, GhostOperator(text_config.hidden_size * stream_count(config),
                                                          operator_dtype, normed=bool(boundary.get("normed"))))
            parent.register_forward_pre_hook(apply_ghost_operator, with_kwargs=True)
        for record in config.ghost_subblocks:
            layer = layers[record["layer"]]
            if not isinstance(getattr(layer, record["module"], None), nn.Module):
                raise ValueError(f"Layer {record['layer']} ({type(layer).__name__}) has no sub-block "
                                 f"{record['module']!r} to replace: the config does not match this model family.")
            setattr(layer, record["module"], SubBlockBypass(text_config.hidden_size, operator_dtype, record["block"],
                                                            record["layer"], record.get("outputs", 0),
                                                            record.get("rank")))

    def ghost_operators(self) -> dict[str, nn.Parameter]:
        """Every ghost tensor (each boundary's operator and its normed term where it has one, each replaced
        sub-block's map), keyed by its state-dict name."""
        paths = decoder_paths(self.config)
        return {key: self.get_parameter(key) for b in ghost_records(self.config)
                for key in ghost_tensor_keys(b, paths).values()}

    def operator_value_problems(self, require_hashes: bool = False) -> list[str]:
        """What is wrong with the operators' values: non-finite in the storage dtype, not the bytes whose
        sha256 config.json records, or (with `require_hashes`, as for a loaded checkpoint) no sha256 recorded
        at all. Empty when they are sound."""
        return operator_value_problems(self, require_hashes)

    def save_pretrained(self, save_directory: Any, *args: Any, **kwargs: Any):
        """`PreTrainedModel.save_pretrained`, all or nothing: the files are written into a sibling folder that then
        replaces `save_directory`. Files of an earlier save that this one does not write again (a single weights
        file beside new shards, an old index) are gone; files a model save never writes (tokenizer, card) stay."""
        # Before the parent writes config.json: the operator dtype and hashes always match the saved tensors.
        refresh_integrity(self, kwargs.get("state_dict"))
        multimodal = self.config.base_config is not None
        if self._auto_class is not None:  # the parent adds this class's own entry (and the config's) to auto_map
            module = type(self).__module__.rsplit(".", 1)[-1]
            entries = {"AutoModel": f"{module}.GhostedModel"}
            if multimodal:  # loads whole with either auto class
                entries.update(AutoModelForCausalLM=f"{module}.{GhostedForConditionalGeneration.__name__}",
                               AutoModelForImageTextToText=f"{module}.{GhostedForConditionalGeneration.__name__}")
            self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), **entries}
        if multimodal and _SAVES_ORIGINAL_FORMAT:
            # Tensors under the module names (format 1.3's ghost_layout names them), not renamed to the family's
            # original checkpoint layout, which this transformers applies to a nested model in another way.
            kwargs.setdefault("save_original_format", False)
        target = Path(save_directory)
        if kwargs.get("push_to_hub") or not kwargs.get("is_main_process", True) or target.is_file():
            return super().save_pretrained(save_directory, *args, **kwargs)
        with staged_folder(target) as staging:
            if target.is_dir():
                carry_over(target, staging)
            return super().save_pretrained(staging, *args, **kwargs)

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any):
        if args and isinstance(args[0], (str, os.PathLike)):
            check_sizes_against_weights(str(args[0]), kwargs)  # before a model of the claimed depth is built
        want_info = kwargs.pop("output_loading_info", False)
        verify = kwargs.pop("verify_operator_hashes", True)
        ignore_mismatched = kwargs.pop("ignore_mismatched_sizes", False)
        # Let mismatches through so that the error below can name them; operators are never re-initialised.
        model, info = super().from_pretrained(
            *args, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs
        )
        check_loaded(model, info, verify, ignore_mismatched)
        return (model, info) if want_info else model


class GhostedModel(GhostedPreTrainedModel):
    """The pruned decoder with its operators and no LM head (`AutoModel`): hidden states for embeddings or
    feature extraction. Loads from the same checkpoint as `GhostedForCausalLM` (the head's weight is unused)."""

    def __init__(self, config: GhostedConfig) -> None:
        super().__init__(config)
        config.validate_ghost_layout()
        # The family's base model, under the name its causal LM gives it (`model`, `transformer`, `backbone`, ...).
        self.base_model_prefix = decoder_paths(config)["layers"].split(".")[0]
        setattr(self, self.base_model_prefix, AutoModel.from_config(_base(config)))
        self._install_operators(config)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return getattr(self, self.base_model_prefix).get_input_embeddings()

    def forward(self, *args: Any, **kwargs: Any):
        return getattr(self, self.base_model_prefix)(*args, **kwargs)


class GhostedForCausalLM(GhostedPreTrainedModel, GenerationMixin):
    """A pruned causal LM of any decoder family transformers ships, with a Ghosted Layers operator at every pruning
    boundary: a drop-in transformers model (`generate`, `pipeline`, PEFT, lm-eval) whose `from_pretrained` refuses
    a checkpoint whose operators are missing, misshapen, non-finite or not the recorded bytes.

    The head, the logits' post-processing (soft-capping, scaling), the loss (a router's auxiliary loss included) and
    the generation hooks are the base family's own: its causal-LM class is built from `text_config`, its modules
    (`model` and `lm_head`, `transformer`, ...) and the attributes its methods read are taken over under their own
    names, and the instance becomes one of a subclass of both this class and the family's (same name), so that the
    family's methods (`forward` first) run on it as written.
    """

    _tied_weights_keys = TIED_WEIGHTS_KEYS

    def __init__(self, config: GhostedConfig) -> None:
        super().__init__(config)
        config.validate_ghost_layout()
        multimodal = config.base_config is not None
        base = (AutoModelForImageTextToText if multimodal else AutoModelForCausalLM).from_config(_base(config))
        for name, value in vars(base).items():  # what the family's forward reads (vocab_size, logit_scale, ...)
            if not name.startswith("_") and name != "training" and not hasattr(self, name):
                setattr(self, name, value)
        for name, module in base.named_children():
            self.add_module(name, module)
        self.__class__ = _with_family(type(self), type(base))
        tied = getattr(base, "_tied_weights_keys", None)  # ({} where the family ties nothing)
        self._tied_weights_keys = TIED_WEIGHTS_KEYS if tied is None else tied
        self._install_operators(config)
        self.post_init()


class GhostedForConditionalGeneration(GhostedForCausalLM):
    """A pruned multimodal model (`AutoModelForImageTextToText`: Gemma 3, Llama 4, Qwen3.5, ...) whose language
    decoder has Ghosted Layers operators; its vision tower and projector are the dense model's, untouched. Built,
    loaded and checked as `GhostedForCausalLM`, from the family's image-text-to-text class."""


_SAVES_ORIGINAL_FORMAT = "save_original_format" in inspect.signature(PreTrainedModel.save_pretrained).parameters
_FAMILY_CLASSES: dict[tuple[type, type], type] = {}


def _base(config: GhostedConfig) -> Any:
    """The config the base model is built from: a multimodal base's (holding the language decoder's), or the decoder's."""
    return config.base_config if config.base_config is not None else config.text_config


def _family_supports(config: GhostedConfig, flag: str) -> bool:
    """Whether the base family's model class declares `flag` (an attention kernel it runs)."""
    auto = AutoModelForImageTextToText if config.base_config is not None else AutoModelForCausalLM
    family = auto._model_mapping.get(type(_base(config)), None)
    return bool(getattr(family, flag, True))


def _submodule(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _with_family(cls: type, family: type) -> type:
    """`cls` (a ghosted class) joined with a family's causal-LM class: the ghosted class's own methods first, then
    the family's (its forward, generation hooks, weight init; `super()` inside them holds), then the rest."""
    if family in cls.__mro__:
        return cls
    if (cls, family) not in _FAMILY_CLASSES:
        _FAMILY_CLASSES[cls, family] = type(cls.__name__, (cls, family), {"__module__": cls.__module__,
                                                                          "__qualname__": cls.__qualname__,
                                                                          "base_model_prefix": family.base_model_prefix})
    return _FAMILY_CLASSES[cls, family]


__all__ = ["GhostedForCausalLM", "GhostedForConditionalGeneration", "GhostedModel", "GhostedPreTrainedModel", "GhostOperator", "SubBlockBypass"]
