"""Folds into the weights: an operator that is a scaled rotation c Q folded into a stock model of the base family
(`to_stock_model`), and ReplaceMe's transform folded into a kept layer's MLP writers."""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import PreTrainedModel

from ..architectures import (StreamWeight, SubBlock, architecture, check_declared, decoder_layers, is_multimodal,
                             layer_prefix, refuse_fold, stream_weights)
from ..errors import GhostedError
from ..remote.format_ghosted import LAYER_TARGET, decoder_paths, ghost_tensor_key, pruned_index
from ..remote.modeling_ghosted import GhostedForCausalLM
from .provenance import Provenance
from .surgery import adopt_tensors, count_parameters


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
