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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ..architectures import decoder_layers
from ..errors import GhostedError
from ..remote.format_ghosted import SUBBLOCK_KINDS, expected_boundaries
from ..statistics import (LABELS, LOSS, SUBBLOCK_SUMS, CalibrationStatistics, Calibrator, Patch, StatisticsPlan,
                          least_squares, next_token_loss, subblock_terms)
from ..statistics.patch import factors, subblock_slot
from .operators import energy_rank, map_spectrum, operator_kind, rank_factors, ridge_solve, share_left, squared_residual

Batch = Mapping[str, torch.Tensor]
LAYER = "layer"  # a whole decoder layer as a candidate (saved as a removed layer and its boundary's operator)
CANDIDATE_KINDS = (*SUBBLOCK_KINDS, LAYER)  # a layer's own hooks run after its sub-blocks'
# A map of rank 'auto' keeps this share of the output energy its full map explains. Set where a map's quality
# saturates: on SmolLM2 maps keeping 99% matched the full maps' perplexity, 95% lost 5% (subblock_ranks.md).
AUTO_RANK_ENERGY = 0.99
MapRank = str | int  # "full", "auto" or a rank r


def parse_map_rank(value: MapRank) -> MapRank:
    """"full", "auto" or a positive rank (given as an int or its text), or a GhostedError saying what is accepted."""
    text = str(value).strip()
    if text in ("full", "auto"):
        return text
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise GhostedError(f"map_rank is 'full' (C x C maps), 'auto' (per sub-block, the smallest rank keeping "
                       f"{AUTO_RANK_ENERGY:.0%} of what its full map explains) or a positive rank such as 64, got {value!r}.")


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
    return (decoder_layers(model), str(ref.layer)) if ref.block == LAYER else subblock_slot(model, ref.layer, ref.block)


def subblock_parameters(model: nn.Module, ref: SubBlockRef) -> int:
    """Parameters of one sub-block (what replacing it removes, before its map is added)."""
    return sum(p.numel() for p in getattr(*slot(model, ref)).parameters())


def all_subblocks(depth: int, whole_layers: bool = False) -> list[SubBlockRef]:
    """Every candidate of a model of `depth` layers (whole layers among them with `whole_layers`), in network order."""
    kinds = CANDIDATE_KINDS if whole_layers else SUBBLOCK_KINDS
    return sorted(SubBlockRef(i, kind) for i in range(depth) for kind in kinds)


@dataclass
class SubBlockFit:
    """A candidate's fit: for a sub-block its map A (float64, C x C: y ~ h @ A, or a rank-r map's factors (down, up))
    and how many values the sub-block returns, for a whole layer (or a run of them, `end` the layer its boundary
    feeds) its boundary's operator W; and the figures recorded in config.json."""

    ref: SubBlockRef
    map: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    outputs: int = 0
    figures: dict[str, Any] = field(default_factory=dict)
    end: int | None = None

    def __post_init__(self) -> None:
        if self.end is None:
            self.end = self.ref.layer + 1

    @property
    def rank(self) -> int | None:
        """The map's rank where it is stored as factors (None: a full map)."""
        return self.map[0].shape[1] if len(factors(self.map)) == 2 else None

    @property
    def parameters(self) -> int:
        """What the map adds to the model."""
        return sum(t.numel() for t in factors(self.map))


def candidate_statistics(ref: SubBlockRef, end: int | None = None) -> StatisticsPlan:
    """What a candidate's fit reads: a sub-block's own input and output sums, a whole layer's (or a run's, to `end`)
    boundary sums, as the Ghost kind fits a boundary."""
    if ref.block == LAYER:
        return least_squares(ref.layer, end if end is not None else ref.layer + 1)
    return subblock_terms(ref.block, ref.layer)


