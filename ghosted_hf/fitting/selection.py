"""Which layers to remove, scored from calibration statistics, as a registry of criteria.

Contiguous criteria score every span of `num_layers` layers from the operator kind's first removable layer to the
last layer (whose target is the final norm's input): none is excluded. A criterion is one `Criterion` subclass
registered with `@register`; nothing outside its class compares its name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..errors import GhostedError
from ..statistics import CalibrationStatistics, StatisticsPlan, least_squares, similarity
from ..utils.registry import Registry
from .operators import operator_kind


@dataclass(frozen=True)
class SelectionRequest:
    """What a criterion is asked to choose."""

    depth: int  # layers of the dense model
    num_layers: int  # how many to remove
    first: int = 0  # the lowest removable layer (set by the operator kind)
    ridge: float = 1e-6
    layers: tuple[int, ...] = ()  # explicit indices, for criteria that take them
    operator: str = "ghost"  # the operator kind that will recover the boundary
    # why a removal cannot be built (the family's rules: a hybrid's full-attention layer, shared keys and values), or
    # None where it can
    problem: Callable[[list[int]], str | None] = field(default=lambda removed: None, compare=False)

    def allows(self, removed: Iterable[int]) -> bool:
        """Whether a removal can be built."""
        return self.problem(sorted(removed)) is None

    def first_allowed(self, ranked: list[int]) -> list[int]:
        """The first `num_layers` of `ranked` (best first) where they can be removed together; else the best one swap
        of the worst chosen for a better-ranked rest (a needed layer kept). Refused in one line where none can."""
        chosen, rest = ranked[: self.num_layers], ranked[self.num_layers:]
        if self.allows(chosen):
            return sorted(chosen)
        for out in reversed(chosen):
            for other in rest:
                swapped = [other if i == out else i for i in chosen]
                if self.allows(swapped):
                    return sorted(swapped)
        raise GhostedError(f"No removal of {self.num_layers} layers near the criterion's choice {sorted(chosen)} can "
                           f"be built: removing them {self.problem(sorted(chosen))}. Name the layers (criterion "
                           "'manual').")


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
        return [(s, e) for s, e in candidate_spans(request.depth, request.num_layers, request.first)
                if request.allows(range(s, e))]

    def select(self, stats: CalibrationStatistics | None, request: SelectionRequest) -> Selection:
        spans = self.spans(request)
        scores = {candidate_name(s, e): self.score(stats, s, e, request) for s, e in spans}
        best = (max if self.better == "higher" else min)(spans, key=lambda span: scores[candidate_name(*span)])
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
        return operator_kind(request.operator).selection_residual(stats, s, e, request.ridge)


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
        return Selection(request.first_allowed(ranked), self.name, scores, "lower")


@register
class Locality(Criterion):
    """LoRP's selection as its abstract describes it (a baseline; the paper's exact score and allocation rules were not
    reachable here, so this is our reading of its three steps)."""

    name = "lorp"
    summary = ("LoRP's steps as read from its abstract (arXiv 2605.27786): layers clustered spectrally by the mean "
               "cosine of their outputs, the layers to remove shared among the clusters by their redundancy beyond one "
               "layer each, the most redundant removed in each cluster")

    def statistics(self, request: SelectionRequest) -> StatisticsPlan:
        layers = range(request.first, request.depth)
        return StatisticsPlan.union(similarity(i + 1, j + 1) for i in layers for j in layers if i < j)

    def select(self, stats: CalibrationStatistics | None, request: SelectionRequest) -> Selection:
        layers = list(range(request.first, request.depth))
        affinity = torch.eye(len(layers), dtype=torch.float64)
        for a, i in enumerate(layers):
            for b in range(a + 1, len(layers)):
                affinity[a, b] = affinity[b, a] = max(stats.mean_cosine(i + 1, layers[b] + 1), 0.0)
        chosen, redundancy = locality_choice(affinity, request.num_layers)
        rows = chosen + sorted((k for k in range(len(layers)) if k not in chosen), key=lambda k: -redundancy[k])
        return Selection(request.first_allowed([layers[k] for k in rows]), self.name,
                         {candidate_name(i, i + 1): round(float(r), 6) for i, r in zip(layers, redundancy)}, "higher")


def spectral_clusters(affinity: torch.Tensor, seed: int = 0) -> list[list[int]]:
    """Clusters of the rows of a symmetric nonnegative affinity matrix: the normalized Laplacian's eigenvectors of its
    k smallest eigenvalues (k at the largest eigengap, 1 < k <= n / 2), row-normalized, grouped by k-means."""
    n = affinity.shape[0]
    if n < 4:
        return [list(range(n))]
    scale = affinity.sum(1).clamp_min(1e-12).rsqrt()
    laplacian = torch.eye(n, dtype=affinity.dtype) - scale[:, None] * affinity * scale[None, :]
    values, vectors = torch.linalg.eigh(laplacian)
    k = 2 + int(torch.argmax(values[2:n // 2 + 1] - values[1:n // 2]))
    points = torch.nn.functional.normalize(vectors[:, :k], dim=1)
    centers = points[torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:k]]
    for _ in range(100):
        labels = torch.cdist(points, centers).argmin(1)
        moved = torch.stack([points[labels == c].mean(0) if (labels == c).any() else centers[c] for c in range(k)])
        if torch.allclose(moved, centers):
            break
        centers = moved
    return sorted(([i for i in range(n) if labels[i] == c] for c in range(k) if (labels == c).any()), key=min)


def locality_choice(affinity: torch.Tensor, num_layers: int) -> tuple[list[int], torch.Tensor]:
    """(the rows to remove, each row's redundancy): clusters of `affinity`; a row's redundancy is its mean affinity to
    the rest of its cluster, a cluster's the sum beyond its most redundant row (what it holds beyond one layer's
    worth); `num_layers` shared among clusters in proportion (largest remainders, at most all but one row of a
    cluster), the most redundant rows of each cluster removed."""
    clusters = spectral_clusters(affinity)
    redundancy = torch.zeros(affinity.shape[0], dtype=torch.float64)
    for cluster in clusters:
        for i in cluster:
            others = [j for j in cluster if j != i]
            redundancy[i] = affinity[i, others].mean() if others else 0.0
    weight = [float(redundancy[c].sum() - redundancy[c].max()) for c in clusters]
    room = [len(c) - 1 for c in clusters]
    if num_layers > sum(room):
        raise GhostedError(f"The clusters can give up {sum(room)} layers (all but one of each), fewer than {num_layers}.")
    share = [num_layers * w / (sum(weight) or 1.0) for w in weight]
    take = [min(int(x), r) for x, r in zip(share, room)]
    for c in sorted(range(len(clusters)), key=lambda c: (take[c] - share[c], c)) * num_layers:
        if sum(take) == num_layers:
            break
        if take[c] < room[c]:
            take[c] += 1
    chosen = [i for cluster, t in zip(clusters, take) for i in sorted(cluster, key=lambda i: -redundancy[i])[:t]]
    return sorted(chosen), redundancy


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
