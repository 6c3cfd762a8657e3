"""What a decoder layer owes its position: the per-layer config fields and how each re-indexes when layers go
(`LAYER_FIELDS`; a field not listed is a reason to refuse, never to guess), the removals a config forbids (a hybrid's
last full-attention layer, a layer whose keys and values others reuse) and the check that a pruned layer is built as
its dense self.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.utils import logging as transformers_logging

from ..errors import GhostedError, one_line
from ..remote.format_ghosted import kept_layers
from .registry import language_config

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


SOFTMAX_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "indexed_attention")  # `layer_types` of softmax attention
_MASKING_TYPES = ("full_attention", "indexed_attention", "hybrid", "attention")  # the layer kinds a hybrid builds its masks from


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


def kv_per_token(config: PretrainedConfig) -> list[int]:
    """The values each decoder layer adds to the KV cache per token (0 for a layer without one: a recurrent mixer's
    fixed state, a layer reusing another's keys and values), within every sliding window. Measured, not computed from
    head counts: the cache the family's own model fills, built on the meta device (no memory, no arithmetic), from one
    token to two."""
    text = language_config(config)
    sizes = []
    with quiet_transformers(), torch.no_grad():
        with torch.device("meta"):
            # (bf16: the dtype every kernel takes, grouped expert products included; no value is computed on meta)
            model = AutoModelForCausalLM.from_config(copy.deepcopy(text), dtype=torch.bfloat16)
        try:
            for length in (1, 2):  # (within any sliding window)
                output = model(input_ids=torch.zeros(1, length, dtype=torch.long, device="meta"), use_cache=True)
                cache = output.cache if getattr(output, "cache", None) is not None else output.past_key_values
                sizes.append([sum(t.numel() for t in vars(layer).values() if isinstance(t, torch.Tensor))
                              for layer in cache.layers])
        except Exception as error:  # a family whose forward needs values (not shapes) to run
            raise GhostedError(f"The KV cache of a {text.model_type} model could not be measured on the meta device "
                               f"({one_line(error)}): give a parameter budget (remove, num_parameters) instead.") from error
    if len(sizes[0]) != text.num_hidden_layers:
        raise GhostedError(f"A {text.model_type} model's cache has {len(sizes[0])} layers for its "
                           f"{text.num_hidden_layers} decoder layers, so what each layer holds is not known: give a "
                           "parameter budget (remove, num_parameters) instead.")
    return [after - before for before, after in zip(*sizes)]


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
    kept = kept_layers(config.num_hidden_layers, removed)
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


