"""Which layers to remove, scored from calibration statistics, as a registry of criteria.

Contiguous criteria score every candidate boundary of `num_layers` layers, from the one starting at
layer 0 (or at the operator kind's first removable layer) to the one ending at the last layer (whose
target is the input of the final norm): none is excluded. A criterion is one `Criterion` subclass
registered with `@register`; nothing outside its class compares its name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from .statistics import CalibrationStatistics, StatisticsPlan, least_squares, similarity
from .errors import GhostedError
from .operators import fit_figures, ghost_operator, operator_kind
from .registry import Registry


@dataclass(frozen=True)
class SelectionRequest:
    """What a criterion is asked to choose."""

    depth: int  # layers of the dense model
    num_layers: int  # how many to remove
    first: int = 0  # the lowest removable layer (set by the operator kind)
    ridge: float = 1e-6
    layers: tuple[int, ...] = ()  # explicit indices, for criteria that take them
    operator: str = "ghost"  # the operator kind that will recover the boundary


@dataclass
class Selection:
    """The layers a criterion chose, with the score of every candidate (recorded in the provenance)."""

    removed: list[int]
    criterion: str
    scores: dict[str, float]  # candidate name (see `candidate_name`) -> score
    better: str  # "higher", "lower" or "n/a"
    subblocks: list[str] = field(default_factory=list)  # replaced sub-blocks ("12.attention"), units 'subblock', 'mixed'

    def describe(self) -> dict[str, Any]:
        """The JSON form saved in the provenance."""
        return {"criterion": self.criterion, "removed": self.removed, "better": self.better, "scores": self.scores,
                **({"subblocks": self.subblocks} if self.subblocks else {})}


def candidate_name(s: int, e: int) -> str:
    """"12-19" for the candidate removing layers 12..19, "7" for a single layer."""
    return f"{s}" if e == s + 1 else f"{s}-{e - 1}"


def candidate_layers(name: str) -> list[int]:
    """The layers of a candidate name ("12-19", "7" or "4-7,12-15")."""
    layers = []
    for part in name.split(","):
        first, _, last = part.partition("-")
        layers.extend(range(int(first), int(last or first) + 1))
    return layers


def candidate_spans(depth: int, n: int, first: int = 0) -> list[tuple[int, int]]:
    """(s, e) for every contiguous span s..e-1 of n layers with s >= first; e == depth is the final norm's input."""
    return [(s, s + n) for s in range(first, depth - n + 1)]


def check_num_layers(num_layers: int, depth: int) -> None:
    """Refuse a number of layers to remove that leaves no layer or removes none."""
    if not 1 <= num_layers < depth:
        raise GhostedError(f"num_layers must be between 1 and {depth - 1} for a model with {depth} layers, got {num_layers}.")


class Criterion:
    """One way to choose the layers. Subclasses set the class attributes and implement `statistics`/`select`."""

    name: ClassVar[str]
    summary: ClassVar[str]
    takes_layers: ClassVar[bool] = False  # uses SelectionRequest.layers instead of statistics

    def statistics(self, request: SelectionRequest) -> StatisticsPlan:
        """What `select` reads from the dense model."""
        raise NotImplementedError

    def select(self, stats: CalibrationStatistics | None, request: SelectionRequest) -> Selection:
        """The removal this criterion chooses."""
        raise NotImplementedError


class ContiguousCriterion(Criterion):
    """Scores every candidate span of `num_layers` layers and removes the best one."""

    better: ClassVar[str]

    def score(self, stats: CalibrationStatistics, s: int, e: int, request: SelectionRequest) -> float:
        """The score of removing layers s..e-1."""
        raise NotImplementedError

    def spans(self, request: SelectionRequest) -> list[tuple[int, int]]:
        """Every span this criterion scores (and whose boundary it may choose)."""
        return candidate_spans(request.depth, request.num_layers, request.first)

    def select(self, stats: CalibrationStatistics | None, request: SelectionRequest) -> Selection:
        spans = self.spans(request)
        scores = {candidate_name(s, e): self.score(stats, s, e, request) for s, e in spans}
        sign = 1 if self.better == "higher" else -1
        best = max(spans, key=lambda span: sign * scores[candidate_name(*span)])
        return Selection(list(range(*best)), self.name, scores, self.better)


