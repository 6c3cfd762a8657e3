"""Layer removal: from a dense Llama/Qwen2/Qwen3/Mistral causal LM to a `GhostedForCausalLM`.

The pruned model is rebuilt from a pruned config (so every attention gets `layer_idx` 0..L'-1 and every
per-layer config list is sliced), then takes over the dense model's tensors without copying them.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from .remote.configuration_ghosted import SUPPORTED_MODEL_TYPES, GhostedConfig, expected_boundaries
from .remote.modeling_ghosted import GHOST_MODULE, GhostedForCausalLM, ghost_tensor_key

logger = logging.getLogger(__name__)

# Config fields holding one entry per decoder layer; sliced to the kept layers.
PER_LAYER_FIELDS = ("layer_types",)


def validate_removal(remove: Iterable[int], num_layers: int) -> list[int]:
    """Sorted removed indices, or a ValueError that says what is wrong with them."""
    remove = list(remove)
    bad_type = [i for i in remove if isinstance(i, bool) or not isinstance(i, int)]
    if bad_type:
        raise ValueError(f"Layer indices must be integers, got {bad_type}.")
    out_of_range = [i for i in remove if not 0 <= i < num_layers]
    if out_of_range:
        raise ValueError(f"Layer indices {out_of_range} are out of range: the model has layers 0..{num_layers - 1}.")
    duplicated = sorted({i for i in remove if remove.count(i) > 1})
    if duplicated:
        raise ValueError(f"Layer indices {duplicated} are listed more than once.")
    if not remove:
        raise ValueError("No layer to remove: pass at least one layer index.")
    if len(remove) >= num_layers:
        raise ValueError(f"Cannot remove all {num_layers} layers: at least one decoder layer must remain.")
    return sorted(remove)


def validate_operator(operator: torch.Tensor, hidden_size: int, where: str) -> torch.Tensor:
    """Check shape, dtype and finiteness of one boundary operator."""
    if not isinstance(operator, torch.Tensor):
        raise TypeError(f"Operator for {where} must be a torch.Tensor, got {type(operator).__name__}.")
    if tuple(operator.shape) != (hidden_size, hidden_size):
        raise ValueError(
            f"Operator for {where} has shape {tuple(operator.shape)}; expected ({hidden_size}, {hidden_size}) "
            "(hidden size x hidden size, applied as x @ W)."
        )
    if not operator.is_floating_point():
        raise ValueError(f"Operator for {where} must be a floating-point tensor, got {operator.dtype}.")
    if not torch.isfinite(operator).all():
        raise ValueError(f"Operator for {where} contains NaN or Inf values.")
    return operator


def pruned_text_config(config: PretrainedConfig, kept: list[int]) -> PretrainedConfig:
    """The base config with `num_hidden_layers` and every per-layer field restricted to `kept`."""
    values = config.to_dict()
    values["num_hidden_layers"] = len(kept)
    for field in PER_LAYER_FIELDS:
        if values.get(field) is not None:
            values[field] = [values[field][i] for i in kept]
    if isinstance(values.get("max_window_layers"), int):
        # Qwen2/Qwen3: the first `max_window_layers` layers use full attention.
        values["max_window_layers"] = sum(1 for i in kept if i < config.max_window_layers)
    pruned = type(config).from_dict(values)
    pruned._attn_implementation = config._attn_implementation
    return pruned


def _dense_name(name: str, kept: list[int]) -> str:
    """Name in the dense model of a tensor of the pruned model."""
    parts = name.split(".")
    if parts[:2] == ["model", "layers"]:
        parts[2] = str(kept[int(parts[2])])
    return ".".join(parts)


def _take_tensor(pruned: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Install `tensor` (the very object, not a copy) as the parameter or buffer `name` of `pruned`."""
    module_name, _, leaf = name.rpartition(".")
    module = pruned.get_submodule(module_name)
    if leaf in module._parameters:
        module._parameters[leaf] = tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor)
    else:
        module._buffers[leaf] = tensor


def _adopt_tensors(target: nn.Module, source: nn.Module, source_name: Callable[[str], str]) -> None:
    """Fill every parameter and buffer of meta-built `target` (except ghost operators) with the tensor of
    `source` named `source_name(name)`, then re-tie shared weights."""
    names = [n for n, _ in target.named_parameters(remove_duplicate=False)]
    names += [n for n, _ in target.named_buffers(remove_duplicate=False)]
    for name in names:
        if f".{GHOST_MODULE}." in name:
            continue
        try:
            tensor = source.get_parameter(source_name(name))
        except AttributeError:
            tensor = source.get_buffer(source_name(name))
        _take_tensor(target, name, tensor)
    target.tie_weights()


