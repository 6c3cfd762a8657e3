"""The architecture registry: everything ghosted_hf knows about a decoder family, in one place.

What transformers can tell (decoder, layers, norms, embeddings, head) is derived from the model; an entry declares
only what cannot be: where the norms sit, which weights read and write the stream, what stock checkpoints and
llama.cpp can hold. A per-layer config field not in `LAYER_FIELDS` is a reason to refuse, never to guess.
Adding a family is one `Architecture` entry and one tiny-model test (tests/test_architectures.py).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.utils import logging as transformers_logging

from .errors import GhostedError, one_line
from .remote.format_ghosted import DEFAULT_LAYOUT

NORM_PLACEMENTS = ("pre", "sandwich", "post")  # where the norms sit around each sub-block
GAINS = ("weight", "one-plus-weight")  # RMSNorm(x) * w, or RMSNorm(x) * (1 + w) (Gemma)


@dataclass(frozen=True)
class SubBlock:
    """One residual branch of a decoder layer: the module (the first of `modules` the layer has), the norm it reads
    (None: the stream itself, post-norm), the weights that read that normalised stream and write the residual stream
    (for a stock fold), and the norm on its output before it is added (sandwich and post-norm families). A reader or
    writer is a Linear's name, or a parameter's path with the axis of the stream's width (``"experts.gate_up_proj@-1"``:
    fused experts, routers); a name a layer lacks is skipped (dense and sparse layers of one family differ)."""

    modules: tuple[str, ...]
    norm: str | None
    readers: tuple[str, ...] = ()
    writers: tuple[str, ...] = ()
    output_norm: str | None = None

    def module(self, layer: nn.Module) -> nn.Module:
        return getattr(layer, self.attribute(layer))

    def attribute(self, layer: nn.Module) -> str:
        """The name under which `layer` holds this sub-block."""
        for name in self.modules:
            if isinstance(getattr(layer, name, None), nn.Module):
                return name
        raise GhostedError(f"{type(layer).__name__} has none of the sub-blocks {self.modules}.")


@dataclass(frozen=True)
class Layout:
    """Where a causal LM keeps its decoder layers and the norm after the last one, as module paths (Llama's, or
    GPT-2's ``transformer.h`` and ``transformer.ln_f``, ...): a ghosted model holds the family's modules under the same
    names, and records a layout other than Llama's in its config (`ghost_layout`)."""

    layers: str = DEFAULT_LAYOUT["layers"]
    norm: str = DEFAULT_LAYOUT["norm"]

    @property
    def is_default(self) -> bool:
        return self == Layout()

    def as_config(self) -> dict[str, str] | None:
        """The `ghost_layout` config field: None for Llama's layout (older readers' only one)."""
        return None if self.is_default else {"layers": self.layers, "norm": self.norm}


@dataclass(frozen=True)
class Architecture:
    """One decoder family (or several that share a layout), keyed by their `model_type`s."""

    model_types: tuple[str, ...]
    attention: SubBlock
    mlp: SubBlock
    norm_placement: str = "pre"
    gain: str = "weight"
    stock_folds: bool = False  # a scaled rotation and a down_proj transform fold exactly into its stock checkpoint
    # The GGUF architecture llama.cpp's converter writes for a pruned checkpoint of it, where export-gguf's DeciLM
    # rewrite maps that layout; None: export-gguf refuses the family.
    gguf_architecture: str | None = None
    moe: bool = False
    hybrid: bool = False  # some layers hold another mixer than attention (linear attention, state space)
    # Derived from the model rather than declared (`derived_architecture`): used once a small instance of its config
    # passed the skip-reference check (`model.surgery.check_derived_layout`).
    derived: bool = False
    layout: Layout = Layout()

    def __post_init__(self) -> None:
        assert self.norm_placement in NORM_PLACEMENTS and self.gain in GAINS

    @property
    def name(self) -> str:
        return self.model_types[0]

    def refuse_fold(self, what: str) -> None:
        """A GhostedError saying why `what` (an operator kind) cannot be folded into this family's stock model."""
        if self.stock_folds:
            return
        reason = {
            "sandwich": "a norm gain after each branch does not commute with a rotation of the stream",
            "post": "its norms sit after each branch, where a rotation of the stream does not pass through",
        }.get(self.norm_placement)
        if reason is None and self.derived:
            reason = "its layout is derived, not declared: which weights read the stream is not known"
        if reason is None and centered_norm(self.name):
            reason = "its LayerNorms subtract the mean, which a rotation of the stream does not keep"
        if reason is None:
            reason = "its fold is not implemented: the registry does not declare every weight that reads the stream"
        raise GhostedError(f"Operator kind {what!r} folds into a stock checkpoint, which {self.name} cannot hold "
                           f"exactly ({reason}). Use operator 'ghost' or 'normed' (remote code), or 'none'.")


# Llama's names (q/k/v/o, gate/up/down, input_layernorm, post_attention_layernorm); other layouts as differences.
_LLAMA_ATTENTION = SubBlock(("self_attn",), "input_layernorm", ("q_proj", "k_proj", "v_proj"), ("o_proj",))
_LLAMA_MLP = SubBlock(("mlp",), "post_attention_layernorm", ("gate_proj", "up_proj"), ("down_proj",))
_LLAMA = {"attention": _LLAMA_ATTENTION, "mlp": _LLAMA_MLP}
_SANDWICH = {"attention": replace(_LLAMA_ATTENTION, output_norm="post_attention_layernorm"),
             "mlp": replace(_LLAMA_MLP, norm="pre_feedforward_layernorm", output_norm="post_feedforward_layernorm"),
             "norm_placement": "sandwich"}
_POST_NORM = {"attention": replace(_LLAMA_ATTENTION, norm=None, output_norm="post_attention_layernorm"),
              "mlp": replace(_LLAMA_MLP, norm=None, output_norm="post_feedforward_layernorm"), "norm_placement": "post"}
# The router, the fused experts (F.linear layout: [experts, out, in]), shared experts and their gate; a name a layer
# lacks is skipped (first_k_dense_replace, mlp_only_layers: dense MLPs with Llama's names).
_MOE_READERS = ("gate.weight@-1", "gate.wg", "router.weight@-1", "experts.gate_up_proj@-1", "gate_proj", "up_proj",
                *(f"{shared}.{name}" for shared in ("shared_expert", "shared_experts", "shared_mlp")
                  for name in ("gate_proj", "up_proj")), "shared_expert_gate")
_MOE_WRITERS = ("experts.down_proj@-2", "down_proj", "shared_expert.down_proj", "shared_experts.down_proj",
                "shared_mlp.down_proj")
_MOE_MLP = SubBlock(("mlp", "block_sparse_moe"), "post_attention_layernorm", _MOE_READERS, _MOE_WRITERS)
# Attention of the MoE families: Llama's names, or DeepSeek's multi-head latent attention (low-rank q and kv inputs).
_ATTENTION = replace(_LLAMA_ATTENTION, readers=(*_LLAMA_ATTENTION.readers, "q_a_proj", "kv_a_proj_with_mqa"))
# Hybrids: softmax attention (gated q_proj), or a gated DeltaNet reading the stream through its input projections
# (Qwen3-Next fuses them in pairs, Qwen3.5 keeps four) and writing it through out_proj.
_HYBRID_ATTENTION = SubBlock(("self_attn", "linear_attn"), "input_layernorm",
                             ("q_proj", "k_proj", "v_proj", "in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z",
                              "in_proj_b", "in_proj_a"), ("o_proj", "out_proj"))

ENTRIES: tuple[Architecture, ...] = (
    # Dense pre-norm families with Llama's names: every operator kind, stock folds checked numerically.
    Architecture(("llama", "mistral"), **_LLAMA, stock_folds=True, gguf_architecture="llama"),
    # llama.cpp's converter writes Qwen as its own `qwen2`/`qwen3` architectures, which the DeciLM rewrite cannot map.
    Architecture(("qwen2", "qwen3"), **_LLAMA, stock_folds=True),
    Architecture(("smollm3", "ministral", "helium", "seed_oss", "ernie4_5", "hunyuan_v1_dense"), **_LLAMA,
                 stock_folds=True),
    Architecture(("arcee",), attention=_LLAMA_ATTENTION, mlp=replace(_LLAMA_MLP, readers=("up_proj",)),
                 stock_folds=True),
    # Multipliers on embeddings, residual branches, attention and logits: scalars, which a rotation passes.
    Architecture(("granite",), **_LLAMA, stock_folds=True),
    Architecture(("gemma",), **_LLAMA, gain="one-plus-weight", stock_folds=True),
    Architecture(("phi3",), attention=replace(_LLAMA_ATTENTION, readers=("qkv_proj",)),
                 mlp=replace(_LLAMA_MLP, readers=("gate_up_proj",)), stock_folds=True),
    Architecture(("glm", "glm4"), attention=replace(_LLAMA_ATTENTION, output_norm="post_self_attn_layernorm"),
                 mlp=replace(_LLAMA_MLP, readers=("gate_up_proj",), output_norm="post_mlp_layernorm"),
                 norm_placement="sandwich"),
    Architecture(("starcoder2",), attention=_LLAMA_ATTENTION,
                 mlp=SubBlock(("mlp",), "post_attention_layernorm", ("c_fc",), ("c_proj",))),
    Architecture(("cohere", "cohere2"), attention=SubBlock(("self_attn",), "input_layernorm"),
                 mlp=SubBlock(("mlp",), "input_layernorm")),  # parallel branches, one norm
    # Sandwich norms (a gain after each branch) and post-norm families: ghost and normed kinds, no stock fold.
    Architecture(("gemma2", "gemma3_text"), **_SANDWICH, gain="one-plus-weight"),
    Architecture(("olmo2", "olmo3"), **_POST_NORM),
    # Mixture-of-experts families: the router and the experts read the normalised stream.
    Architecture(("phimoe",), attention=_ATTENTION, mlp=_MOE_MLP, moe=True),
    Architecture(("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "granitemoe", "deepseek_v2", "deepseek_v3",
                  "glm4_moe", "minimax_m2", "dots1", "hunyuan_v1_moe", "ernie4_5_moe"),
                 attention=_ATTENTION, mlp=_MOE_MLP, moe=True, stock_folds=True),
    # gpt-oss: experts in the x @ W layout ([experts, in, out]) with biases, a router with a bias.
    Architecture(("gpt_oss",), attention=_ATTENTION,
                 mlp=SubBlock(("mlp",), "post_attention_layernorm", ("router.weight@-1", "experts.gate_up_proj@-2"),
                              ("experts.down_proj@-1", "experts.down_proj_bias@-1")), moe=True, stock_folds=True),
    # Hybrids: some layers hold linear attention (gated DeltaNet) instead of softmax attention.
    Architecture(("qwen3_next",), attention=_HYBRID_ATTENTION, mlp=_MOE_MLP, gain="one-plus-weight", moe=True,
                 hybrid=True, stock_folds=True),
    Architecture(("qwen3_5_text",), attention=_HYBRID_ATTENTION, mlp=_LLAMA_MLP, gain="one-plus-weight",
                 hybrid=True, stock_folds=True),
)
ARCHITECTURES: dict[str, Architecture] = {t: entry for entry in ENTRIES for t in entry.model_types}
# Where a family without an entry keeps its sub-blocks (the first name its layers have); its norms are not declared, so
# nothing folds into it (stock kinds are refused) and only what passes the skip-reference check is used.
_DERIVED_ATTENTION = ("self_attn", "attention", "self_attention", "attn", "linear_attn", "mixer")
_DERIVED_MLP = ("mlp", "feed_forward", "block_sparse_moe", "ffn", "moe")


def architecture(config_or_model: Any) -> Architecture:
    """The registry entry of a model or config (a ghosted one: of its base), else the layout derived for a decoder-only
    type of transformers (checked on a small instance before use), or a GhostedError naming why not. A multimodal
    model is its language decoder's family, laid out where the multimodal model keeps that decoder."""
    config = getattr(config_or_model, "config", config_or_model)
    if getattr(config, "model_type", None) == "ghosted":
        config = config.base_config if config.base_config is not None else config.text_config
    model_type = getattr(config, "model_type", None)
    text = language_config(config)
    if text is not config:
        refuse_non_decoder(model_type, bool(getattr(config, "is_encoder_decoder", False)))
        try:
            family = architecture(text)
        except GhostedError as error:
            raise GhostedError(f"{model_type!r} is a multimodal model whose language decoder ({text.model_type!r}) "
                               f"cannot be pruned: {error}") from None
        return replace(family, layout=derived_layout(config))
    if model_type in ARCHITECTURES:
        return ARCHITECTURES[model_type]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    refuse_non_decoder(model_type, bool(getattr(config, "is_encoder_decoder", False)))
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise GhostedError(f"Unsupported architecture {model_type!r}: this transformers has no causal LM of that type "
                           "(a model with remote code, or a newer family: update transformers).")
    return derived_architecture(config)


def language_config(config: Any) -> Any:
    """The config of the language decoder: a multimodal model's text config (Gemma 3's `text_config`), a ghosted
    model's base's, else `config` itself."""
    if getattr(config, "model_type", None) == "ghosted":
        config = config.text_config
    get = getattr(config, "get_text_config", None)
    if not callable(get):
        return config
    try:
        return get()
    except ValueError:  # a text encoder beside the decoder (several text configs): the decoder's
        return get(decoder=True)


def is_multimodal(config: Any) -> bool:
    """Whether a (base or ghosted) config describes a multimodal model around its language decoder."""
    if getattr(config, "model_type", None) == "ghosted":
        return config.base_config is not None
    return language_config(config) is not config


def refuse_non_decoder(model_type: Any, is_encoder_decoder: bool = False) -> None:
    """Refuse an encoder-decoder or an encoder (a masked LM) as what it is."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_MASKED_LM_MAPPING_NAMES,
                                                        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)

    if not isinstance(model_type, str):
        return  # a damaged config: its reader names the field
    if is_encoder_decoder or model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        raise GhostedError(f"{model_type!r} is an encoder-decoder model: ghosted_hf prunes decoder-only causal LMs.")
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and model_type not in ARCHITECTURES:
        raise GhostedError(f"{model_type!r} is an encoder (a masked LM), not a decoder-only causal LM: ghosted_hf prunes "
                           "decoder-only causal LMs.")


@functools.cache
def centered_norm(model_type: str) -> bool:
    """Whether a family's norms subtract the mean (LayerNorm, not RMSNorm), read off its final norm in a shallow
    instance of its default config (a rotation of the stream does not keep the mean)."""
    from transformers import AutoConfig

    with quiet_transformers():
        model, _ = _shallow_instance(AutoConfig.for_model(model_type))
    norm = model.get_submodule(architecture(model.config).layout.norm)
    name = type(norm).__name__.lower()
    return isinstance(norm, nn.LayerNorm) or ("layernorm" in name and "rms" not in name)


def reads_layer_by_layer(model_type: str) -> bool:
    """Whether layer-by-layer calibration can read a family's checkpoints tensor by tensor: not where transformers
    converts or renames stored tensors while it loads a whole model (experts stored one by one, fused in memory); a
    prefix change (a multimodal wrapper's) leaves the layers' names as they are. (`LayerwisePass` checks the files.)"""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # transformers 4.x converts nothing while it loads
        return True
    return all(type(step).__name__ == "PrefixChange" for step in get_checkpoint_conversion_mapping(model_type) or ())


def derived_architecture(config: PretrainedConfig) -> Architecture:
    """The layout of a decoder-only type with no registry entry: its decoder layers and final norm where its model
    keeps them (`derived_layout`), its sub-blocks by their usual names; whole layers and sub-blocks with the ghost and
    normed kinds, never a fold."""
    return Architecture((config.model_type,), attention=SubBlock(_DERIVED_ATTENTION, None),
                        mlp=SubBlock(_DERIVED_MLP, None), derived=True, layout=derived_layout(config))


_LAYOUTS: dict[str, Layout | str] = {}  # model type -> its derived layout, or why none was found
_ASIDE = re.compile(r"vision|visual|audio|image|speech")  # encoders beside a multimodal model's language decoder


def derived_layout(config: PretrainedConfig) -> Layout:
    """Where the causal LM of `config`'s type keeps its decoder layers and final norm, read off a shallow instance
    built on the meta device (nothing allocated), once per model type; a GhostedError naming what was not found."""
    model_type = config.model_type
    if model_type not in _LAYOUTS:
        try:
            with quiet_transformers():
                _LAYOUTS[model_type] = find_layout(*_shallow_instance(config))
        except GhostedError as error:
            _LAYOUTS[model_type] = str(error)
        except Exception as error:  # the family's own config and model classes, whatever they raise
            _LAYOUTS[model_type] = (f"no {model_type} model could be built from its config to find its layers "
                                    f"({type(error).__name__}: {one_line(error, 200)})")
    found = _LAYOUTS[model_type]
    if isinstance(found, str):
        raise GhostedError(found)
    return found


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' warnings off while ghosted_hf builds the small configs and instances it probes a family with
    (their token ids outside a tiny vocabulary, a field the family's class rewrites): about the probe, not the model."""
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(verbosity)


def _shallow_instance(config: PretrainedConfig) -> tuple[nn.Module, int]:
    """(a model of `config`'s type a few layers deep on the meta device, its depth): a multimodal model whole (its
    language decoder's family is checked apart), else the first of `small_configs` its causal-LM class builds."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if is_multimodal(config):
        with torch.device("meta"):
            return AutoModelForImageTextToText.from_config(pruned_config(config, shallow_layers(config, 3))), 3
    problems = []
    for small, problem in small_configs(config, 3):
        if small is None:
            problems.append(problem)
            continue
        try:
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(small), small.num_hidden_layers
        except Exception as error:  # the family's own model class, whatever it raises: try the next sizes
            problems.append(f"{type(error).__name__}: {one_line(error, 120)}")
    raise GhostedError(f"no {config.model_type} model could be built from its config to find its layers "
                       f"({'; '.join(problems)})")


# Sizes of the small instances a derived layout is found and checked on (set where the family's config has the field,
# under its own name: GPT-2's n_embd), and the first attempt's fields the next attempts leave to the family (head and
# latent sizes some families derive).
_SMALL_SIZES = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=8, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
                    num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, q_lora_rank=16,
                    kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, linear_num_value_heads=2,
                    linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, n_group=1, topk_group=1,
                    vocab_size_per_layer_input=128, hidden_size_per_layer_input=8, max_position_embeddings=256,
                    rotary_dim=4, attention_hidden_size=32, d_head=8, attention_head_dim=8, lru_width=32,
                    num_heads=8, state_size=16, mamba_n_heads=8, mamba_d_head=8, mamba_headdim=8, mamba_d_state=16,
                    mamba_d_ssm=64)
_FAMILY_SIZED = ("head_dim", "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                 "qk_nope_head_dim", "v_head_dim", "rotary_dim", "d_head", "attention_head_dim", "num_heads")


def shallow_layers(config: PretrainedConfig, depth: int) -> list[int]:
    """The first `depth` layers of the language decoder, or, where the rest cannot be removed (`removal_problem`: a
    hybrid's full-attention layer, Gemma 4's full-attention last layer), the first `depth` - 1 and the earliest later
    layer that can stay instead."""
    full = language_config(config).num_hidden_layers
    first = list(range(min(full, depth)))
    for kept in (first, *([*first[:-1], j] for j in range(len(first), full))):
        if removal_problem(config, [i for i in range(full) if i not in kept]) is None:
            return kept
    return first


def small_configs(config: PretrainedConfig, depth: int) -> Iterator[tuple[PretrainedConfig | None, str | None]]:
    """(config, None) of `config`'s class `depth` layers deep (its `shallow_layers`), a
    few dozen wide, eager attention: with every small size, latent attention's, the family's own head sizes, then its
    own widths; (None, why) for each the family's config class refuses."""
    values = pruned_config(config, shallow_layers(config, depth)).to_dict()
    values.update({k: i for i, k in enumerate(("pad_token_id", "bos_token_id", "eos_token_id"))  # within 128 tokens
                   if isinstance(values.get(k), int)})
    aliases = config.attribute_map
    sizes = {aliases.get(k, k): v for k, v in _SMALL_SIZES.items() if aliases.get(k, k) in values}
    heads = aliases.get("num_attention_heads", "num_attention_heads")
    latent = {**sizes, "head_dim": sizes.get("qk_rope_head_dim"), "num_key_value_heads": sizes.get(heads)}
    family_sized = {aliases.get(k, k) for k in _FAMILY_SIZED}
    for attempt in (sizes, {k: v for k, v in latent.items() if v is not None},  # latent attention: head_dim = rope
                    {k: v for k, v in sizes.items() if k not in family_sized}, {"vocab_size": 128}):
        try:
            small = type(config).from_dict({**values, **attempt})
        except Exception as error:  # the family's config validation on these sizes: try the next
            yield None, f"{type(error).__name__}: {one_line(error, 120)}"
            continue
        small._attn_implementation = "eager"
        yield small, None


def find_layout(model: nn.Module, depth: int) -> Layout:
    """The layout of `model`, a causal LM with `depth` decoder layers: the shallowest list of `depth` modules outside
    any vision or audio encoder, and what reads the last layer's output: the one norm beside the list (of several,
    those not named for the embeddings or an input), or the output layer where there is none (post-norm GPT)."""
    lists = [name for name, module in model.named_modules() if isinstance(module, nn.ModuleList)
             and len(module) == depth and "." in name and not _ASIDE.search(name)]
    shallowest = [name for name in lists if name.count(".") == min((n.count(".") for n in lists), default=0)]
    if len(shallowest) != 1:
        raise GhostedError(f"{type(model).__name__} has {len(shallowest) or 'no'} module lists as long as its "
                           f"decoder layers ({depth} in the instance they were looked for in)"
                           f"{' ' + str(shallowest) if shallowest else ''}: its decoder layers cannot be told apart.")
    parent = shallowest[0].rpartition(".")[0]
    norms = [name for name, module in model.get_submodule(parent).named_children() if _is_norm(module)]
    if len(norms) > 1:  # the embeddings' or a per-layer input's norm beside the final one
        norms = [name for name in norms if not re.search("emb|proj|input", name)] or norms
    if len(norms) > 1 and "norm" in norms:
        norms = ["norm"]
    if len(norms) > 1:
        raise GhostedError(f"{type(model).__name__} has {len(norms)} norms beside its decoder layers ({shallowest[0]}) "
                           f"{norms}: the norm after the last layer, which a boundary after it feeds, cannot be told.")
    if norms:
        return Layout(shallowest[0], f"{parent}.{norms[0]}")
    head = model.get_output_embeddings()
    return Layout(shallowest[0], next(name for name, module in model.named_modules() if module is head))


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm)) or "norm" in type(module).__name__.lower()


