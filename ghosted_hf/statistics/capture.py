"""Hidden states out of one truncated forward pass (hooks that stop the model after the deepest state
needed), and the patched stream: the same model run as if pruned and patched, without building it."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import itertools
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..architectures import LAYER_FIELDS, architecture, decoder, decoder_layers, final_norm, pruned_config
from ..errors import GhostedError, NonFiniteError
from ..remote.format_ghosted import GHOST_MODULE
from ..remote.modeling_ghosted import GhostOperator, SubBlockBypass, apply_ghost_operator
from .declarations import LOSS_ROLE, SUBBLOCK_ROLES, token_loss


@dataclass(frozen=True)
class Patch:
    """The model pruned of `removed` (dense numbering) with each boundary's operator `operators[first removed
    layer]` applied to the stream it feeds (plus its normed term `normed[first removed layer]`), the MLP
    output of layer j multiplied by `transforms[j]` (the transforms that fold into the MLP's output weights), and
    sub-block `kind` of layer j replaced by the served module, a `SubBlockBypass` with the map and output count
    `subblocks[(j, kind)]`."""

    removed: tuple[int, ...] = ()
    operators: Mapping[int, torch.Tensor] = field(default_factory=dict)
    transforms: Mapping[int, torch.Tensor] = field(default_factory=dict)
    normed: Mapping[int, torch.Tensor] = field(default_factory=dict)
    subblocks: Mapping[tuple[int, str], tuple[torch.Tensor, int]] = field(default_factory=dict)

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
                {k: v[0] for k, v in patch.subblocks.items() if k[0] < j})

    def same(x: Mapping, y: Mapping) -> bool:
        return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)

    first, second = below(a), below(b)
    return first[0] == second[0] and all(same(x, y) for x, y in zip(first[1:], second[1:]))


class _Resumed(nn.Module):
    """Stands in for a decoder layer before the one a pass resumes at: passes the stream on, and the last of them
    returns `state`, the stored dense input of the layer resumed at (masks and positions stay the model's own)."""

    def __init__(self, state: torch.Tensor | None) -> None:
        super().__init__()
        self.state = state

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states if self.state is None else self.state.to(hidden_states.device)


@contextlib.contextmanager
def resumed(model: nn.Module, start: int, state: torch.Tensor | None) -> Iterator[None]:
    """Within the context, `model` skips its first `start` decoder layers and feeds layer `start` with `state`."""
    layers = decoder_layers(model)
    saved = [layers[j] for j in range(start)]
    try:
        for j in range(start):
            layers[j] = _Resumed(state if j == start - 1 else None)
        yield
    finally:
        for j, layer in enumerate(saved):
            layers[j] = layer


class _StopForward(Exception):
    """Raised by the hook on the deepest needed hidden state: the rest of the model is not run."""


def mlp_of(model: nn.Module, layer: nn.Module) -> nn.Module:
    """The MLP sub-block of a decoder layer of `model` (the architecture registry's name for it)."""
    return architecture(model).mlp.module(layer)


def subblock_slot(model: nn.Module, layer: int, kind: str) -> tuple[nn.Module, str]:
    """(decoder layer `layer` of `model`, the attribute that holds its sub-block `kind`), by the registry's names."""
    module = decoder_layers(model)[layer]
    return module, getattr(architecture(model), kind).attribute(module)


def bypassed(model: nn.Module, subblocks: Mapping[tuple[int, str], tuple[torch.Tensor, int]],
             ) -> contextlib.AbstractContextManager:
    """Within the context, sub-block `kind` of layer j is a `SubBlockBypass` (the module a ghosted model serves)
    applying the map of `subblocks[(j, kind)]` (in float32, as saved); the sub-blocks are put back on exit."""
    children = []
    for (j, kind), (matrix, outputs) in sorted(subblocks.items()):
        layer, name = subblock_slot(model, j, kind)
        bypass = SubBlockBypass(matrix.shape[0], torch.float32, kind, j, outputs)
        device = next(getattr(layer, name).parameters()).device
        bypass.ghost.operator.data = matrix.to(device=device, dtype=torch.float32)
        children.append((layer, name, bypass))
    return replaced(children)


def input_device(model: nn.Module) -> torch.device:
    """Where the model's inputs go (its embedding's device; the CPU for a meta skeleton)."""
    weight = model.get_input_embeddings().weight
    return torch.device("cpu") if weight.device.type == "meta" else weight.device


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


def output_hook(apply: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """A forward hook giving `apply` of a module's output hidden state (the first of several outputs)."""
    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        if isinstance(output, (tuple, list)):
            return type(output)([apply(output[0]), *output[1:]])
        return apply(output)
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
    kept = [i for i in range(depth) if i not in set(patch.removed)]
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


def subblock_place(read: tuple[str, int]) -> str:
    """Where a sub-block read sits, in words (for the non-finite error)."""
    role, j = read
    return f"the {role.removesuffix('_in').removesuffix('_out')} {'input' if role.endswith('_in') else 'output'} of layer {j}"


def watch_subblocks(model: nn.Module, reads: Iterable[tuple[str, int]],
                    record: Callable[[tuple[str, int], torch.Tensor], None],
                    outputs: dict[tuple[int, str], int] | None = None) -> list[Any]:
    """Hooks (their handles) that give `record(read, value)` what each sub-block read among `reads` sees: the hidden
    state a sub-block is given, or the first value it returns (the module at its slot now: a bypass if installed);
    `outputs[(layer, kind)]` is set to how many values it returned (0: a bare tensor)."""
    handles = []
    for role, j in sorted(r for r in reads if r[0] in SUBBLOCK_ROLES):
        kind, reading = role.removesuffix("_in").removesuffix("_out"), role.endswith("_in")
        module = getattr(*subblock_slot(model, j, kind))

        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any = None, read=(role, j), reading=reading,
                 kind=kind):
            value = (args[0] if args else kwargs["hidden_states"]) if reading else output
            if outputs is not None and not reading:
                outputs[(read[1], kind)] = len(output) if isinstance(output, (tuple, list)) else 0
            record(read, value[0] if isinstance(value, (tuple, list)) else value)
        register = module.register_forward_pre_hook if reading else module.register_forward_hook
        handles.append(register(hook, with_kwargs=True))
    return handles


def finite_rows(hidden: torch.Tensor, keep: torch.Tensor, where: str) -> torch.Tensor:
    """The kept tokens' rows (N, C) of a hidden state, refused where one is not finite, naming `where` it appears."""
    kept = hidden[keep.to(hidden.device)]
    if not torch.isfinite(kept).all():
        raise NonFiniteError(
            f"Non-finite activations (NaN/Inf) first appear at {where} on calibration data, in {hidden.dtype}. "
            "Load the model in float32 or bfloat16 (float16 overflows in many LLMs) and check its weights."
        )
    return kept


def capture_hidden_states(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    reads: set[tuple[str, int]],
    keep: torch.Tensor,
    device: torch.device,
) -> dict[tuple[str, int], torch.Tensor]:
    """Run `model` on `batch` as far as `reads` need; return the kept tokens (N, C) of each: ("input", i) the input
    of layer i (i == the layer count: the final norm's), (role, j) for a sub-block role of `declarations` what sub-block
    j reads or returns, ("loss", depth) each token's (next-token loss, has a next token). Every hidden state on the
    way is checked to be finite."""
    layers, norm = decoder_layers(model), final_norm(model)
    depth = len(layers)
    loss = any(role == LOSS_ROLE for role, _ in reads)
    deepest = depth if loss else max(i if role == "input" else i + 1 for role, i in reads)
    captured: dict[tuple[str, int], torch.Tensor] = {}

    def rows(hidden: torch.Tensor, where: str) -> torch.Tensor:
        return finite_rows(hidden, keep, where)

    def pre_hook(i: int):
        # On every layer up to the deepest, so that a NaN is reported where it first appears.
        where = ("the input of the final norm" if i == depth else f"the input of layer {i}") + (
            f" (the output of layer {i - 1})" if i else "")

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            kept = rows(args[0] if args else kwargs["hidden_states"], where)
            if ("input", i) in reads:
                captured[("input", i)] = kept.to(device)
            if i == deepest and not loss:
                raise _StopForward
        return hook

    def record(read: tuple[str, int], value: torch.Tensor) -> None:  # (Llama 4's MoE returns its tokens flattened)
        captured[read] = rows(value.reshape(*keep.shape, value.shape[-1]), subblock_place(read)).to(device)

    handles = []
    try:
        # Registered after any patch's hooks: what is captured is what the next module receives.
        for i in range(deepest + 1):
            handles.append((layers[i] if i < depth else norm).register_forward_pre_hook(pre_hook(i), with_kwargs=True))
        handles += watch_subblocks(model, reads, record)
        first = input_device(model)
        with torch.no_grad():
            try:
                output = model(**{k: v.to(first) for k, v in batch.items()}, use_cache=False)
            except _StopForward as stop:
                # The traceback's frames hold this batch's activations in reference cycles (the hook closures and
                # transformers' wrappers) that only the cyclic GC frees, seldom: free them now.
                traceback.clear_frames(stop.__traceback__)
                output = None
            if loss:
                captured[token_loss(depth)] = token_losses(output.logits, batch, keep).to(device)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def token_losses(logits: torch.Tensor, batch: Mapping[str, torch.Tensor], keep: torch.Tensor) -> torch.Tensor:
    """(N, 2) float64 for the kept tokens: (cross-entropy of the next token, 1) where the next token is real, else
    (0, 0); the mean loss is the first column's sum over the second's."""
    ids, mask = batch["input_ids"].to(logits.device), batch["attention_mask"].to(logits.device).bool()
    labeled = torch.zeros_like(mask)
    labeled[:, :-1] = mask[:, 1:] & mask[:, :-1]
    losses = torch.zeros(mask.shape, dtype=torch.float64, device=logits.device)
    losses[:, :-1] = torch.nn.functional.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten(),
                                                       reduction="none").view(ids.shape[0], -1)  # (float32, as logits)
    both = torch.stack([losses * labeled, labeled.double()], dim=-1)
    return both[keep.to(logits.device)]


try:
    _TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
except (OSError, AttributeError):  # not glibc
    _TRIM = None


def release_freed_memory() -> None:
    """Give the pages of freed blocks back to the OS (glibc). A batch's activations are freed between blocks
    that stay allocated, so without this the heap fragments and peak memory creeps up batch after batch."""
    if _TRIM is not None:
        _TRIM(0)