def fit_candidate(stats: CalibrationStatistics, ref: SubBlockRef, ridge: float, outputs: int = 0,
                  end: int | None = None, rank: MapRank = "full") -> SubBlockFit:
    """A sub-block's ridge least-squares map h @ A ~ y (of `rank`: its best map of that rank, stored as two factors
    where they hold fewer values than the full map), or a whole layer's (a run's) boundary operator by the Ghost
    kind: the operators module's solvers, with its residual figures."""
    if ref.block == LAYER:
        boundary = operator_kind("ghost").fit(stats, ref.layer, end or ref.layer + 1, ridge)
        return SubBlockFit(ref, boundary.operator, 0, boundary.figures, end)
    gram, cross, energy = (stats[statistic(ref.layer)] for statistic in SUBBLOCK_SUMS[ref.block])
    figures = {}
    if rank == "full":
        a, _ = ridge_solve(gram, cross, ridge)
    else:
        a, energies, directions = map_spectrum(gram, cross, ridge)
        r = energy_rank(energies, AUTO_RANK_ENERGY) if rank == "auto" else int(rank)
        if 2 * r < gram.shape[0]:  # fewer values than the full map: (down, up)
            a = rank_factors(a, directions, r)
            figures["energy_kept"] = round(float(energies[:r].sum() / energies.sum().clamp_min(1e-300)), 6)
    applied = a[0] @ a[1] if isinstance(a, tuple) else a
    relative = share_left(squared_residual(gram, cross, float(energy), applied), float(energy))
    return SubBlockFit(ref, a, outputs, {"relative_residual": round(relative, 6), **figures, "tokens": stats.tokens})


def patch_of(fits: Iterable[SubBlockFit]) -> Patch:
    """The model with `fits` in place: whole layers removed with their boundary's operator, sub-blocks replaced. Whole
    layers fitted apart that touch (candidates picked one by one) make one boundary whose operator is their product
    (each maps the stream it was given: x @ W1 @ W2)."""
    runs: list[tuple[int, int, torch.Tensor]] = []  # (first layer, the layer it feeds, operator)
    for f in sorted((f for f in fits if f.ref.block == LAYER), key=lambda f: f.ref.layer):
        if runs and runs[-1][1] == f.ref.layer:
            first, _, operator = runs.pop()
            runs.append((first, f.end, operator @ f.map.float()))
        else:
            runs.append((f.ref.layer, f.end, f.map.float()))
    return Patch(tuple(i for first, end, _ in runs for i in range(first, end)),
                 operators={first: operator for first, _, operator in runs},
                 subblocks={(f.ref.layer, f.ref.block): (f.map, f.outputs) for f in fits if f.ref.block != LAYER})


def _outputs(calibrator: Calibrator, refs: Iterable[SubBlockRef]) -> dict[SubBlockRef, int]:
    """How many values each sub-block among `refs` returns (a whole layer: 0)."""
    counts = calibrator.subblock_outputs((r.layer, r.block) for r in refs if r.block != LAYER)
    return {ref: counts.get((ref.layer, ref.block), 0) for ref in refs}


def candidate_fits(calibrator: Calibrator, candidates: list[SubBlockRef], ridge: float,
                   rank: MapRank = "full") -> dict[SubBlockRef, SubBlockFit]:
    """Every candidate fitted on the dense model (each sub-block's map of `rank`), from one pass for all their
    statistics."""
    plan = StatisticsPlan.union(candidate_statistics(ref) for ref in candidates)
    stats = calibrator.ensure(plan, "statistics of every candidate")
    outputs = _outputs(calibrator, candidates)
    return {ref: fit_candidate(stats, ref, ridge, outputs[ref], rank=rank) for ref in candidates}


def mean_loss(stats: CalibrationStatistics, depth: int) -> float:
    """The mean next-token loss of a `next_token_loss(depth)` pass."""
    return float(stats[LOSS(depth)]) / float(stats[LABELS(depth)])


def damages(calibrator: Calibrator, fits: Mapping[SubBlockRef, SubBlockFit],
            picked: Sequence[SubBlockFit] = ()) -> dict[SubBlockRef, float]:
    """The calibration loss's rise with each candidate replaced by its fit, alone or beside the `picked` ones (over the
    loss with those alone): what the replacement does downstream, measured rather than predicted from the fit's
    residual. One patched pass per candidate, started at the candidate, whose sums every process all-reduces."""
    depth, base = calibrator.depth, patch_of(picked) if picked else None
    plan, first = next_token_loss(depth), len(calibrator.passes)
    what = f"loss with {len(picked)} picked" if picked else "loss of the dense model"
    reference = mean_loss(calibrator.collect(plan, what, base), depth)
    with calibrator.calibration_pass.remembering_inputs(calibrator.my_batches(), base):
        result = {ref: mean_loss(calibrator.collect(plan, f"damage of {ref.name}", patch_of([*picked, fit])), depth)
                  - reference for ref, fit in tqdm(sorted(fits.items()), desc="damage of each replacement", leave=False)}
    calibrator.merge_passes(first, "damage of each replacement")
    return result


def compatible(ref: SubBlockRef, chosen: Iterable[SubBlockRef]) -> bool:
    """Whether `ref` may join `chosen`: not in it, and a whole layer and its own sub-blocks exclude each other."""
    return all(ref != c and not (ref.layer == c.layer and LAYER in (ref.block, c.block)) for c in chosen)


