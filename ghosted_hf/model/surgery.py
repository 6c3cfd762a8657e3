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

from ..architectures import (ARCHITECTURES, Layout, StreamWeight, SubBlock, Verdict, architecture, check_declared,
                             check_layers_match, check_removal, decoder, decoder_layers, is_multimodal,
                             language_config, layer_of, layer_prefix, pruned_config, quiet_transformers, refuse_fold,
                             removal_problem, small_configs, stream_weights)
from ..errors import GhostedError, NonFiniteError, one_line
from ..statistics.capture import apply_matrix, input_hook, output_hook
from ..remote.configuration_ghosted import GhostedConfig
from ..remote.format_ghosted import (GHOST_MODULE, GHOST_NORMED, LAYER_TARGET, OPERATOR_DTYPES, SUBBLOCK_KINDS,
                                     decoder_paths, expected_boundaries, ghost_tensor_key, pruned_index,
                                     required_format_version)
from ..remote.modeling_ghosted import GhostedForCausalLM, GhostedForConditionalGeneration
from .provenance import Provenance

logger = logging.getLogger(__name__)


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


def _validate_ghost_tensor(tensor: torch.Tensor, width: int, what: str, where: str, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` cast to its storage `dtype`, after checking type, shape (width x width), dtype, device and finiteness
    (of the stored values: a float64 tensor that overflows float32 is refused)."""
    if not isinstance(tensor, torch.Tensor):
        raise GhostedError(f"{what} for {where} must be a torch.Tensor, got {type(tensor).__name__}.")
    if tuple(tensor.shape) != (width, width):
        raise GhostedError(f"{what} for {where} has shape {tuple(tensor.shape)}; expected {(width, width)} (hidden "
                           "size x hidden size).")
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
    subblocks: Mapping[tuple[int, str], tuple[torch.Tensor, int]] | None = None,
) -> GhostedForCausalLM:
    """Remove decoder layers `remove` (dense numbering) and install one operator per boundary.

    Consecutive removed layers form one boundary; `operators` maps a boundary's first removed index to its (C, C)
    operator, applied as ``x @ W`` to the hidden state reaching the next kept layer (or the final norm); boundaries
    without one get the identity (kind "none": plain pruning), the others are recorded as `operator_kind`. `normed`
    (same keys) adds a term ``n(x) @ A`` (format 1.1; the operator defaults to the identity). `subblocks` maps (kept
    dense layer, "attention" or "mlp") to (its C x C map, how many values the module returns): that sub-block becomes
    ``h -> h @ map`` (format 1.2), and `remove` may be empty.

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
    depth, hidden = text.num_hidden_layers, text.hidden_size
    if isinstance(remove, Iterable) and not isinstance(remove, (str, bytes)):
        remove = list(remove)
    removed = [] if subblocks and remove == [] else validate_removal(remove, depth)
    check_removal(text, removed)
    kept = [i for i in range(depth) if i not in set(removed)]
    if kept and {i for i, block in (subblocks or {}) if block == "attention"} >= set(kept):
        raise GhostedError("Replacing the attention of every kept layer leaves no token mixing (each position would "
                           "be computed from itself alone): keep at least one attention sub-block.")
    replaced = _subblock_records(model, subblocks or {}, kept, hidden, operator_dtype)

    boundaries = expected_boundaries(depth, removed)
    stored = _stored_operators(operators, boundaries, hidden, operator_dtype)
    terms = _stored_operators(normed, boundaries, hidden, operator_dtype, "Normed term")
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
        value = stored.get(start_of(boundary), torch.eye(hidden, dtype=operator_dtype))
        _take_tensor(pruned, key, nn.Parameter(value.to(device=device).clone()))
        if boundary.get("normed"):
            _take_tensor(pruned, ghost_tensor_key(boundary, GHOST_NORMED, paths), terms[start_of(boundary)].to(device).clone())

    for record, value in replaced:
        device = _weight_device(dense_layers[record["original_layer"]])
        _take_tensor(pruned, ghost_tensor_key(record, paths=paths), nn.Parameter(value.to(device=device).clone()))

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


def _subblock_records(model: PreTrainedModel, subblocks: Mapping[tuple[int, str], tuple[torch.Tensor, int]],
                      kept: list[int], hidden: int, dtype: torch.dtype) -> list[tuple[dict, torch.Tensor]]:
    """(config record, map checked and cast to `dtype`) per replaced sub-block, in network order."""
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
        out.append((record, _validate_ghost_tensor(value, hidden, "Map", f"the {block} of layer {layer}", dtype)))
    return sorted(out, key=lambda item: (item[0]["layer"], SUBBLOCK_KINDS.index(item[0]["block"])))  # network order


def fold_into_mlp_writers(model: GhostedForCausalLM, dense_layer: int, transform: torch.Tensor) -> str:
    """Replace the MLP output m of kept dense layer `dense_layer` by m @ T (ReplaceMe's fused export); returns the
    names of the edited weights (the family's MLP writers: output projections, experts' and shared experts' too)."""
    family = architecture(model)
    refuse_fold(family, "replaceme-ls")
    layer = pruned_index(dense_layer, model.config.removed_layers)
    mlp = family.mlp.module(decoder_layers(model)[layer])
    _, writers = _block_weights(family.mlp, mlp, model.config.hidden_size)
    for writer in writers:
        _map_stream(writer, transform.detach().double())
    paths = {id(module): name for name, module in mlp.named_modules()}
    prefix = layer_prefix(layer, family.layout) + family.mlp.modules[0]
    # A Linear by its module's name, a raw parameter (fused experts) by its own.
    edited = dict.fromkeys(".".join(filter(None, (prefix, paths[id(owner)], None if isinstance(owner, nn.Linear)
                                                  else name))) for owner, name, _ in writers)
    return ", ".join(edited)


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


_TWIN_DEPTH, _TWIN_PARAMETERS = 6, 50_000_000
_VERDICTS: dict[tuple[str, str], str | None] = {}  # (model type, unit) -> None (the check passed) or why it failed


def check_derived_layout(config: Any, subblocks: bool = False) -> None:
    """Use a derived layout only once a small random instance of the same config class, pruned by it, equals the
    dense instance with the change made by hooks, and generates the same tokens with the cache as without: for whole
    layers, a removal in the middle and one of the last layer with random operators (the layers skipped); with
    `subblocks`, the first layer's attention and the last layer's MLP replaced by random maps (their outputs replaced).
    Checked once per model type, unit and process; a failure is refused in one line naming what failed. A multimodal
    model's language decoder is checked."""
    config = language_config(config)
    key = (config.model_type, "sub-blocks" if subblocks else "whole layers")
    if not architecture(config).derived or _VERDICTS.get(key, "") is None:
        return
    if key not in _VERDICTS:
        _VERDICTS[key] = "being checked"  # the check's own prune_layers passes through here
        try:
            # seeded instances, the caller's random state untouched; transformers' warnings about the probe off
            with torch.random.fork_rng(devices=[]), quiet_transformers():
                _compare_with_skip_reference(_small_twin(config), subblocks)
            _VERDICTS[key] = None
            if subblocks:
                _LAST_TWIN.clear()  # (the sub-block check comes last)
        except Exception as error:  # whatever the family's code raises on its small instance
            reason = " ".join(str(error).split()).split(" Report it")[0].rstrip(".")  # (the check's own advice follows)
            _VERDICTS[key] = reason[:300] or type(error).__name__
    if _VERDICTS[key] not in (None, "being checked"):
        raise GhostedError(f"{key[0]!r} has no entry in ghosted_hf's architecture registry, and the layout derived for "
                           f"it failed its check on a small instance ({key[1]}): {_VERDICTS[key]}. Report it with the "
                           "model's config.json (docs/architectures.md says how to add an entry).")


def derivation_verdicts(types: Iterable[str]) -> dict[str, Verdict]:
    """Each type of `types` with no registry entry: its derived layout and why whole layers, then sub-blocks, are
    refused (None: the check passed), as `check_derived_layout` decides (the docs' table of derived families)."""
    from transformers import AutoConfig

    verdicts: dict[str, Verdict] = {}
    for model_type in (t for t in types if t not in ARCHITECTURES):
        try:
            config = AutoConfig.for_model(model_type)
        except Exception as error:  # the family's own defaults do not build: nothing to derive from
            verdicts[model_type] = (None, f"its default config cannot be built ({type(error).__name__})", None)
            continue
        layout, whole, sub = None, None, None
        try:
            layout = architecture(config).layout
            check_derived_layout(config)
        except GhostedError as error:
            whole = _VERDICTS.get((model_type, "whole layers")) or str(error)  # (the check's reason, where it ran)
        if whole is None:
            try:
                check_derived_layout(config, subblocks=True)
            except GhostedError:
                sub = _VERDICTS[model_type, "sub-blocks"]
        verdicts[model_type] = (layout, whole, sub)
    return verdicts


_LAST_TWIN: dict[str, PreTrainedModel] = {}  # the last small instance built, by model type (its two checks share it)


def _small_twin(config: Any) -> PreTrainedModel:
    """A random float32 instance of `config`'s class, a few layers deep and a few dozen wide where the family accepts
    that (`small_configs`), whose dense forward runs. The checks leave it as it was (pruning shares its tensors and
    changes none), so the sub-block check reuses the whole-layer check's."""
    if config.model_type not in _LAST_TWIN:
        _LAST_TWIN.clear()
        _LAST_TWIN[config.model_type] = _build_twin(config)
    return _LAST_TWIN[config.model_type]


def _build_twin(config: Any) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    problems = []
    for small, problem in small_configs(config, _TWIN_DEPTH):
        if small is None:
            problems.append(problem)
            continue
        try:
            with torch.device("meta"):
                count = count_parameters(AutoModelForCausalLM.from_config(small))
            if count > _TWIN_PARAMETERS:
                problems.append(f"{count:,} parameters at its own widths")
                continue
            torch.manual_seed(0)
            twin = AutoModelForCausalLM.from_config(small, dtype=torch.float32).eval()
            with torch.no_grad():
                twin(**_twin_inputs(twin))
            return twin
        except Exception as error:  # the family's model on these sizes: try the next
            problems.append(f"{type(error).__name__}: {one_line(error, 120)}")
    raise GhostedError(f"no small instance of its config could be built and run ({'; '.join(problems)})")


def _twin_inputs(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(3, max(4, min(vocab, 100)), (2, 9), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _compare_with_skip_reference(twin: PreTrainedModel, subblocks: bool = False) -> None:
    """Prune `twin` (whole layers, or with `subblocks` two sub-blocks) and compare it with its dense self with the
    removed layers skipped, or the sub-blocks' outputs replaced, by hooks (the definition)."""
    depth, width = twin.config.num_hidden_layers, twin.config.hidden_size
    removed = [] if subblocks else next(sorted(set(r)) for r in ([1, depth - 1], [depth - 1], [1])  # middle, last
                                        if len(set(r)) < depth and removal_problem(twin.config, r) is None)
    generator = torch.Generator().manual_seed(1)
    operators = {b["removed"][0]: torch.eye(width) + 0.05 * torch.randn(width, width, generator=generator)
                 for b in expected_boundaries(depth, removed)}
    inputs = _twin_inputs(twin)
    layers = decoder_layers(twin)
    hooks = [layers[i].register_forward_hook(_passed_through, with_kwargs=True) for i in removed]
    # Each operator on the fed layer's input; after the last layer, on the output of the last one kept (found without
    # the layout's final norm, which this checks).
    for b in expected_boundaries(depth, removed):
        fed, apply = b["removed"][-1] + 1, apply_matrix(operators[b["removed"][0]])
        hooks.append(layers[fed].register_forward_pre_hook(input_hook(apply), with_kwargs=True) if fed < depth else
                     layers[b["removed"][0] - 1].register_forward_hook(output_hook(apply)))
    maps, outputs = {}, {}
    if subblocks:
        family = architecture(twin)
        for layer, block in ((0, "attention"), (depth - 1, "mlp")):
            maps[layer, block] = 0.5 * torch.randn(width, width, generator=generator)
            module = getattr(family, block).module(layers[layer])
            hooks.append(module.register_forward_hook(_replaced(maps[layer, block], outputs, (layer, block)),
                                                      with_kwargs=True))
    try:
        with torch.no_grad():
            expected = twin(**inputs, use_cache=False).logits
    finally:
        for hook in hooks:
            hook.remove()
    pruned = prune_layers(twin, removed, operators, operator_kind="ghost",
                          subblocks={key: (value, outputs[key]) for key, value in maps.items()} or None)
    with torch.no_grad():
        got = pruned(**inputs, use_cache=False).logits
    gap = float((got - expected).abs().max())
    if not gap <= 1e-4 * max(1.0, float(expected.abs().max())):
        raise GhostedError(f"{'replacing sub-blocks' if subblocks else f'removing layers {removed}'} gives logits {gap:.3g} away from the dense instance "
                           "with those layers skipped")
    prompt = inputs["input_ids"][:1]
    # (two new tokens: the second is the first computed from the cache)
    cached = pruned.generate(input_ids=prompt, max_new_tokens=2, do_sample=False, pad_token_id=0)
    if not torch.equal(cached, pruned.generate(input_ids=prompt, max_new_tokens=2, do_sample=False, pad_token_id=0,
                                               use_cache=False)):
        raise GhostedError("its generation with the KV cache differs from generation without it")


def _passed_through(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    hidden = args[0] if args else kwargs["hidden_states"]
    return type(output)([hidden, *output[1:]]) if isinstance(output, (tuple, list)) else hidden


def _replaced(matrix: torch.Tensor, outputs: dict, key: tuple) -> Callable:
    """A forward hook giving the module's output as `matrix` applied to its input (and recording how many values
    the module returns, as a replaced sub-block records it)."""
    def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        mapped = apply_matrix(matrix)(args[0] if args else kwargs["hidden_states"])
        outputs[key] = len(output) if isinstance(output, tuple) else 0
        return (mapped, *([None] * (len(output) - 1))) if isinstance(output, tuple) else mapped
    return hook


def count_parameters(model: nn.Module) -> int:
    """Parameters of a module (tied embeddings count once: `parameters()` yields a shared tensor once)."""
    return sum(p.numel() for p in model.parameters())


def scaled_rotation(operator: torch.Tensor, tolerance: float = 1e-4) -> tuple[float, torch.Tensor] | None:
    """(c, Q) with operator = c Q, c > 0 and Q orthogonal (within `tolerance`), or None."""
    w = operator.detach().double().cpu()
    c = float(torch.linalg.norm(w)) / w.shape[0] ** 0.5
    if c <= 0:
        return None
    q = w / c
    eye = torch.eye(w.shape[0], dtype=torch.float64)
    if (q - eye).abs().max() <= 1e-6:  # a pure scale (rounded): no rotation to fold, tied embeddings stay tied
        return c, eye
    return (c, q) if (q.T @ q - eye).abs().max() <= tolerance else None


def _set_weight(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """A new parameter (never an in-place edit: the tensors may be shared with the model they came from)."""
    old = getattr(module, name)
    setattr(module, name, nn.Parameter(value.to(device=old.device, dtype=old.dtype), requires_grad=old.requires_grad))


def _map_stream(weight: StreamWeight, m: torch.Tensor) -> None:
    """Contract the axis of the stream's width with `m`: a reader now reads x @ m^-1 where it read x (weight
    <- weight @ m along that axis), a writer's output y becomes y @ m (weight <- m^T weight, bias <- bias @ m)."""
    owner, name, axis = weight
    old = getattr(owner, name).double()
    _set_weight(owner, name, (old.movedim(axis, -1) @ m.to(old.device)).movedim(-1, axis))


def _block_weights(block: SubBlock, module: nn.Module, width: int) -> tuple[list[StreamWeight], list[StreamWeight]]:
    """(readers, writers) of a sub-block for a fold, refused when a weight of the stream's width is undeclared."""
    readers, writers = stream_weights(module, block.readers, False), stream_weights(module, block.writers, True)
    check_declared(module, readers + writers, width)
    return readers, writers


def _fold_norm_weight(norm: nn.Module, readers: list[StreamWeight], gain: str) -> None:
    """RMSNorm(x) * g feeding `readers` == RMSNorm(x) feeding readers with g folded into their weights (g = w, or
    1 + w for a family whose gain reads so; the norm is left with gain 1)."""
    offset = 1.0 if gain == "one-plus-weight" else 0.0
    g = norm.weight.double() + offset
    if not torch.equal(g, torch.ones_like(g)):
        for reader in readers:
            _map_stream(reader, torch.diag(g))
        _set_weight(norm, "weight", torch.ones_like(g) - offset)


def fold_scaled_rotation(model: PreTrainedModel, layer: int, c: float, q: torch.Tensor) -> None:
    """Make a stock decoder compute what it would with ``x -> x @ (c Q)`` applied to the stream entering its layer
    `layer` (``len(layers)``: the final norm). Exact but for the norms' eps: every norm weight upstream is folded into
    the linear layers that read it, so that RMSNorm(x Q) = RMSNorm(x) Q; then the embeddings and the writers upstream
    map into the basis Q and their readers back. The scale goes into the embeddings when they are all that is
    upstream, else downstream, as 1/c on every writer after the boundary: each norm there ignores the scale of the
    whole stream (up to its eps, which deep in the stream, where its mean square is large, changes nothing)."""
    q = q.detach().double()
    family = architecture(model)
    refuse_fold(family, "folded")
    layers = decoder_layers(model)
    blocks = (family.attention, family.mlp)
    embed = model.get_input_embeddings()
    # Feeding layer 0, only the embeddings are upstream: the scale folds into them exactly (no norm to mind).
    upstream_scale = c if layer == 0 and not model.config.tie_word_embeddings else 1.0
    if not torch.equal(q, torch.eye(q.shape[0], dtype=q.dtype)) or upstream_scale != 1.0:
        _set_weight(embed, "weight", embed.weight.double() @ (upstream_scale * q).to(embed.weight.device))
        for decoder_layer in layers[:layer]:
            for block in blocks:
                readers, writers = _block_weights(block, block.module(decoder_layer), q.shape[0])
                _fold_norm_weight(decoder_layer.get_submodule(block.norm), readers, family.gain)
                for weight in readers + writers:
                    _map_stream(weight, q)
    if upstream_scale == 1.0:
        for decoder_layer in layers[layer:]:
            for block in blocks:
                for writer in _block_weights(block, block.module(decoder_layer), q.shape[0])[1]:
                    _map_stream(writer, torch.eye(q.shape[0], dtype=torch.float64) / c)


def to_stock_model(model: GhostedForCausalLM) -> PreTrainedModel:
    """The same network as a stock model of the base family (no remote code), when every operator is a scaled rotation
    c Q (the identity included, e.g. after `replaceme-ls`): each is folded into the weights with
    `fold_scaled_rotation`. Tied embeddings are untied when a rotation must be folded into them (the LM head
    keeps the original matrix). Shares the tensors it does not change with `model`."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    replaced = [f"{r['original_layer']}.{r['block']}" for r in model.config.ghost_subblocks]
    if replaced:
        raise GhostedError(f"A stock checkpoint cannot hold replaced sub-blocks ({', '.join(replaced)}: linear maps "
                           "where the family has attention or an MLP). Save it as a ghosted model (save_pretrained; "
                           "loads with trust_remote_code=True).")
    folds = []
    for boundary in model.config.ghost_boundaries:
        name = ghost_tensor_key(boundary, paths=decoder_paths(model.config))
        if boundary.get("normed"):
            raise GhostedError(
                f"The boundary before {name.rsplit('.', 2)[0]} has a normed term (operator kind "
                f"{boundary.get('operator')!r}): it has no place in a stock checkpoint, and export-stock cannot refit "
                "it. Prune the dense model with --operator folded (or folded-tied) for a stock checkpoint, run it in "
                "llama.cpp with `ghosted export-gguf`, or save it as a ghosted model."
            )
        operator = model.get_parameter(name)
        if torch.equal(operator, torch.eye(operator.shape[0], dtype=operator.dtype, device=operator.device)):
            continue
        found = scaled_rotation(operator)
        if found is None:
            raise GhostedError(
                f"{name} is not a scaled rotation c Q: it cannot be folded into a stock checkpoint. Fit one with "
                "`ghosted export-stock` (ghosted_hf.export_stock), prune with operator='folded', or save it as a "
                "ghosted model."
            )
        layer = boundary["layer"] if boundary["target"] == LAYER_TARGET else model.config.text_config.num_hidden_layers
        folds.append((layer, *found))
    eye = torch.eye(model.config.text_config.hidden_size, dtype=torch.float64)
    multimodal = is_multimodal(model.config)
    base = copy.deepcopy(model.config.base_config if multimodal else model.config.text_config)
    untie = base.tie_word_embeddings and any(not torch.equal(q, eye) for _, _, q in folds)
    if untie:
        base.tie_word_embeddings = False
    with torch.device("meta"):
        stock = (AutoModelForImageTextToText if multimodal else AutoModelForCausalLM).from_config(base)
    adopt_tensors(stock, model, lambda name: name)
    for layer, c, q in folds:
        fold_scaled_rotation(stock, layer, c, q)
    provenance = Provenance.of(model.config)
    if provenance.parameters is not None:
        provenance.parameters = {**provenance.parameters, "pruned": count_parameters(stock), "operators": 0}
    # How the checkpoint was made travels in its config.json (read by the model card and `ghosted inspect`).
    provenance.with_changes(stock_export={
        "original_num_hidden_layers": model.config.original_num_hidden_layers,
        "removed_layers": list(model.config.removed_layers),
        "boundaries": copy.deepcopy(model.config.ghost_boundaries),
        "folded_operators": len(folds), "untied_embeddings": bool(untie),
    }).save_to(stock.config)
    stock.generation_config = copy.deepcopy(model.generation_config)
    stock.train(model.training)
    return stock
