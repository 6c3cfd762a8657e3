"""Layer removal: from a dense causal LM of any family in the architecture registry to a `GhostedForCausalLM`.

The pruned model is rebuilt from a pruned config (every attention gets `layer_idx` 0..L'-1, every per-layer config
field is re-indexed), checked layer by layer against the dense layers it stands for, then takes over their tensors.
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from ..architectures import (Layout, architecture, check_layers_match, check_removal, decoder, decoder_layers, stream_width,
                             is_multimodal, language_config, layer_of, layer_prefix, pruned_config)
from ..errors import GhostedError, NonFiniteError, one_line
from ..remote.configuration_ghosted import GhostedConfig
from ..remote.format_ghosted import (GHOST_DOWN, GHOST_MODULE, GHOST_NORMED, GHOST_UP, OPERATOR_DTYPES, SUBBLOCK_KINDS,
                                     decoder_paths, expected_boundaries, ghost_tensor_key, ghost_tensor_keys,
                                     kept_layers, required_format_version)
from ..remote.modeling_ghosted import GhostedForCausalLM, GhostedForConditionalGeneration
from . import verify

logger = logging.getLogger(__name__)

SubBlockMap = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # a C x C map, or a rank-r map's (down, up)


def as_layer_index(value: object) -> int:
    """`value` as a Python int: ints, numpy and torch integer scalars; refuses bools, floats and strings."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise GhostedError(f"Layer indices must be integers, got {value!r} ({type(value).__name__}).")
    if isinstance(value, torch.Tensor) and (value.numel() != 1 or value.is_floating_point()):
        raise GhostedError(f"Layer indices must be integers, got the tensor {value!r}.")
    return int(value.__index__())


def validate_removal(remove: Iterable[int], depth: int) -> list[int]:
    """Sorted removed indices, or a GhostedError that says what is wrong with them."""
    if isinstance(remove, (str, bytes)) or not isinstance(remove, Iterable):
        raise GhostedError(f"Layer indices must be a list of integers, got {remove!r}.")
    remove = [as_layer_index(i) for i in remove]
    out_of_range = [i for i in remove if not 0 <= i < depth]
    if out_of_range:
        raise GhostedError(f"Layer indices {out_of_range} are out of range: the model has layers 0..{depth - 1}.")
    duplicated = sorted({i for i in remove if remove.count(i) > 1})
    if duplicated:
        raise GhostedError(f"Layer indices {duplicated} are listed more than once.")
    if not remove:
        raise GhostedError("No layer to remove: pass at least one layer index.")
    if len(remove) >= depth:
        raise GhostedError(f"Cannot remove all {depth} layers: at least one decoder layer must remain.")
    return sorted(remove)


def _validate_ghost_tensor(tensor: torch.Tensor, width: int, what: str, where: str, dtype: torch.dtype,
                           shape: tuple[int, int] | None = None) -> torch.Tensor:
    """`tensor` cast to its storage `dtype`, after checking type, shape (width x width, or `shape`), dtype, device and
    finiteness (of the stored values: a float64 tensor that overflows float32 is refused)."""
    if not isinstance(tensor, torch.Tensor):
        raise GhostedError(f"{what} for {where} must be a torch.Tensor, got {type(tensor).__name__}.")
    if tuple(tensor.shape) != (shape or (width, width)):
        raise GhostedError(f"{what} for {where} has shape {tuple(tensor.shape)}; expected {shape or (width, width)} "
                           + ("(the residual stream's width, squared)." if shape is None else "(a rank-r map's factor)."))
    if not tensor.is_floating_point():
        raise GhostedError(f"{what} for {where} must be a floating-point tensor, got {tensor.dtype}.")
    if tensor.device.type == "meta":
        raise GhostedError(f"{what} for {where} is on the meta device (it holds no values); pass a real tensor.")
    stored = tensor.detach().to(dtype)
    if not torch.isfinite(stored).all():
        problem = "contains NaN or Inf values" if not torch.isfinite(tensor).all() else f"overflows {dtype}"
        raise NonFiniteError(f"{what} for {where} {problem}.")
    return stored


def _dense_name(name: str, kept: list[int], layout: Layout) -> str:
    """Name in the dense model of a tensor of the pruned model."""
    layer = layer_of(name, layout)
    return name if layer is None else name.replace(layer_prefix(layer, layout), layer_prefix(kept[layer], layout), 1)