def decoder(model: nn.Module) -> nn.Module:
    """The module holding a causal LM's decoder layers (dense or ghosted; `model.model` in Llama's layout)."""
    return _module(model, architecture(model).layout.layers.rpartition(".")[0], "decoder")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a causal LM (dense or ghosted), in order."""
    return _module(model, architecture(model).layout.layers, "decoder layers")


def final_norm(model: nn.Module) -> nn.Module:
    """The norm after the last decoder layer (a boundary after the last kept layer feeds it)."""
    return _module(model, architecture(model).layout.norm, "final norm")


def _module(model: nn.Module, path: str, what: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise GhostedError(f"{type(model).__name__} has no {what} at `{path}`, where its family's causal LM keeps "
                           f"them: ghosted_hf cannot prune this model as it is built.") from None


EMBEDDING_WEIGHT = "model.embed_tokens.weight"  # the input embedding, in every registry family's checkpoint


def layer_prefix(index: int, layout: Layout = Layout()) -> str:
    """The prefix of every parameter and module name of decoder layer `index` (``model.layers.<i>.``)."""
    return f"{layout.layers}.{index}."


def layer_of(name: str, layout: Layout = Layout()) -> int | None:
    """The decoder layer a parameter or module name belongs to (`layer_prefix`), else None."""
    head, _, tail = name.partition(layout.layers + ".")
    index = tail.split(".", 1)[0]
    return int(index) if not head and index.isdigit() and "." in tail else None


# Where multimodal checkpoints keep their language decoder (Gemma 3 / Qwen3.5: model.language_model; Llama 4:
# language_model.model), read as a decoder-only checkpoint's `model.`.
_LANGUAGE_MODEL_PREFIXES = ("model.language_model.", "language_model.model.")


def checkpoint_layer(name: str, layout: Layout = Layout()) -> int | None:
    """The decoder layer a checkpoint tensor belongs to, in a decoder-only checkpoint (stored from the causal LM, or
    from its base model: GPT-2's ``h.0.`` for ``transformer.h.0.``) or a multimodal one's language decoder; else
    None."""
    if layout.is_default:
        for prefix in _LANGUAGE_MODEL_PREFIXES:
            if name.startswith(prefix):
                return layer_of("model." + name[len(prefix):])
    found = layer_of(name, layout)
    base = layout.layers.partition(".")[0] + "."
    return found if found is not None else layer_of(base + name, layout)


def checked_shapes(config: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Checkpoint tensors whose shapes a config states (name -> the config field of each axis), to check a folder
    before a model is built; the first MLP output projection only where the family has a plain one."""
    shapes = {EMBEDDING_WEIGHT: ("vocab_size", "hidden_size")}
    model_type = config.get("model_type")
    entry = ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None  # (a damaged config: checked later)
    plain = [w for w in entry.mlp.writers if "@" not in w and "." not in w] if entry else []
    if plain:
        shapes[f"{layer_prefix(0)}{entry.mlp.modules[0]}.{plain[0]}.weight"] = ("hidden_size", "intermediate_size")
    return shapes


StreamWeight = tuple[nn.Module, str, int]  # (owner module, parameter name, the axis of the stream's width)


def stream_weights(module: nn.Module, names: Iterable[str], writes: bool) -> list[StreamWeight]:
    """The weights of a sub-block `module` that read (`writes` False) or write the stream, as `SubBlock` names
    them: a Linear reads along its weight's last axis and writes along its first (and its bias)."""
    found = []
    for name in names:
        path, _, axis = name.partition("@")
        owner_path, _, parameter = path.rpartition(".")
        try:
            target = module.get_submodule(path)
        except AttributeError:
            target = None
        if isinstance(target, nn.Linear):
            found.append((target, "weight", -2 if writes else -1))
            if writes and target.bias is not None:
                found.append((target, "bias", -1))
            continue
        try:
            owner = module.get_submodule(owner_path) if owner_path else module
        except AttributeError:
            continue  # not in this layer (a dense layer of a sparse family)
        if isinstance(getattr(owner, parameter, None), nn.Parameter):
            found.append((owner, parameter, int(axis or -1)))
    return found


def check_declared(module: nn.Module, declared: Iterable[StreamWeight], width: int) -> None:
    """Refuse a fold into a sub-block that holds a weight of the stream's width that the registry does not name:
    folding would leave it reading or writing the old basis."""
    covered = {(id(owner), name) for owner, name, _ in declared}
    for owner_name, owner in module.named_modules():
        for name, parameter in owner.named_parameters(recurse=False):
            if (id(owner), name) not in covered and width in parameter.shape and parameter.ndim > 1:
                raise GhostedError(f"{type(module).__name__} holds {owner_name + '.' if owner_name else ''}{name} "
                                   f"{tuple(parameter.shape)}, of the stream's width, which the architecture registry "
                                   "does not declare as a reader or writer: a stock fold would be wrong. Use operator "
                                   "'ghost' or 'normed', or declare it in ghosted_hf.architectures.")


def lora_targets(model: nn.Module) -> str:
    """A PEFT `target_modules` pattern for every linear layer in the decoder layers, fused projections and
    shared experts included (what LoRA healing adapts); not the output layer, not the ghost operators, and not a
    Linear subclass with its own forward (a router returning weights and indices, which LoRA cannot wrap)."""
    relative = sorted({name.split(".", 1)[1] for name, module in decoder_layers(model).named_modules()
                       if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward and "." in name})
    return rf"{re.escape(architecture(model).layout.layers)}\.\d+\.({'|'.join(re.escape(name) for name in relative)})"


def lora_target_parameters(model: nn.Module) -> list[str]:
    """PEFT `target_parameters` for the fused experts (3-D weights the registry declares as reading or writing the
    stream): LoRA adapts them through PEFT's parameter wrapper where no Linear holds them. Routers stay frozen."""
    family = architecture(model)
    declared = {name.split("@")[0] for block in (family.attention, family.mlp)
                for name in block.readers + block.writers if "@" in name}
    return sorted({name.split(".", 1)[1] for name, p in decoder_layers(model).named_parameters()
                   if p.ndim == 3 and any(name.endswith("." + d) for d in declared)})


Rule = Callable[[Any, list[int], dict[str, Any]], Any]  # a per-layer field's (value, kept, dense values) -> new value


def _sliced(value: Any, kept: list[int], values: dict[str, Any]) -> Any:
    """One entry per layer (a single value where a family also accepts one for every layer: Gemma 3n's sizes)."""
    return [value[i] for i in kept] if isinstance(value, (list, tuple)) else value


def _cycled(value: Any, kept: list[int], values: dict[str, Any]) -> Any:
    """A pattern the layers repeat (RecurrentGemma's block_types): the kept layers' entries, spelled out."""
    return [value[i % len(value)] for i in kept] if isinstance(value, (list, tuple)) and value else value


def _run_lengths(value: Any, kept: list[int], values: dict[str, Any]) -> Any:
    """GPT-Neo's attention_types, [[pattern, repeats], ...]: the kept layers' kinds as one run."""
    return [[_sliced(values.get("attention_layers"), kept, values), 1]] if values.get("attention_layers") else value


def _sources(value: Any, kept: list[int], values: dict[str, Any]) -> Any:
    """Per layer, the layer whose keys and values it reads (Kolibri's kv_source_layers): re-indexed; a kept layer
    reading a removed one's is refused."""
    if not isinstance(value, (list, tuple)):
        return value
    lost = sorted({value[i] for i in kept if value[i] not in kept})
    if lost:
        raise GhostedError(f"Layers {lost} hold keys and values that kept layers read (kv_source_layers): keep them.")
    return [kept.index(value[i]) for i in kept]


def _reindexed(value: Any, kept: list[int], values: dict[str, Any]) -> Any:
    """A list of layer indices: those kept, in the pruned numbering."""
    return None if value is None else [kept.index(i) for i in value if i in kept]


def _prefix_count(value: Any, kept: list[int], values: dict[str, Any]) -> Any:
    """`the first N layers are special`: the kept ones among them stay a prefix."""
    return value if not isinstance(value, int) else sum(1 for i in kept if i < value)


def _sparse_step(value: Any, kept: list[int], values: dict[str, Any]) -> Any:
    """Qwen MoE: layer i is sparse when (i + 1) % step == 0 and i is not in mlp_only_layers. Re-encoded as step 1
    with the dense kept layers listed (done by `_mlp_only_layers`, which reads the dense step)."""
    return 1 if isinstance(value, int) else value


def _mlp_only_layers(value: Any, kept: list[int], values: dict[str, Any]) -> Any:
    step = values.get("decoder_sparse_step") or 1
    dense = set(value or [])
    return [new for new, i in enumerate(kept) if i in dense or (i + 1) % step != 0]


def _reindexed_keys(value: Any, kept: list[int], values: dict[str, Any]) -> Any:
    """Sparse per-layer overrides keyed by layer index (Gemma 4's `per_layer_config`): those of kept layers, keyed by
    their pruned index (as the dense file writes keys: numbers or numeric strings)."""
    if not isinstance(value, dict):
        return value
    return {type(key)(kept.index(int(key))): entry for key, entry in value.items() if int(key) in kept}


def _suffix_count(value: Any, kept: list[int], values: dict[str, Any]) -> Any:
    """`the last N layers are special` (Gemma 3n/4's num_kv_shared_layers): the kept ones among them stay a suffix."""
    depth = values.get("num_hidden_layers")
    if not isinstance(value, int) or not isinstance(depth, int):
        return value
    return sum(1 for i in kept if i >= depth - value)


def _last_index(value: Any, kept: list[int], values: dict[str, Any]) -> Any:
    """`layers up to index N (inclusive) are special`: N becomes the last kept one of them."""
    return value if not isinstance(value, int) or value < 0 else sum(1 for i in kept if i <= value) - 1


def _must_be_one(field: str) -> Rule:
    def rule(value: Any, kept: list[int], values: dict[str, Any]) -> Any:
        if value not in (None, 1):
            raise GhostedError(f"Config field {field} = {value} encodes which layers differ by their index; only 1 "
                               "(every layer alike) can be pruned. Rewrite it as an explicit list first.")
        return value
    return rule


def _unchanged(value: Any, kept: list[int], values: dict[str, Any]) -> Any:
    return value


# Fields that encode structure by layer index, and how each re-indexes when layers go (every rule reads dense values).
LAYER_FIELDS: dict[str, Rule] = {
    "layer_types": _sliced, "mlp_layer_types": _sliced, "no_rope_layers": _sliced, "layer_rope_theta": _sliced,
    "num_attention_heads_per_layer": _sliced, "indexer_types": _sliced, "layers_block_type": _sliced,
    "attention_layers": _sliced, "attention_types": _run_lengths, "block_types": _cycled, "kv_source_layers": _sources,
    "expert_swiglu_limit_list": _sliced, "share_expert_swiglu_limit_list": _sliced, "intermediate_size": _sliced,
    "activation_sparsity_pattern": _sliced, "hybrid_layer_ids": _reindexed, "index_layers": _reindexed,
    "cross_attention_layers": _reindexed,
    "moe_layers": _reindexed, "full_attn_idxs": _reindexed, "per_layer_config": _reindexed_keys,
    "mlp_only_layers": _mlp_only_layers, "decoder_sparse_step": _sparse_step,
    "max_window_layers": _prefix_count, "first_k_dense_replace": _prefix_count, "num_kv_shared_layers": _suffix_count,
    "moe_layer_start_index": _prefix_count, "moe_layer_end_index": _last_index,
    "moe_layer_freq": _must_be_one("moe_layer_freq"), "moe_layer_interval": _must_be_one("moe_layer_interval"),
    # Used only to derive the explicit lists above when they are absent; a pruned config always has the lists.
    "no_rope_layer_interval": _unchanged, "interleave_moe_layer_step": _unchanged, "sliding_window_pattern": _unchanged,
    "_sliding_window_pattern": _unchanged, "full_attention_interval": _unchanged,
}


def pruned_config(config: PretrainedConfig, kept: list[int]) -> PretrainedConfig:
    """The base config with `num_hidden_layers` and every per-layer field restricted to the `kept` layers; a list
    as long as the layer count that `LAYER_FIELDS` does not know is refused by name."""
    text = language_config(config)
    if text is not config:  # a multimodal model: its language decoder's config pruned, the rest as it is
        whole = copy.deepcopy(config)
        setattr(whole, next(name for name in config.sub_configs if getattr(config, name, None) is text),
                pruned_config(text, kept))
        return whole
    values = config.to_dict()
    depth = config.num_hidden_layers
    unknown = [k for k, v in values.items() if isinstance(v, (list, tuple)) and len(v) == depth
               and k not in LAYER_FIELDS]
    if unknown and depth > 1:
        raise GhostedError(f"Config field(s) {unknown} of {config.model_type!r} hold one entry per layer, and "
                           "ghosted_hf does not know how they re-index when layers are removed: add them to "
                           "ghosted_hf.architectures.LAYER_FIELDS.")
    new = dict(values, **{config.attribute_map.get("num_hidden_layers", "num_hidden_layers"): len(kept)})
    for field, rule in LAYER_FIELDS.items():
        if field in values:
            new[field] = rule(values[field], kept, values)
    pruned = type(config).from_dict(new)
    pruned._attn_implementation = config._attn_implementation
    return pruned


SOFTMAX_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")  # `layer_types` of softmax attention
_MASKING_TYPES = ("full_attention", "hybrid", "attention")  # the layer kinds a hybrid builds its masks from


def layers_to_keep_one_of(config: PretrainedConfig) -> list[int]:
    """Dense layers of which a pruned model must keep at least one: a hybrid's full-attention layers (transformers
    builds its attention masks from a full-attention layer's cache, so a hybrid left with linear-attention or
    state-space layers only fails its first forward). Derived from `layer_types` (Zamba's `layers_block_type`); empty
    where nothing is needed."""
    types = list(getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None) or [])
    full = [i for i, kind in enumerate(types) if kind in _MASKING_TYPES]
    return full if full and any(kind not in SOFTMAX_LAYER_TYPES for kind in types) else []