def _check_dense_model(model: PreTrainedModel) -> None:
    model_type = getattr(model.config, "model_type", None)
    if model_type == "ghosted":
        raise ValueError(
            "This model is already ghosted. Prune the dense model once, listing every layer to remove."
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"Unsupported architecture {model_type!r} ({type(model).__name__}); supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}."
        )
    if not hasattr(model, "lm_head") or not hasattr(getattr(model, "model", None), "layers"):
        raise ValueError(
            f"Expected a causal LM with `model.layers` and `lm_head` (e.g. LlamaForCausalLM), got {type(model).__name__}."
        )
    offloaded = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if offloaded:
        raise ValueError(
            f"{len(offloaded)} weights are offloaded (on the meta device, e.g. {offloaded[0]}); layer surgery needs "
            "every kept weight in memory. Load the model without disk offload to prune it."
        )


def prune_layers(
    model: PreTrainedModel,
    remove: Iterable[int],
    operators: Mapping[int, torch.Tensor] | None = None,
    *,
    operator_kind: str = "custom",
    operator_dtype: torch.dtype = torch.float32,
) -> GhostedForCausalLM:
    """Remove decoder layers `remove` (dense numbering) and install one operator per boundary.

    Consecutive removed layers form one boundary; `operators` maps the first removed index of a boundary
    to its (C, C) operator, applied as ``x @ W`` to the hidden state that reaches the next kept layer (or
    the final norm). Boundaries without an operator get the identity, i.e. plain pruning.

    The returned model shares the dense model's tensors (no copy, so peak memory stays one model): treat
    `model` as consumed.
    """
    _check_dense_model(model)
    base_config = model.config
    total = base_config.num_hidden_layers
    removed = validate_removal(remove, total)
    kept = [i for i in range(total) if i not in set(removed)]
    hidden = base_config.hidden_size
    boundaries = expected_boundaries(total, removed)

    operators = dict(operators or {})
    starts = {b["removed"][0]: b for b in boundaries}
    unknown = sorted(set(operators) - set(starts))
    if unknown:
        raise ValueError(
            f"Operators given for {unknown}, but boundaries start at {sorted(starts)} "
            "(key each operator by the first removed layer of its run of consecutive removed layers)."
        )
    if operator_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"operator_dtype must be torch.float32 or torch.bfloat16, got {operator_dtype}.")
    for start, op in operators.items():
        validate_operator(op, hidden, f"the boundary after removed layers {starts[start]['removed']}")

    config = GhostedConfig(
        text_config=pruned_text_config(base_config, kept),
        original_num_hidden_layers=total,
        removed_layers=removed,
        ghost_boundaries=[
            {**b, "operator": operator_kind if b["removed"][0] in operators else "identity", "fit": {}}
            for b in boundaries
        ],
        operator_dtype=str(operator_dtype).removeprefix("torch."),
        ghost_provenance={"base_model": base_config._name_or_path or None},
    )
    config._attn_implementation = base_config._attn_implementation
    config.dtype = base_config.dtype

    with torch.device("meta"):
        pruned = GhostedForCausalLM(config)

    _adopt_tensors(pruned, model, lambda name: _dense_name(name, kept))

    for boundary in boundaries:
        key = ghost_tensor_key(boundary)
        parent = pruned.get_submodule(key.rsplit(".", 2)[0])
        device = next(p.device for n, p in parent.named_parameters() if not n.startswith(GHOST_MODULE))
        start = boundary["removed"][0]
        value = operators[start] if start in operators else torch.eye(hidden)
        _take_tensor(pruned, key, nn.Parameter(value.detach().to(device=device, dtype=operator_dtype).clone()))

    still_meta = [n for n, t in {**dict(pruned.named_parameters()), **dict(pruned.named_buffers())}.items()
                  if t.device.type == "meta"]
    if still_meta:
        raise RuntimeError(f"Layer surgery left tensors unassigned: {still_meta}")
    pruned.generation_config = copy.deepcopy(model.generation_config)
    pruned.train(model.training)
    logger.info("Removed layers %s of %d; %d boundaries.", removed, total, len(boundaries))
    return pruned


def export_plain(model: GhostedForCausalLM) -> PreTrainedModel:
    """The same network as a plain Llama/Qwen model (no remote code), when every operator is the identity,
    e.g. after `replaceme-ls` folded its transform into `down_proj`. Shares tensors with `model`."""
    from transformers import AutoModelForCausalLM

    for name, operator in model.ghost_operators().items():
        eye = torch.eye(operator.shape[0], dtype=operator.dtype, device=operator.device)
        if not torch.equal(operator, eye):
            raise ValueError(
                f"{name} is not the identity: this model needs its operators and cannot be exported as a plain "
                "checkpoint. Use operator='replaceme-ls' for a fused export, or save it as a ghosted model."
            )
    text_config = copy.deepcopy(model.config.text_config)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(text_config)
    _adopt_tensors(plain, model, lambda name: name)
    plain.generation_config = copy.deepcopy(model.generation_config)
    plain.train(model.training)
    return plain
