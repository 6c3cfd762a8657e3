"""The patched stream: a dense model run as if pruned and patched (removed layers left out, boundary operators and
replaced sub-blocks as the modules a ghosted model serves), without building it."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..architectures import LAYER_FIELDS, architecture, decoder, decoder_layers, final_norm, pruned_config
from ..errors import GhostedError
from ..remote.format_ghosted import GHOST_MODULE, kept_layers
from ..remote.modeling_ghosted import GhostOperator, SubBlockBypass, apply_ghost_operator


@dataclass(frozen=True)
class Patch:
    """The model pruned of `removed` (dense numbering) with each boundary's operator `operators[first removed
    layer]` applied to the stream it feeds (plus its normed term `normed[first removed layer]`), the MLP
    output of layer j multiplied by `transforms[j]` (the transforms that fold into the MLP's output weights), and
    sub-block `kind` of layer j replaced by the served module, a `SubBlockBypass` with the map and output count
    `subblocks[(j, kind)]` (a C x C map, or a rank-r map's factors (down, up))."""

    removed: tuple[int, ...] = ()
    operators: Mapping[int, torch.Tensor] = field(default_factory=dict)
    transforms: Mapping[int, torch.Tensor] = field(default_factory=dict)
    normed: Mapping[int, torch.Tensor] = field(default_factory=dict)
    subblocks: Mapping[tuple[int, str], tuple[torch.Tensor | tuple[torch.Tensor, ...], int]] = field(default_factory=dict)

    def fed(self, depth: int) -> dict[int, int]:
        """First removed layer of each boundary -> the index it feeds (depth: the final norm)."""
        removed = set(self.removed)
        return {i: next(end for end in itertools.count(i) if end not in removed)
                for i in sorted(removed) if i - 1 not in removed}

    def position(self, i: int) -> int:
        """Where dense index `i` (a kept layer's input, or the final norm's) sits in the pruned model."""
        if i in self.removed:
            raise GhostedError(f"Layer {i} is removed in this patch: its input is not part of the patched stream.")
        return i - sum(1 for r in self.removed if r < i)


def same_below(a: Patch, b: Patch, j: int) -> bool:
    """Whether patches `a` and `b` give the same stream into dense layer j: the same changes before it."""
    def below(patch: Patch) -> tuple:
        return ({i for i in patch.removed if i < j},
                *({k: v for k, v in changes.items() if k < j}
                  for changes in (patch.operators, patch.normed, patch.transforms)),
                {k: factors(v[0]) for k, v in patch.subblocks.items() if k[0] < j})

    def equal(x: torch.Tensor | tuple[torch.Tensor, ...], y: torch.Tensor | tuple[torch.Tensor, ...]) -> bool:
        x, y = factors(x), factors(y)
        return len(x) == len(y) and all(torch.equal(p, q) for p, q in zip(x, y))

    def same(x: Mapping, y: Mapping) -> bool:
        return x.keys() == y.keys() and all(equal(x[k], y[k]) for k in x)

    first, second = below(a), below(b)
    return first[0] == second[0] and all(same(x, y) for x, y in zip(first[1:], second[1:]))


def mlp_of(model: nn.Module, layer: nn.Module) -> nn.Module:
    """The MLP sub-block of a decoder layer of `model` (the architecture registry's name for it)."""
    return architecture(model).mlp.module(layer)


def subblock_slot(model: nn.Module, layer: int, kind: str) -> tuple[nn.Module, str]:
    """(decoder layer `layer` of `model`, the attribute that holds its sub-block `kind`), by the registry's names."""
    module = decoder_layers(model)[layer]
    return module, getattr(architecture(model), kind).attribute(module)


def factors(value: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """A sub-block's map as the tensors applied one after the other: (map,) or a rank-r map's (down, up)."""
    return tuple(value) if isinstance(value, tuple) else (value,)


def bypassed(model: nn.Module, subblocks: Mapping[tuple[int, str], tuple[torch.Tensor | tuple[torch.Tensor, ...], int]],
             ) -> contextlib.AbstractContextManager:
    """Within the context, sub-block `kind` of layer j is a `SubBlockBypass` (the module a ghosted model serves)
    applying the map of `subblocks[(j, kind)]` (in float32, as saved); the sub-blocks are put back on exit."""
    children = []
    for (j, kind), (value, outputs) in sorted(subblocks.items(), key=lambda item: item[0]):
        layer, name = subblock_slot(model, j, kind)
        tensors = factors(value)
        bypass = SubBlockBypass(tensors[0].shape[0], torch.float32, kind, j, outputs,
                                tensors[0].shape[1] if len(tensors) == 2 else None)
        device = next(getattr(layer, name).parameters()).device
        for parameter, tensor in zip(bypass.ghost.factors, tensors):
            parameter.data = tensor.to(device=device, dtype=torch.float32)
        children.append((layer, name, bypass))
    return replaced(children)


def apply_matrix(matrix: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x @ matrix, computed in the matrix's dtype (for hooks: an MLP transform, the skip reference's change)."""
    def apply(x: torch.Tensor) -> torch.Tensor:
        return (x.to(device=matrix.device, dtype=matrix.dtype) @ matrix).to(device=x.device, dtype=x.dtype)
    return apply


def input_hook(apply: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """A forward pre-hook (with kwargs) giving a module `apply` of the hidden state it reads."""
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (apply(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": apply(kwargs["hidden_states"])}
    return hook


def hidden_of(output: Any) -> Any:
    """The hidden state a module returned: its output, or the first of several."""
    return output[0] if isinstance(output, (tuple, list)) else output


def with_hidden(output: Any, hidden: torch.Tensor) -> Any:
    """`output` with its hidden state (itself, or the first of several outputs) replaced by `hidden`."""
    return type(output)([hidden, *output[1:]]) if isinstance(output, (tuple, list)) else hidden


def output_hook(apply: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """A forward hook giving `apply` of a module's output hidden state (the first of several outputs)."""
    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        return with_hidden(output, apply(hidden_of(output)))
    return hook


def served_operator(matrix: torch.Tensor, normed: torch.Tensor | None = None) -> GhostOperator:
    """The module a ghosted model serves at a boundary, holding `matrix` (and its normed term) in float32, as saved."""
    module = GhostOperator(matrix.shape[0], torch.float32, normed=normed is not None)
    module.operator.data = matrix.detach().float()
    if normed is not None:
        module.normed.data = normed.detach().float().to(module.operator.device)
    return module


@contextlib.contextmanager
def replaced(children: Iterable[tuple[nn.Module, str, nn.Module]]) -> Iterator[None]:
    """Within the context, each (parent, name, module): `module` is the child `name` of `parent` (a served module in
    place of what was there, or added); the former children (or their absence) come back on exit."""
    saved = []
    try:
        for parent, name, module in children:
            saved.append((parent, name, parent._modules.get(name)))
            setattr(parent, name, module)
        yield
    finally:
        for parent, name, original in reversed(saved):
            if original is None:
                delattr(parent, name)
            else:
                setattr(parent, name, original)


@contextlib.contextmanager
def patched_stream(model: nn.Module, patch: Patch) -> Iterator[None]:
    """Within the context, `model` computes the model pruned and patched by `patch`: the removed layers are
    left out of its layer list (and of its per-layer config), each boundary's operator is the served `GhostOperator`
    on what the boundary feeds, each replaced sub-block the served `SubBlockBypass`, each transform a hook on an MLP's
    output (the served model folds it into the weights). Everything is restored on exit."""
    inner, layers, norm = decoder(model), decoder_layers(model), final_norm(model)
    depth, config, leaf = len(layers), inner.config, architecture(model).layout.layers.rpartition(".")[2]
    kept = kept_layers(depth, patch.removed)
    # The per-layer config fields the decoder's forward reads by position (layer_types, ...), as pruning sets them.
    pruned = pruned_config(config, kept)
    # (per_layer_config reads back as a per-layer view and is set as the sparse dict config.json holds.)
    sparse = {"per_layer_config": config.to_dict().get("per_layer_config")}
    saved = {name: sparse[name] if name in sparse else getattr(config, name)
             for name in ("num_hidden_layers", *LAYER_FIELDS) if hasattr(config, name)
             and (name not in sparse or sparse[name] is not None)}
    handles, operators = [], []
    for first, fed in patch.fed(depth).items():
        if first in patch.operators:
            operators.append((layers[fed] if fed < depth else norm, GHOST_MODULE,
                              served_operator(patch.operators[first], patch.normed.get(first))))
    try:
        handles += [parent.register_forward_pre_hook(apply_ghost_operator, with_kwargs=True)
                    for parent, _, _ in operators]
        for j, matrix in patch.transforms.items():
            handles.append(mlp_of(model, layers[j]).register_forward_hook(output_hook(apply_matrix(matrix))))
        setattr(inner, leaf, nn.ModuleList([layers[i] for i in kept]))
        for name in saved:
            setattr(config, name, pruned.to_dict()[name] if name in sparse else getattr(pruned, name))
        with replaced(operators), bypassed(model, {(patch.position(j), kind): value
                                                   for (j, kind), value in patch.subblocks.items()}):
            yield
    finally:
        setattr(inner, leaf, layers)
        for name, value in saved.items():
            setattr(config, name, value)
        for handle in handles:
            handle.remove()
