"""A model's family: its registry entry, or the layout derived from a small instance of its own config (checked
against the skip reference before use); and where a model keeps its decoder, layers, final norm and LoRA targets.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.fx.experimental._config  # noqa: F401  (meta_nonzero_assume_all_nonzero)
from torch import nn
from transformers import PretrainedConfig

from ..errors import GhostedError, one_line
from .positions import pruned_config, quiet_transformers, removal_problem
from .registry import ARCHITECTURES, Architecture, Layout, SubBlock, is_multimodal, language_config, refuse_non_decoder

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


def stream_width(config_or_model: Any) -> int:
    """The width of the residual stream between decoder layers, which a boundary's operator maps: the language
    decoder's hidden size times its streams (several with hyper-connections)."""
    config = getattr(config_or_model, "config", config_or_model)
    return language_config(config).hidden_size * architecture(config).layout.streams


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


def refuse_fold(family: Architecture, what: str) -> None:
    """A GhostedError saying why `what` (an operator kind) cannot be folded into this family's stock model."""
    if family.stock_folds:
        return
    reason = {
        "sandwich": "a norm gain after each branch does not commute with a rotation of the stream",
        "post": "its norms sit after each branch, where a rotation of the stream does not pass through",
    }.get(family.norm_placement)
    if reason is None and family.derived:
        reason = "its layout is derived, not declared: which weights read the stream is not known"
    if reason is None and centered_norm(family.name):
        reason = "its LayerNorms subtract the mean, which a rotation of the stream does not keep"
    if reason is None:
        reason = "its fold is not implemented: the registry does not declare every weight that reads the stream"
    raise GhostedError(f"Operator kind {what!r} folds into a stock checkpoint, which {family.name} cannot hold "
                       f"exactly ({reason}). Use operator 'ghost' or 'normed' (remote code), or 'none'.")


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
                model, depth = _shallow_instance(config)
                # (bf16 on meta: the dtype every kernel takes, grouped expert products included; nothing allocated)
                _LAYOUTS[model_type] = with_streams(model.to(torch.bfloat16), find_layout(model, depth))
        except GhostedError as error:
            _LAYOUTS[model_type] = str(error)
        except Exception as error:  # the family's own config and model classes, whatever they raise
            _LAYOUTS[model_type] = (f"no {model_type} model could be built from its config to find its layers "
                                    f"({type(error).__name__}: {one_line(error, 200)})")
    found = _LAYOUTS[model_type]
    if isinstance(found, str):
        raise GhostedError(found)
    return found


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
                    mamba_d_ssm=64, hc_lowrank=8, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8,
                    indexer_budget=16, indexer_compress_ratio=4)
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


def with_streams(model: nn.Module, layout: Layout) -> Layout:
    """`layout` with the residual's streams, seen in one forward on the meta device (no value computed): the width
    the first layer is given, in multiples of the embedding's; with several (hyper-connections), what reads the last
    layer's output is the module beside the layers given that very tensor (a stream mixer before the final norm). A
    family whose forward cannot run on the meta device keeps one stream (its check runs the layout on values)."""
    layers, parent = model.get_submodule(layout.layers), model.get_submodule(layout.layers.rpartition(".")[0])
    seen: dict[str, Any] = {}

    def given(name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            seen.setdefault(name, args[0] if args else kwargs.get("hidden_states"))
        return hook

    handles = [layers[0].register_forward_pre_hook(given("first"), with_kwargs=True),
               layers[-1].register_forward_hook(lambda m, a, out: seen.setdefault("last", _first(out))),
               *(child.register_forward_pre_hook(given(name), with_kwargs=True)
                 for name, child in parent.named_children() if child is not layers)]
    try:  # (a router's nonzero has no shape on meta: every expert taken, which only shapes matter for)
        with torch.no_grad(), torch.fx.experimental._config.patch(meta_nonzero_assume_all_nonzero=True):
            model(input_ids=torch.zeros(1, 2, dtype=torch.long, device="meta"))
    except Exception:  # the family's forward on shapes alone (one stream: what a failed reading cannot tell)
        return layout
    finally:
        for handle in handles:
            handle.remove()
    width, hidden = getattr(seen.get("first"), "shape", (0,))[-1], model.get_input_embeddings().weight.shape[-1]
    if width <= hidden or width % hidden:
        return layout
    readers = [name for name, value in seen.items() if name not in ("first", "last") and value is seen.get("last")]
    if len(readers) != 1:
        return layout  # (the check refuses the family: its operators would not fit the stream they are given)
    return replace(layout, norm=f"{layout.layers.rpartition('.')[0]}.{readers[0]}", streams=width // hidden)


def _first(output: Any) -> Any:
    return output[0] if isinstance(output, tuple) else output


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