def kv_sources(config: PretrainedConfig) -> dict[int, int]:
    """Layer -> the earlier layer whose keys and values it reuses instead of computing its own (Gemma 3n/4: the last
    `num_kv_shared_layers` layers read those of the last earlier layer of their attention type)."""
    depth, shared = config.num_hidden_layers, getattr(config, "num_kv_shared_layers", 0) or 0
    types = list(getattr(config, "layer_types", None) or [])
    if not shared or len(types) != depth:
        return {}
    first = depth - shared
    return {i: max(j for j in range(first) if types[j] == types[i])
            for i in range(first, depth) if types[i] in types[:first]}


def removal_problem(config: PretrainedConfig, removed: Iterable[int]) -> str | None:
    """Why removing `removed` cannot give the dense model with those layers skipped, read off the config alone (None
    where it can): a hybrid left without a full-attention layer, a kept layer reusing a removed layer's keys and
    values, or a pruned config that its own class rewrites (Gemma 4 makes its last layer full attention)."""
    config = language_config(config)
    removed = set(removed)
    needed = layers_to_keep_one_of(config)
    if needed and set(needed) <= removed:
        return (f"leaves this {config.model_type} hybrid without a full-attention layer, and it builds its attention "
                f"masks from one: keep at least one of layers {needed}")
    sources = kv_sources(config)
    lost = sorted({source for layer, source in sources.items() if layer not in removed and source in removed})
    if lost:
        readers = sorted(layer for layer, source in sources.items() if source in lost and layer not in removed)
        return (f"removes layers {lost}, whose keys and values kept layers {readers} reuse: keep them, or remove their "
                "readers too")
    kept = [i for i in range(config.num_hidden_layers) if i not in removed]
    try:
        with quiet_transformers():  # (a config class's warning that it rewrites a field, once per try)
            pruned = pruned_config(config, kept).to_dict()
    except Exception as error:  # the family's config class refuses the pruned fields
        return f"gives a config that {type(config).__name__} refuses ({type(error).__name__}: {one_line(error, 160)})"
    dense = config.to_dict()
    for field, rule in LAYER_FIELDS.items():
        asked = _plain(rule(dense[field], kept, dense)) if field in dense else None
        if field in dense and _plain(pruned.get(field)) != asked:
            return (f"gives a config whose {field} {type(config).__name__} rewrites "
                    f"({_difference(asked, pruned.get(field))}), "
                    "so a kept layer would be built unlike its dense self: choose other layers")
    return None