def choose_to_budget(damage: Mapping[SubBlockRef, float], saved: Mapping[SubBlockRef, int], budget: int,
                     what: str = "parameters", chosen: Sequence[SubBlockRef] = ()) -> list[SubBlockRef]:
    """The sub-blocks that remove at least `budget` parameters (net of their maps; or of `what` they save, such as
    KV-cache values) with the least damage per unit saved, cheapest first, beside the ones `chosen` already."""
    order = sorted((ref for ref in damage if saved[ref] > 0), key=lambda ref: (max(damage[ref], 0.0) / saved[ref], ref))
    picks, total = [], 0
    for ref in order:
        if total >= budget:
            break
        if compatible(ref, [*chosen, *picks]):
            picks.append(ref)
            total += saved[ref]
    if total < budget:
        before = sum(saved[c] for c in chosen)
        raise GhostedError(f"Replacing every sub-block that saves any saves {before + total:,} {what}, short of the "
                           f"{before + budget:,} asked for: ask for less, or remove whole layers (unit 'layer').")
    return sorted(picks)


def choose_jointly(calibrator: Calibrator, fits: Mapping[SubBlockRef, SubBlockFit], saved: Mapping[SubBlockRef, int],
                   budget: int, rounds: int = 1, what: str = "parameters",
                   alone: Mapping[SubBlockRef, float] | None = None,
                   ) -> tuple[list[SubBlockRef], dict[SubBlockRef, float]]:
    """(the chosen sub-blocks, each candidate's damage as last measured): the budget met in `rounds` equal steps, each
    step's damages measured with the picks of the steps before it in place, so that what is replaced together is
    judged together (one round: each candidate alone on the dense model; `alone`: those damages, measured already)."""
    chosen: list[SubBlockRef] = []
    damage: dict[SubBlockRef, float] = {}
    for k in range(1, rounds + 1):
        step = -(-budget * k // rounds) - sum(saved[ref] for ref in chosen)  # (earlier picks may have met it)
        if step <= 0:
            continue
        left = {ref: fit for ref, fit in fits.items() if compatible(ref, chosen)}
        measured = alone if k == 1 and alone is not None else None
        damage.update(measured or damages(calibrator, left, [fits[ref] for ref in chosen]))
        chosen += choose_to_budget({ref: damage[ref] for ref in left}, saved, step, what, chosen)
    return sorted(chosen), damage


def sequential_steps(depth: int, refs: list[SubBlockRef]) -> list[tuple[SubBlockRef, int]]:
    """(candidate, the layer its fit's output feeds) in network order: each sub-block, and each run of whole layers as
    one boundary (its first layer, the next kept layer)."""
    whole = [r.layer for r in refs if r.block == LAYER]
    return sorted([(r, r.layer + 1) for r in refs if r.block != LAYER]
                  + [(SubBlockRef(b["removed"][0], LAYER), b["removed"][-1] + 1) for b in expected_boundaries(depth, whole)])


def fit_sequentially(calibrator: Calibrator, refs: list[SubBlockRef], ridge: float,
                     rank: MapRank | Mapping[SubBlockRef, MapRank] = "full") -> list[SubBlockFit]:
    """Fit each chosen sub-block (each run of whole layers, as one boundary) down the network on the model with the ones
    before it in place (`Patch`): a sub-block maps what it reads to what it returns there, a boundary maps the patched
    stream onto the dense model's, as the Ghost kind fits sequentially. The first is fitted on the dense model (from the
    statistics at hand where they hold it: the candidates' or precomputed ones). Each map has `rank` (per sub-block
    where it is a mapping: the ranks the choice priced)."""
    fits: list[SubBlockFit] = []
    steps = sequential_steps(calibrator.depth, refs)
    for k, (ref, end) in enumerate(steps):
        plan, purpose = candidate_statistics(ref, end), f"sequential fit {k + 1}/{len(steps)}"
        at_hand = k == 0 and not calibrator.missing(plan)  # (else a pass, which keeps where the next one starts)
        stats = calibrator.statistics if at_hand else calibrator.collect(plan, purpose, patch_of(fits))
        fits.append(fit_candidate(stats, ref, ridge, _outputs(calibrator, [ref])[ref], end,
                                  rank.get(ref, "full") if isinstance(rank, Mapping) else rank))
        fits[-1].figures["fitted_on"] = "dense model" if k == 0 else "model with the ones before it replaced"
    return fits