CRITERIA: Registry[Criterion] = Registry("criterion")
register = CRITERIA.register
criterion = CRITERIA.lookup


@register
class GhostAware(ContiguousCriterion):
    """Removes the span the ghost operator recovers best (the default)."""

    name = "ghost-aware"
    summary = ("span whose ghost-fitted residual ||X_s W - X_e||^2 / ||X_e||^2 is smallest (the normed kinds' own "
               "residual for them)")
    better = "lower"
    # Relative, not absolute: each layer reads the stream through RMSNorm, so what a boundary's error does
    # downstream depends on its size relative to the stream there, whatever the depth (the stream's norm grows
    # with depth, so absolute residuals of deep and shallow blocks do not compare).

    def statistics(self, request: SelectionRequest) -> StatisticsPlan:
        kind = operator_kind(request.operator)
        return StatisticsPlan.union(least_squares(s, e) | kind.selection_statistics(s, e) for s, e in self.spans(request))

    def score(self, stats: CalibrationStatistics, s: int, e: int, request: SelectionRequest) -> float:
        own = operator_kind(request.operator).selection_residual(stats, s, e, request.ridge)
        if own is not None:
            return own
        w, _, _ = ghost_operator(stats, s, e, request.ridge)
        return fit_figures(stats, s, e, w)["residual_vs_target"]


@register
class Streamline(ContiguousCriterion):
    """LLM-Streamline's criterion (a baseline)."""

    name = "streamline"
    summary = "highest mean cosine between the span's input and output (LLM-Streamline)"
    better = "higher"
    measure: ClassVar[str] = "mean_cosine"  # the CalibrationStatistics method that scores a span

    def statistics(self, request: SelectionRequest) -> StatisticsPlan:
        return StatisticsPlan.union(similarity(s, e) for s, e in self.spans(request))

    def score(self, stats: CalibrationStatistics, s: int, e: int, request: SelectionRequest) -> float:
        return getattr(stats, self.measure)(s, e)


@register
class Angular(Streamline):
    """The angular-distance criterion of Gromov et al. (a baseline)."""

    name = "angular"
    summary = "lowest mean angular distance arccos(cos)/pi over all real tokens (Gromov et al.)"
    better = "lower"
    measure = "mean_angular"


@register
class ShortGPT(Criterion):
    """ShortGPT's Block Influence, layer by layer (a baseline)."""

    name = "shortgpt"
    summary = "the num_layers layers, anywhere, of lowest Block Influence 1 - mean cos(x_i, x_i+1) (ShortGPT)"

    def statistics(self, request: SelectionRequest) -> StatisticsPlan:
        return StatisticsPlan.union(similarity(i, i + 1) for i in range(request.first, request.depth))

    def select(self, stats: CalibrationStatistics | None, request: SelectionRequest) -> Selection:
        layers = range(request.first, request.depth)
        scores = {candidate_name(i, i + 1): 1.0 - stats.mean_cosine(i, i + 1) for i in layers}
        ranked = sorted(layers, key=lambda i: (scores[candidate_name(i, i + 1)], i))
        return Selection(sorted(ranked[: request.num_layers]), self.name, scores, "lower")


@register
class Manual(Criterion):
    """The layers the user names."""

    name = "manual"
    summary = "the layer indices given with --layers"
    takes_layers = True

    def statistics(self, request: SelectionRequest) -> StatisticsPlan:
        return StatisticsPlan()

    def select(self, stats: CalibrationStatistics | None, request: SelectionRequest) -> Selection:
        return Selection(sorted(request.layers), self.name, {}, "n/a")