def _plain(value: Any) -> Any:
    """A config value as its JSON file holds it (tuples as lists, keys as strings)."""
    return json.loads(json.dumps(value, default=str))


def _difference(asked: Any, got: Any) -> str:
    """The first entry where two per-layer values differ, in words."""
    if isinstance(asked, list) and isinstance(got, list) and len(asked) == len(got):
        i = next(i for i, (a, b) in enumerate(zip(asked, got)) if a != b)
        return f"pruned layer {i}: {asked[i]!r} -> {got[i]!r}"
    return f"{asked!r} -> {got!r}"


def check_removal(config: PretrainedConfig, removed: Iterable[int]) -> None:
    """Refuse, before any fitting, a removal that `removal_problem` finds a problem with."""
    problem = removal_problem(config, removed)
    if problem:
        raise GhostedError(f"Removing layers {sorted(removed)} {problem}.")


_INDEX_ATTRIBUTE = re.compile(r"(^|_)(idx|index|layer_id|layer_number|layer_num)$")
# Attributes a layer is given by its position that change what it hands others, never its own output: Gemma 4 marks the
# last layer of each attention type to store its keys and values for a draft model (`kv_sources` covers the layers
# that read them).
_ROLE_ATTRIBUTES = ("store_full_length_kv",)


def _signature(layer: nn.Module, skip: Iterable[str] = ()) -> list[tuple]:
    """What makes a decoder layer the layer it is, apart from its index (sliding or global, rotary or not, dense or
    sparse, ...): every submodule's class, parameter shapes and plain attributes, but those of `skip`."""
    signature = []
    for name, module in layer.named_modules():
        if name.split(".")[0] in {"ghost", *skip}:
            continue
        shapes = tuple((n, tuple(p.shape)) for n, p in module.named_parameters(recurse=False))
        plain = tuple(sorted((k, v) for k, v in vars(module).items()
                             if not k.startswith("_") and k not in ("training", *_ROLE_ATTRIBUTES)
                             and not _INDEX_ATTRIBUTE.search(k)
                             and isinstance(v, (int, float, str, bool))))  # (None: unset, as a runtime state)
        signature.append((name, type(module).__name__, shapes, plain))
    return signature


