"""Which layers to remove, scored from calibration statistics, as a registry of criteria.

Contiguous criteria score every candidate boundary of `num_layers` layers, from the one starting at
layer 0 (or at the operator kind's first removable layer) to the one ending at the last layer (whose
target is the input of the final norm): none is excluded. A criterion is one `Criterion` subclass
registered with `@register`; nothing outside its class compares its name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from .calibration import CalibrationStatistics, StatisticsPlan
from .errors import GhostedError
from .operators import fit_figures, ghost_operator
from .registry import Registry


@dataclass(frozen=True)
class SelectionRequest:
    """What a criterion is asked to choose."""

    depth: int  # layers of the dense model
    num_layers: int  # how many to remove
    first: int = 0  # the lowest removable layer (set by the operator kind)
    ridge: float = 1e-6
    layers: tuple[int, ...] = ()  # explicit indices, for criteria that take them


@dataclass
class Selection:
    removed: list[int]
    criterion: str
    scores: dict[str, float]  # candidate name (see `candidate_name`) -> score
    better: str  # "higher", "lower" or "n/a"

    def describe(self) -> dict[str, Any]:
        return {"criterion": self.criterion, "removed": self.removed, "better": self.better, "scores": self.scores}


def candidate_name(s: int, e: int) -> str:
    """"12-19" for the candidate removing layers 12..19, "7" for a single layer."""
    return f"{s}" if e == s + 1 else f"{s}-{e - 1}"


def candidate_layers(name: str) -> list[int]:
    first, _, last = name.partition("-")
    return list(range(int(first), int(last or first) + 1))


def candidate_spans(depth: int, n: int, first: int = 0) -> list[tuple[int, int]]:
    """(s, e) for every contiguous span s..e-1 of n layers with s >= first; e == depth is the final norm's input."""
    return [(s, s + n) for s in range(first, depth - n + 1)]


def check_num_layers(num_layers: int, depth: int) -> None:
    if not 1 <= num_layers < depth:
        raise GhostedError(f"num_layers must be between 1 and {depth - 1} for a model with {depth} layers, got {num_layers}.")


class Criterion:
    """One way to choose the layers. Subclasses set the class attributes and implement `statistics`/`select`."""

    name: ClassVar[str]
    summary: ClassVar[str]
    takes_layers: ClassVar[bool] = False  # uses SelectionRequest.layers instead of statistics

    def statistics(self, request: SelectionRequest) -> StatisticsPlan:
        raise NotImplementedError

    def select(self, stats: CalibrationStatistics | None, request: SelectionRequest) -> Selection:
        raise NotImplementedError


class ContiguousCriterion(Criterion):
    """Scores every candidate span of `num_layers` layers and removes the best one."""

    better: ClassVar[str]

    def score(self, stats: CalibrationStatistics, s: int, e: int, request: SelectionRequest) -> float:
        raise NotImplementedError

    def select(self, stats: CalibrationStatistics | None, request: SelectionRequest) -> Selection:
        spans = candidate_spans(request.depth, request.num_layers, request.first)
        scores = {candidate_name(s, e): self.score(stats, s, e, request) for s, e in spans}
        sign = 1 if self.better == "higher" else -1
        best = max(spans, key=lambda span: sign * scores[candidate_name(*span)])
        return Selection(list(range(*best)), self.name, scores, self.better)


CRITERIA: Registry[Criterion] = Registry("criterion")
register = CRITERIA.register
criterion = CRITERIA.lookup


@register
class GhostAware(ContiguousCriterion):
    name = "ghost-aware"
    summary = "span whose ghost-fitted residual ||X_s W - X_e||^2 / ||X_e||^2 is smallest"
    better = "lower"

    def statistics(self, request: SelectionRequest) -> StatisticsPlan:
        spans = frozenset(candidate_spans(request.depth, request.num_layers, request.first))
        return StatisticsPlan(grams=frozenset(s for s, _ in spans), pairs=spans)

    def score(self, stats: CalibrationStatistics, s: int, e: int, request: SelectionRequest) -> float:
        w, _, _ = ghost_operator(stats, s, e, request.ridge)
        return fit_figures(stats, s, e, w)["residual_vs_target"]


@register
class Streamline(ContiguousCriterion):
    name = "streamline"
    summary = "highest mean cosine between the span's input and output (LLM-Streamline)"
    better = "higher"
    measure: ClassVar[str] = "mean_cosine"  # the CalibrationStatistics method that scores a span

    def statistics(self, request: SelectionRequest) -> StatisticsPlan:
        return StatisticsPlan(cosines=frozenset(candidate_spans(request.depth, request.num_layers, request.first)))

    def score(self, stats: CalibrationStatistics, s: int, e: int, request: SelectionRequest) -> float:
        return getattr(stats, self.measure)(s, e)


@register
class Angular(Streamline):
    name = "angular"
    summary = "lowest mean angular distance arccos(cos)/pi over all real tokens (Gromov et al.)"
    better = "lower"
    measure = "mean_angular"


@register
class ShortGPT(Criterion):
    name = "shortgpt"
    summary = "the num_layers layers, anywhere, of lowest Block Influence 1 - mean cos(x_i, x_i+1) (ShortGPT)"

    def statistics(self, request: SelectionRequest) -> StatisticsPlan:
        return StatisticsPlan(cosines=frozenset(candidate_spans(request.depth, 1, request.first)))

    def select(self, stats: CalibrationStatistics | None, request: SelectionRequest) -> Selection:
        layers = range(request.first, request.depth)
        scores = {candidate_name(i, i + 1): 1.0 - stats.mean_cosine(i, i + 1) for i in layers}
        ranked = sorted(layers, key=lambda i: (scores[candidate_name(i, i + 1)], i))
        return Selection(sorted(ranked[: request.num_layers]), self.name, scores, "lower")


@register
class Manual(Criterion):
    name = "manual"
    summary = "the layer indices given with --layers"
    takes_layers = True

    def statistics(self, request: SelectionRequest) -> StatisticsPlan:
        return StatisticsPlan()

    def select(self, stats: CalibrationStatistics | None, request: SelectionRequest) -> Selection:
        return Selection(sorted(request.layers), self.name, {}, "n/a")
