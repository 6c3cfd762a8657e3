"""Which layers to remove, scored from calibration statistics, as a registry of criteria.

Contiguous criteria score every candidate boundary of `num_layers` layers, from the one starting at
layer 0 (or at the operator kind's first removable layer) to the one ending at the last layer (whose
target is the input of the final norm): none is excluded. A criterion whose scores add up over blocks
(`splits`, e.g. ghost-aware's relative residuals) can also remove the layers as up to `max_blocks`
separate blocks: every block of 1..num_layers layers is scored once, and the best combinations are
found by dynamic programming over those scores. A criterion is one `Criterion` subclass registered with
`@register`; nothing outside its class compares its name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
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
    max_blocks: int = 1  # remove the layers as up to this many separate blocks (criteria that `split`)


@dataclass
class Selection:
    removed: list[int]
    criterion: str
    scores: dict[str, float]  # candidate name (see `candidate_name`) -> score
    better: str  # "higher", "lower" or "n/a"
    max_blocks: int = 1
    block_scores: dict[str, float] = field(default_factory=dict)  # with max_blocks > 1: each block's own score
    verified: dict[str, float] = field(default_factory=dict)  # candidate -> sum of its fitted residuals

    def describe(self) -> dict[str, Any]:
        described = {"criterion": self.criterion, "removed": self.removed, "better": self.better, "scores": self.scores}
        if self.max_blocks > 1:
            described.update(max_blocks=self.max_blocks, block_scores=self.block_scores)
        if self.verified:
            described["verified"] = self.verified
        return described

    def ranked(self) -> list[str]:
        """Candidate names, best score first."""
        sign = -1 if self.better == "higher" else 1
        return sorted(self.scores, key=lambda name: (sign * self.scores[name], name))


def candidate_name(s: int, e: int) -> str:
    """"12-19" for the candidate removing layers 12..19, "7" for a single layer."""
    return f"{s}" if e == s + 1 else f"{s}-{e - 1}"


def blocks_name(blocks: tuple[tuple[int, int], ...]) -> str:
    """"4-7,12-15" for a removal made of the blocks (4, 8) and (12, 16)."""
    return ",".join(candidate_name(s, e) for s, e in blocks)


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
    if not 1 <= num_layers < depth:
        raise GhostedError(f"num_layers must be between 1 and {depth - 1} for a model with {depth} layers, got {num_layers}.")


def block_spans(depth: int, n: int, first: int = 0) -> list[tuple[int, int]]:
    """Every block of 1..n layers starting at or after `first`: what a split removal of n layers is made of."""
    return [span for k in range(1, n + 1) for span in candidate_spans(depth, k, first)]


def best_splits(block_score: dict[tuple[int, int], float], depth: int, n: int, max_blocks: int, first: int = 0,
                keep: int = 20) -> list[tuple[float, tuple[tuple[int, int], ...]]]:
    """The `keep` lowest sums of block scores over removals of exactly n layers as at most `max_blocks` blocks,
    separated by at least one kept layer (adjacent blocks would be one block), as (sum, blocks), best first.
    Dynamic programming over (next layer, layers left, blocks left): linear in depth, whatever the number of
    combinations."""

    @cache
    def best(i: int, left: int, blocks: int) -> tuple[tuple[float, tuple[tuple[int, int], ...]], ...]:
        if left == 0:
            return ((0.0, ()),)
        if blocks == 0 or i + left > depth:
            return ()
        options = list(best(i + 1, left, blocks))  # layer i is kept
        for k in range(1, left + 1):  # a block of k layers starts at i
            if i + k > depth:
                break
            head = ((i, i + k),)
            options.extend((block_score[(i, i + k)] + total, head + rest) for total, rest in best(i + k + 1, left - k,
                                                                                                 blocks - 1))
        return tuple(sorted(options)[:keep])

    found = best(first, n, max_blocks)
    best.cache_clear()
    return list(found)


class Criterion:
    """One way to choose the layers. Subclasses set the class attributes and implement `statistics`/`select`."""

    name: ClassVar[str]
    summary: ClassVar[str]
    takes_layers: ClassVar[bool] = False  # uses SelectionRequest.layers instead of statistics
    splits: ClassVar[bool] = False  # its span scores add up over blocks: it can remove several blocks (max_blocks)

    def statistics(self, request: SelectionRequest) -> StatisticsPlan:
        raise NotImplementedError

    def select(self, stats: CalibrationStatistics | None, request: SelectionRequest) -> Selection:
        raise NotImplementedError


class ContiguousCriterion(Criterion):
    """Scores every candidate span of `num_layers` layers and removes the best one (or, for a criterion that
    `splits`, with max_blocks > 1: the combination of blocks whose scores sum to the least)."""

    better: ClassVar[str]
    KEEP: ClassVar[int] = 20  # best combinations recorded (and offered for verification) with max_blocks > 1

    def score(self, stats: CalibrationStatistics, s: int, e: int, request: SelectionRequest) -> float:
        raise NotImplementedError

    def spans(self, request: SelectionRequest) -> list[tuple[int, int]]:
        """Every span this criterion scores (and whose boundary it may choose)."""
        if request.max_blocks > 1:
            return block_spans(request.depth, request.num_layers, request.first)
        return candidate_spans(request.depth, request.num_layers, request.first)

    def select(self, stats: CalibrationStatistics | None, request: SelectionRequest) -> Selection:
        if request.max_blocks > 1:
            return self.select_split(stats, request)
        spans = candidate_spans(request.depth, request.num_layers, request.first)
        scores = {candidate_name(s, e): self.score(stats, s, e, request) for s, e in spans}
        sign = 1 if self.better == "higher" else -1
        best = max(spans, key=lambda span: sign * scores[candidate_name(*span)])
        return Selection(list(range(*best)), self.name, scores, self.better)

    def select_split(self, stats: CalibrationStatistics | None, request: SelectionRequest) -> Selection:
        if not self.splits:
            raise GhostedError(f"Criterion {self.name!r} cannot remove several blocks: its scores do not add up "
                               "over blocks (use max_blocks=1).")
        block_score = {span: self.score(stats, *span, request) for span in self.spans(request)}
        found = best_splits(block_score, request.depth, request.num_layers, request.max_blocks, request.first,
                            self.KEEP)
        scores = {blocks_name(blocks): total for total, blocks in found}
        removed = [i for s, e in found[0][1] for i in range(s, e)]
        return Selection(removed, self.name, scores, self.better, request.max_blocks,
                         {candidate_name(s, e): v for (s, e), v in block_score.items()})


CRITERIA: Registry[Criterion] = Registry("criterion")
register = CRITERIA.register
criterion = CRITERIA.lookup


@register
class GhostAware(ContiguousCriterion):
    name = "ghost-aware"
    summary = ("span whose ghost-fitted residual ||X_s W - X_e||^2 / ||X_e||^2 is smallest (with max_blocks > 1: "
               "the blocks whose residuals sum to the least)")
    better = "lower"
    # Relative residuals add up: each layer reads the stream through RMSNorm, so what a boundary's error does
    # downstream depends on its size relative to the stream there, ||error||^2 / ||X_e||^2, whatever the depth
    # (the stream's norm grows with depth, so absolute residuals of deep and shallow blocks do not compare).
    splits = True

    def statistics(self, request: SelectionRequest) -> StatisticsPlan:
        spans = frozenset(self.spans(request))
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