def check_layers_match(dense: Iterable[nn.Module], pruned: Iterable[nn.Module], kept: list[int],
                       replaced: Mapping[int, Iterable[str]] | None = None) -> None:
    """Refuse a pruned model whose layer i is not built like dense layer kept[i] (a per-layer config field re-indexed
    wrongly), naming the first difference; `replaced[i]`: pruned layer i's sub-blocks that are maps, not compared."""
    for new, (old_layer, new_layer) in enumerate(zip(dense, pruned, strict=True)):
        skip = tuple((replaced or {}).get(new, ()))
        before, after = _signature(old_layer, skip), _signature(new_layer, skip)
        if before != after:
            diff = next((a, b) for a, b in zip(before + [None], after + [None]) if a != b)
            raise GhostedError(f"Pruned layer {new} would not be built like dense layer {kept[new]} ({diff[0]} became "
                               f"{diff[1]}): a config field that depends on the layer index or count is not carried over "
                               "right. Report it with the model's config.json.")


def decoder_only_types() -> list[str]:
    """Every decoder-only causal-LM type of the installed transformers: its causal-LM mapping less encoder-decoders,
    encoders (masked LMs) and multimodal wrappers (their language decoder's type is counted), computed, not listed."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
                                                        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)

    found = []
    for model_type in sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - set(MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
                             - set(MODEL_FOR_MASKED_LM_MAPPING_NAMES) - {"ghosted"}):
        try:
            config = AutoConfig.for_model(model_type)
        except Exception:  # a config class that cannot be built with its own defaults: listed (and refused)
            found.append(model_type)
            continue
        if not getattr(config, "is_encoder_decoder", False) and getattr(config, "text_config", None) is None:
            found.append(model_type)
    return found


Verdict = tuple[Layout | None, str | None, str | None]  # (layout, why whole layers are refused, why sub-blocks are)