def _take_tensor(pruned: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Install `tensor` (the very object, not a copy) as the parameter or buffer `name` of `pruned`."""
    module_name, _, leaf = name.rpartition(".")
    module = pruned.get_submodule(module_name)
    if leaf in module._parameters:
        module._parameters[leaf] = tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor)
    else:
        module._buffers[leaf] = tensor


def adopt_tensors(target: nn.Module, source: nn.Module, source_name: Callable[[str], str],
                  skip: tuple[str, ...] = (), kept: tuple[int, list[int]] | None = None) -> None:
    """Fill every parameter and buffer of meta-built `target` (except ghost operators, and names starting with one
    of `skip`) with the tensor of `source` named `source_name(name)`, then re-tie shared weights. With `kept` (the
    source's layer count, the layers kept), a tensor holding one block per layer keeps the kept layers' blocks."""
    for name, meta in [*target.named_parameters(remove_duplicate=False), *target.named_buffers(remove_duplicate=False)]:
        if f".{GHOST_MODULE}." in name or name.startswith(skip):
            continue
        try:
            tensor = source.get_parameter(source_name(name))
        except AttributeError:
            tensor = source.get_buffer(source_name(name))
        if tensor.device.type == "meta":  # removed layers may stay unloaded; what is kept may not
            raise GhostedError(
                f"The kept weight {source_name(name)} is on the meta device (not loaded, or offloaded to disk): layer "
                "surgery needs every kept weight in memory. Load the model with real weights, without disk offload."
            )
        if tensor.shape != meta.shape:
            blocks = _per_layer_blocks(tensor, meta.shape, *kept) if kept else None
            if blocks is None:
                raise GhostedError(f"{source_name(name)} has shape {tuple(tensor.shape)}, and the pruned model's "
                                   f"{name} {tuple(meta.shape)}: a size that depends on the layer count is not carried "
                                   "over. Report it with the model's config.json.")
            tensor = nn.Parameter(blocks, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else blocks
        _take_tensor(target, name, tensor)
    target.tie_weights()


def _per_layer_blocks(tensor: torch.Tensor, shape: torch.Size, depth: int, kept: list[int]) -> torch.Tensor | None:
    """The kept layers' blocks of a tensor holding one block per decoder layer along one dimension (Gemma 3n/4's
    per-layer input embeddings and their projection); None where `tensor` is no such thing."""
    differ = [d for d, (a, b) in enumerate(zip(tensor.shape, shape)) if a != b]
    if len(tensor.shape) != len(shape) or len(differ) != 1 or not kept:
        return None
    axis = differ[0]
    size = shape[axis] // len(kept)
    if shape[axis] != size * len(kept) or tensor.shape[axis] != size * depth:
        return None
    index = torch.cat([torch.arange(i * size, (i + 1) * size) for i in kept]).to(tensor.device)
    return tensor.detach().index_select(axis, index)


def _check_dense_model(model: PreTrainedModel) -> None:
    if getattr(getattr(model, "config", None), "model_type", None) == "ghosted":
        raise GhostedError("This model is already ghosted. Prune the dense model once, listing every layer to remove.")
    architecture(model)
    decoder(model)
    if model.get_output_embeddings() is None:
        raise GhostedError(f"Expected a causal LM with an output layer (e.g. LlamaForCausalLM), got {type(model).__name__}.")


def _stored_operators(operators: Mapping[int, torch.Tensor] | None, boundaries: list[dict], hidden: int,
                      dtype: torch.dtype, what: str = "Operator") -> dict[int, torch.Tensor]:
    """The given operators (or normed terms) by their boundary's first removed layer, checked and cast to `dtype`."""
    first = [b["removed"][0] for b in boundaries]
    if operators is not None and not isinstance(operators, Mapping):
        raise GhostedError(
            f"operators must map the first removed layer of each boundary to its tensor (a dict such as "
            f"{{{first[0]}: W}}), got a {type(operators).__name__}."
        )
    operators = {as_layer_index(k): v for k, v in (operators or {}).items()}
    unknown = sorted(set(operators) - set(first))
    if unknown:
        raise GhostedError(
            f"Operators given for {unknown}, but boundaries start at {first} "
            "(key each operator by the first removed layer of its run of consecutive removed layers)."
        )
    if str(dtype).removeprefix("torch.") not in OPERATOR_DTYPES:
        raise GhostedError(f"operator_dtype must be one of {OPERATOR_DTYPES}, got {dtype}.")
    removed_at = {b["removed"][0]: b["removed"] for b in boundaries}
    return {start: _validate_ghost_tensor(op, hidden, what, f"the boundary after removed layers {removed_at[start]}",
                                          dtype) for start, op in operators.items()}


def prune_layers(
    model: PreTrainedModel,
    remove: Iterable[int],
    operators: Mapping[int, torch.Tensor] | None = None,
    *,
    operator_kind: str = "custom",
    operator_dtype: torch.dtype = torch.float32,
    normed: Mapping[int, torch.Tensor] | None = None,
    subblocks: Mapping[tuple[int, str], tuple[SubBlockMap, int]] | None = None,
) -> GhostedForCausalLM:
    """Remove decoder layers `remove` (dense numbering) and install one operator per boundary.

    Consecutive removed layers form one boundary; `operators` maps a boundary's first removed index to its (C, C)
    operator, applied as ``x @ W`` to the hidden state reaching the next kept layer (or the final norm); boundaries
    without one get the identity (kind "none": plain pruning), the others are recorded as `operator_kind`. `normed`
    (same keys) adds a term ``n(x) @ A`` (format 1.1; the operator defaults to the identity). `subblocks` maps (kept
    dense layer, "attention" or "mlp") to (its C x C map, how many values the module returns): that sub-block becomes
    ``h -> h @ map`` (format 1.2), and `remove` may be empty; a map given as factors (down (C, r), up (r, C)) is
    stored as them, ``h -> (h @ down) @ up`` (format 1.4).

    The returned model shares the dense model's tensors (no copy: peak memory stays one model): treat `model` as
    consumed.
    """
    _check_dense_model(model)
    if not (subblocks and not remove):  # whole layers removed
        check_derived_layout(model.config)
    if subblocks:
        check_derived_layout(model.config, subblocks=True)
    base_config = model.config
    text = language_config(base_config)  # (a multimodal model's language decoder's)
    depth, hidden, width = text.num_hidden_layers, text.hidden_size, stream_width(base_config)
    if isinstance(remove, Iterable) and not isinstance(remove, (str, bytes)):
        remove = list(remove)
    removed = [] if subblocks and remove == [] else validate_removal(remove, depth)
    check_removal(text, removed)
    kept = kept_layers(depth, removed)
    if kept and {i for i, block in (subblocks or {}) if block == "attention"} >= set(kept):
        raise GhostedError("Replacing the attention of every kept layer leaves no token mixing (each position would "
                           "be computed from itself alone): keep at least one attention sub-block.")
    replaced = _subblock_records(model, subblocks or {}, kept, hidden, operator_dtype)

    boundaries = expected_boundaries(depth, removed)
    stored = _stored_operators(operators, boundaries, width, operator_dtype)
    terms = _stored_operators(normed, boundaries, width, operator_dtype, "Normed term")
    start_of = lambda b: b["removed"][0]  # noqa: E731
    records = [{**b, "operator": operator_kind if start_of(b) in stored.keys() | terms.keys() else "none", "fit": {},
                **({"normed": True} if start_of(b) in terms else {})} for b in boundaries]

    layout = architecture(model).layout
    whole = pruned_config(base_config, kept)  # (a multimodal base: with its language decoder's config pruned)
    config = GhostedConfig(
        text_config=language_config(whole),
        base_config=whole if is_multimodal(base_config) else None,
        ghost_layout=layout.as_config(),
        original_num_hidden_layers=depth,
        removed_layers=removed,
        ghost_boundaries=records,
        ghost_subblocks=[record for record, _ in replaced],
        ghost_format_version=required_format_version(records, [record for record, _ in replaced], layout.as_config()),
        operator_dtype=str(operator_dtype).removeprefix("torch."),
        ghost_provenance={"base_model": base_config._name_or_path or None},
    )
    config._attn_implementation = base_config._attn_implementation
    config.dtype = base_config.dtype

    with torch.device("meta"):
        pruned = (GhostedForConditionalGeneration if is_multimodal(base_config) else GhostedForCausalLM)(config)
    dense_layers = decoder_layers(model)
    by_layer: dict[int, list[str]] = {}
    for record, _ in replaced:
        by_layer.setdefault(record["layer"], []).append(record["module"])
    check_layers_match([dense_layers[i] for i in kept], decoder_layers(pruned), kept, by_layer)

    adopt_tensors(pruned, model, lambda name: _dense_name(name, kept, layout), kept=(depth, kept))

    paths = decoder_paths(config)
    for boundary in records:
        key = ghost_tensor_key(boundary, paths=paths)
        device = _weight_device(pruned.get_submodule(key.rsplit(".", 2)[0]))
        value = stored.get(start_of(boundary), torch.eye(width, dtype=operator_dtype))
        _take_tensor(pruned, key, nn.Parameter(value.to(device=device).clone()))
        if boundary.get("normed"):
            _take_tensor(pruned, ghost_tensor_key(boundary, GHOST_NORMED, paths), terms[start_of(boundary)].to(device).clone())

    for record, values in replaced:
        device = _weight_device(dense_layers[record["original_layer"]])
        for key, value in zip(ghost_tensor_keys(record, paths).values(), values):
            _take_tensor(pruned, key, nn.Parameter(value.to(device=device).clone()))

    still_meta = [n for n, t in [*pruned.named_parameters(), *pruned.named_buffers()] if t.device.type == "meta"]
    if still_meta:
        raise RuntimeError(f"Layer surgery left tensors unassigned: {still_meta}")
    pruned.generation_config = copy.deepcopy(model.generation_config)
    pruned.train(model.training)
    check_runs(pruned)
    logger.info("Removed layers %s of %d; %d boundaries; %d sub-blocks replaced.", removed, depth, len(boundaries),
                len(replaced))
    return pruned


def _weight_device(module: nn.Module) -> torch.device:
    """Where a module's own weights sit (its ghost tensors aside): where a ghost tensor beside them goes; the CPU for a
    module without weights (OLMo's final LayerNorm)."""
    return next((p.device for n, p in module.named_parameters() if GHOST_MODULE not in n.split(".")),
                torch.device("cpu"))


def _subblock_records(model: PreTrainedModel, subblocks: Mapping[tuple[int, str], tuple[SubBlockMap, int]],
                      kept: list[int], hidden: int, dtype: torch.dtype) -> list[tuple[dict, tuple[torch.Tensor, ...]]]:
    """(config record, its map's tensors checked and cast to `dtype`) per replaced sub-block, in network order."""
    family, layers = architecture(model), decoder_layers(model)
    out = []
    for (layer, block), (value, outputs) in subblocks.items():
        layer = as_layer_index(layer)
        if layer not in kept:
            raise GhostedError(f"The {block} of layer {layer} is replaced, but layer {layer} is removed whole: replace "
                               "sub-blocks of kept layers only.")
        if block not in SUBBLOCK_KINDS:
            raise GhostedError(f"A sub-block is {' or '.join(SUBBLOCK_KINDS)}, got {block!r}.")
        record = {"layer": kept.index(layer), "original_layer": layer, "block": block,
                  "module": getattr(family, block).attribute(layers[layer]), "outputs": int(outputs), "fit": {}}
        where = f"the {block} of layer {layer}"
        if isinstance(value, tuple):  # a rank-r map's factors (down, up)
            rank = value[0].shape[-1] if len(value) == 2 and isinstance(value[0], torch.Tensor) else 0
            if not 0 < rank < hidden:
                raise GhostedError(f"A rank-r map for {where} is a pair (down (C, r), up (r, C)) with 0 < r < C = "
                                   f"{hidden}, got {len(value)} values of rank {rank}.")
            record["rank"] = rank
            out.append((record, tuple(_validate_ghost_tensor(t, hidden, f"Map factor {part}", where, dtype, shape)
                                      for t, part, shape in zip(value, (GHOST_DOWN, GHOST_UP),
                                                                ((hidden, rank), (rank, hidden))))))
        else:
            out.append((record, (_validate_ghost_tensor(value, hidden, "Map", where, dtype),)))
    return sorted(out, key=lambda item: (item[0]["layer"], SUBBLOCK_KINDS.index(item[0]["block"])))  # network order


def check_runs(model: PreTrainedModel) -> None:
    """One forward of a few tokens filling a cache, and one step on that cache: a pruned model that cannot run (a
    hybrid without the layers its masks are built from, say) is refused here, before it is returned or saved."""
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = (torch.arange(1, 5) % vocab).unsqueeze(0).to(model.get_input_embeddings().weight.device)
    accepted = inspect.signature(model.forward).parameters
    mode = model.training
    try:  # in eval mode, the caller's random state untouched
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model.eval()
            first = model(input_ids=ids, use_cache=True)
            # (the cache under the name this family gives it: a KV cache, Mamba's cache_params, RWKV's state)
            name = next((name for name in ("cache", "past_key_values", "cache_params", "state")
                         if name in accepted and getattr(first, name, None) is not None), None)
            step = model(input_ids=ids[:, -1:], use_cache=True, **({name: getattr(first, name)} if name else {}))
    except Exception as error:  # whatever the family's forward raises: the pruned structure is at fault
        reason = one_line(error)
        raise GhostedError(f"The pruned model cannot run: one forward and one cached step of a few tokens failed "
                           f"({type(error).__name__}: {reason}); nothing was saved. Keep more of the layers or "
                           "sub-blocks its family needs.") from error
    finally:
        model.train(mode)
    if not (torch.isfinite(first.logits).all() and torch.isfinite(step.logits).all()):
        raise GhostedError("The pruned model gives NaN or Inf logits on a few tokens; nothing was saved. Check the "
                           "operators (their fit figures in config.ghost_boundaries).")


def count_parameters(model: nn.Module) -> int:
    """Parameters of a module (tied embeddings count once: `parameters()` yields a shared tensor once)."""
    return sum(p.numel() for p in model.parameters())


def check_derived_layout(config: Any, subblocks: bool = False) -> None:
    """`verify.check_derived_layout` with this module's `prune_layers` (what the check prunes its small instance with)."""
    verify.check_derived_layout(config, prune_layers, subblocks)
