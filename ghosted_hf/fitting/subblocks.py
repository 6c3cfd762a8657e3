"""Sub-blocks as the unit of removal: an attention or MLP sub-block replaced by a closed-form linear map of its input
(its norm's output), fitted in float64 on what it returned, sequentially down the network. A whole layer is one more
candidate (a map of the stream it read onto what it added), so whole layers and sub-blocks can be chosen together.

Selection is measured, not guessed: a candidate's damage is the rise of the calibration loss with it alone replaced by
its map fitted on the dense model; the cheapest damage per parameter saved goes first until the budget is met. The
fit's own residual ranks badly (the sub-block that writes the first token's massive activation fits best and harms
most: benchmarks/results/subblock_probe.md), so it is recorded but does not rank.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ..architectures import architecture, decoder_layers
from ..errors import GhostedError
from ..remote.format_ghosted import SUBBLOCK_KINDS
from ..remote.modeling_ghosted import SubBlockBypass
from .operators import ridge_epsilon

Batch = Mapping[str, torch.Tensor]
LAYER = "layer"  # a whole decoder layer as a candidate (saved as a removed layer and its boundary's operator)
CANDIDATE_KINDS = (*SUBBLOCK_KINDS, LAYER)  # a layer's own hooks run after its sub-blocks'


@dataclass(frozen=True)
class SubBlockRef:
    """A sub-block of the dense model (block "layer": the whole layer) by dense layer number; sorts in network order."""

    layer: int
    block: str  # "attention" or "mlp" (attention runs first in every family), or "layer"

    def __post_init__(self) -> None:
        if self.block not in CANDIDATE_KINDS:
            raise GhostedError(f"A sub-block is {' or '.join(SUBBLOCK_KINDS)}, got {self.block!r}.")

    @property
    def name(self) -> str:
        return f"{self.layer}.{self.block}"

    def __lt__(self, other: SubBlockRef) -> bool:  # network order: a layer's attention before its MLP
        return (self.layer, CANDIDATE_KINDS.index(self.block)) < (other.layer, CANDIDATE_KINDS.index(other.block))


def parse_subblock(text: str, kinds: tuple[str, ...] = SUBBLOCK_KINDS) -> SubBlockRef:
    """"12.attention" or "12.mlp" (dense numbering; "12.layer" too where `kinds` has it, as in recorded scores)."""
    match = re.fullmatch(r"\s*(\d+)\.(\w+)\s*", str(text))
    if match is None or match.group(2) not in kinds:
        raise GhostedError(f"A sub-block is written LAYER.KIND with KIND one of {', '.join(kinds)} (e.g. "
                           f"12.attention), got {text!r}.")
    return SubBlockRef(int(match.group(1)), match.group(2))


def validate_subblocks(names: Iterable[str], depth: int, layers: Iterable[int] = ()) -> list[SubBlockRef]:
    """Sorted sub-blocks (and whole `layers`), or a GhostedError that says what is wrong with them."""
    refs = [parse_subblock(n) for n in names] + [SubBlockRef(int(i), LAYER) for i in layers]
    outside = [r.name for r in refs if not 0 <= r.layer < depth]
    if outside:
        raise GhostedError(f"Sub-blocks {outside} are out of range: the model has layers 0..{depth - 1}.")
    if len(set(refs)) != len(refs):
        raise GhostedError(f"Sub-blocks {sorted({r.name for r in refs if refs.count(r) > 1})} are listed more than once.")
    whole = {r.layer for r in refs if r.block == LAYER}
    inside = sorted(r.name for r in refs if r.block != LAYER and r.layer in whole)
    if inside:
        raise GhostedError(f"Sub-blocks {inside} belong to layers that are removed whole: list the layer or its "
                           "sub-blocks, not both.")
    if not refs:
        raise GhostedError("No sub-block to replace: pass at least one (e.g. 12.attention).")
    if len({r.layer for r in refs if r.block in ("attention", LAYER)}) == depth and len(whole) < depth:
        raise GhostedError("Replacing the attention of every layer leaves no token mixing (each position would be "
                           "computed from itself alone): keep at least one attention sub-block.")
    return sorted(refs)


def slot(model: nn.Module, ref: SubBlockRef) -> tuple[nn.Module, str]:
    """(the decoder layer, the attribute that holds the sub-block), by the architecture registry's names; for a whole
    layer, (the layer list, its index)."""
    if ref.block == LAYER:
        return decoder_layers(model), str(ref.layer)
    layer = decoder_layers(model)[ref.layer]
    return layer, getattr(architecture(model), ref.block).attribute(layer)


def subblock_parameters(model: nn.Module, ref: SubBlockRef) -> int:
    """Parameters of one sub-block (what replacing it removes, before its map is added)."""
    return sum(p.numel() for p in getattr(*slot(model, ref)).parameters())


def all_subblocks(depth: int, whole_layers: bool = False) -> list[SubBlockRef]:
    """Every candidate of a model of `depth` layers (whole layers among them with `whole_layers`), in network order."""
    kinds = CANDIDATE_KINDS if whole_layers else SUBBLOCK_KINDS
    return sorted(SubBlockRef(i, kind) for i in range(depth) for kind in kinds)


@dataclass
class Sums:
    """Float64 sums over the calibration tokens of one sub-block: h^T h, h^T y and ||y||^2 for its input h and output
    y, and how many values the module returned (0: a bare tensor)."""

    gram: torch.Tensor | None = None
    cross: torch.Tensor | None = None
    energy: float = 0.0
    tokens: int = 0
    outputs: int = 0

    def add(self, h: torch.Tensor, y: torch.Tensor) -> None:
        h, y = h.double(), y.double()
        gram, cross = h.T @ h, h.T @ y
        self.gram = gram if self.gram is None else self.gram + gram
        self.cross = cross if self.cross is None else self.cross + cross
        self.energy += float((y * y).sum())
        self.tokens += h.shape[0]


class _Stop(Exception):
    """Raised once a pass has what it needs: the rest of the model is not run."""


def _input(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


class _Resume(nn.Module):
    """Stands in for a decoder layer before the one a pass resumes at: passes the stream through, and the last of them
    returns the stored input of the resumed layer (the embeddings, masks and positions are still the model's own)."""

    def __init__(self, state: torch.Tensor | None) -> None:
        super().__init__()
        self.state = state

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states if self.state is None else self.state.to(hidden_states.device)


def _run(model: nn.Module, batch: Batch, start: int, state: torch.Tensor | None) -> Any:
    """One forward of `batch` started at decoder layer `start` from `state` (its input, as stored by `layer_inputs`), so
    a pass over a deep sub-block does not rerun the layers before it; None where a hook stopped it."""
    device = model.get_input_embeddings().weight.device
    layers = decoder_layers(model)
    saved = [layers[j] for j in range(start)]
    try:
        for j in range(start):
            layers[j] = _Resume(state if j == start - 1 else None)
        with torch.no_grad():
            return model(**{k: v.to(device) for k, v in batch.items()}, use_cache=False)
    except _Stop:
        return None
    finally:
        for j, layer in enumerate(saved):
            layers[j] = layer


def layer_inputs(model: nn.Module, batches: list[Batch], layers: Iterable[int], start: int = 0,
                 states: list[torch.Tensor | None] | None = None) -> dict[int, list[torch.Tensor]]:
    """{layer: its input for every batch} on `model` as it is, from one pass resumed at `start` (from `states`)."""
    layers = sorted(set(layers))
    found: dict[int, list[torch.Tensor]] = {i: [] for i in layers}

    def keep(i: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            found[i].append(_input(args, kwargs).detach())
            if i == layers[-1]:
                raise _Stop
        return hook

    handles = [decoder_layers(model)[i].register_forward_pre_hook(keep(i), with_kwargs=True) for i in layers]
    try:
        for b, batch in enumerate(batches):
            _run(model, batch, start, None if states is None else states[b])
    finally:
        for handle in handles:
            handle.remove()
    return found


def collect(model: nn.Module, batches: Iterable[Batch], refs: Iterable[SubBlockRef], what: str, start: int = 0,
            states: list[torch.Tensor | None] | None = None) -> dict[SubBlockRef, Sums]:
    """The sums of every sub-block `refs` over the real (unpadded) tokens of `batches`, on `model` as it is (with the
    replacements installed so far: the sequential fit's patched stream), resumed at layer `start` from `states`."""
    refs = sorted(refs)
    sums = {ref: Sums() for ref in refs}
    keep: list[torch.Tensor] = []

    def hook(ref: SubBlockRef):
        def record(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            h, y = _input(args, kwargs), output[0] if isinstance(output, tuple) else output
            if ref.block == LAYER:  # what the layer added to the residual stream
                y = y - h
            rows = keep[0].to(h.device)
            sums[ref].add(h.reshape(-1, h.shape[-1])[rows], y.reshape(-1, y.shape[-1])[rows])
            sums[ref].outputs = len(output) if isinstance(output, tuple) else 0
            if ref == refs[-1]:
                raise _Stop
        return record

    hooks = [getattr(*slot(model, ref)).register_forward_hook(hook(ref), with_kwargs=True) for ref in refs]
    try:
        for b, batch in enumerate(tqdm(list(batches), desc=what, leave=False)):
            keep[:] = [batch["attention_mask"].flatten().bool()]
            _run(model, batch, start, None if states is None else states[b])
    finally:
        for handle in hooks:
            handle.remove()
    for ref, total in sums.items():
        if total.gram is None or not torch.isfinite(total.gram).all() or not torch.isfinite(total.cross).all():
            raise GhostedError(f"The {ref.block} of layer {ref.layer} gave NaN or Inf activations on the calibration "
                               "text (or was never run): load the model in float32 or check its weights.")
    return sums


@dataclass
class SubBlockFit:
    """A sub-block's map A (float64, C x C: y ~ h @ A) and the figures recorded in config.json."""

    ref: SubBlockRef
    map: torch.Tensor
    outputs: int
    figures: dict[str, Any] = field(default_factory=dict)


def fit_map(ref: SubBlockRef, sums: Sums, ridge: float) -> SubBlockFit:
    """Ridge least squares h @ A ~ y in float64 (eps relative to the mean diagonal of h^T h, as every fit here)."""
    gram = sums.gram
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    a = torch.linalg.solve(gram + ridge_epsilon(gram, ridge) * eye, sums.cross)
    residual = float(((gram @ a) * a).sum() - 2 * (a * sums.cross).sum()) + sums.energy
    relative = max(residual, 0.0) / sums.energy if sums.energy > 0 else 0.0
    return SubBlockFit(ref, a, sums.outputs, {"relative_residual": round(relative, 6), "tokens": sums.tokens})


@contextmanager
def replaced(model: nn.Module, fits: Iterable[SubBlockFit]) -> Iterator[None]:
    """Within the context, each fitted sub-block of `model` is its map (the modules are put back after)."""
    saved = []
    try:
        for fit in fits:
            install(model, fit)
            saved.append(fit)
        yield
    finally:
        for fit in saved:
            layer, name = slot(model, fit.ref)
            setattr(layer, name, getattr(layer, name).original)


class _LayerMap(nn.Module):
    """A whole layer while it is fitted and scored: the stream plus the map of it (h + h A); the saved model removes
    the layer and applies I + A (with the rest of its run) at the boundary instead."""

    def __init__(self, operator: torch.Tensor) -> None:
        super().__init__()
        self.operator = nn.Parameter(operator, requires_grad=False)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states + hidden_states @ self.operator.to(hidden_states.dtype)


def install(model: nn.Module, fit: SubBlockFit) -> None:
    """Put `fit`'s map in its sub-block's place in `model` (the module is kept as `.original` for `replaced`)."""
    layer, name = slot(model, fit.ref)
    original = getattr(layer, name)
    value = fit.map.to(device=next(original.parameters()).device, dtype=torch.float32)
    if fit.ref.block == LAYER:
        bypass = _LayerMap(value)
    else:
        bypass = SubBlockBypass(fit.map.shape[0], torch.float32, fit.ref.block, fit.ref.layer, fit.outputs)
        bypass.ghost.operator.data = value
    object.__setattr__(bypass, "original", original)  # not a child: its weights stay out of the bypass
    setattr(layer, name, bypass)


def calibration_loss(model: nn.Module, batches: list[Batch], start: int = 0,
                     states: list[torch.Tensor] | None = None) -> float:
    """Mean next-token cross-entropy over the real tokens of `batches` (resumed at layer `start` from `states`)."""
    total, count = 0.0, 0
    for b, batch in enumerate(batches):
        logits = _run(model, batch, start, None if states is None else states[b]).logits[:, :-1].float()
        ids, mask = batch["input_ids"].to(logits.device), batch["attention_mask"].to(logits.device)
        labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        total, count = total + float(loss), count + int((labels != -100).sum())
    return total / count


def damages(model: nn.Module, batches: list[Batch], fits: Mapping[SubBlockRef, SubBlockFit]) -> dict[SubBlockRef, float]:
    """The calibration loss's rise with each sub-block alone replaced by its map (what the replacement does downstream,
    measured rather than predicted from the fit's residual). Each pass starts at the sub-block's layer, from the dense
    model's stored input there."""
    inputs = layer_inputs(model, batches, {ref.layer for ref in fits})
    dense = calibration_loss(model, batches)
    result = {}
    for ref, fit in tqdm(sorted(fits.items()), desc="damage of each replacement", leave=False):
        with replaced(model, [fit]):
            result[ref] = calibration_loss(model, batches, ref.layer, inputs[ref.layer]) - dense
    return result


def choose_to_budget(damage: Mapping[SubBlockRef, float], saved: Mapping[SubBlockRef, int], budget: int) -> list[SubBlockRef]:
    """The sub-blocks that remove at least `budget` parameters (net of their maps) with the least damage per parameter
    saved, cheapest first; a whole layer and its own sub-blocks exclude each other."""
    order = sorted((ref for ref in damage if saved[ref] > 0), key=lambda ref: (max(damage[ref], 0.0) / saved[ref], ref))
    chosen, total, taken = [], 0, {}  # taken: layer -> a block chosen there
    for ref in order:
        if total >= budget:
            break
        if ref.layer in taken and LAYER in (ref.block, taken[ref.layer]):
            continue
        taken[ref.layer] = ref.block
        chosen.append(ref)
        total += saved[ref]
    if total < budget:
        raise GhostedError(f"Replacing every sub-block whose map is smaller than it saves {total:,} parameters, short of "
                           f"the {budget:,} asked for: ask for less, or remove whole layers (unit 'layer').")
    return sorted(chosen)


def fit_sequentially(model: nn.Module, batches: list[Batch], refs: list[SubBlockRef], ridge: float) -> list[SubBlockFit]:
    """Fit each sub-block down the network on the model with the ones before it already replaced, and leave them all
    installed in `model` (consumed: it becomes the model the ghosted one is built from). The stream is stepped from
    one replaced layer's input to the next, so the passes cost about one forward plus one layer per sub-block."""
    fits: list[SubBlockFit] = []
    start, states = 0, None
    for k, ref in enumerate(sorted(refs)):
        if ref.layer != start:
            states, start = layer_inputs(model, batches, [ref.layer], start, states)[ref.layer], ref.layer
        sums = collect(model, batches, [ref], f"fitting {ref.name} ({k + 1}/{len(refs)})", start, states)[ref]
        fit = fit_map(ref, sums, ridge)
        fit.figures["fitted_on"] = "dense model" if k == 0 else "model with the sub-blocks before it replaced"
        install(model, fit)
        fits.append(fit)
    return fits


def layer_operators(fits: Iterable[SubBlockFit]) -> dict[int, torch.Tensor]:
    """{first layer of a run of consecutive whole layers: its boundary's operator} from the layers' fitted maps: the
    product of their (I + A) in network order, which is what the fitted model applied to the stream (x @ W)."""
    runs: dict[int, torch.Tensor] = {}
    first = last = None
    for fit in sorted((f for f in fits if f.ref.block == LAYER), key=lambda f: f.ref):
        step = torch.eye(fit.map.shape[0], dtype=torch.float64) + fit.map.double().cpu()
        first = first if last is not None and fit.ref.layer == last + 1 else fit.ref.layer
        runs[first] = runs[first] @ step if first in runs else step
        last = fit.ref.layer
    return runs
