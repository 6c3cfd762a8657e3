"""Which layers to remove, scored from calibration statistics.

Contiguous criteria score every block of `n` layers, from the one starting at layer 0 to the one ending
at the last layer (whose target is the input of the final norm): none is excluded.

- ``streamline`` (LLM-Streamline): highest mean cosine between the block's input and output;
- ``angular`` (Gromov et al.): lowest mean angular distance arccos(cos)/pi, over all real tokens;
- ``ghost-aware``: lowest ghost-fitted residual ||X_s W - X_e||^2 / ||X_e||^2, i.e. the block the
  operator can best stand in for;
- ``shortgpt`` (Block Influence): the `n` layers, anywhere, with the lowest BI = 1 - mean cos(x_i, x_{i+1});
- ``manual``: explicit indices.
"""

from __future__ import annotations

from dataclasses import dataclass

from .calibration import CalibrationStatistics, StatisticsPlan
from .operators import fit_figures, solve_ghost

CRITERIA = ("ghost-aware", "streamline", "angular", "shortgpt", "manual")


@dataclass
class Selection:
    removed: list[int]
    criterion: str
    scores: dict[str, float]  # candidate ("12-19" for a block, "7" for a layer) -> score
    better: str  # "higher" or "lower"

    def describe(self) -> dict:
        return {"criterion": self.criterion, "removed": self.removed, "better": self.better, "scores": self.scores}


def check_criterion(criterion: str) -> None:
    if criterion not in CRITERIA:
        raise ValueError(f"Unknown criterion {criterion!r}; choose one of: {', '.join(CRITERIA)}.")


def check_num_layers(num_layers: int, total: int) -> None:
    if not 1 <= num_layers < total:
        raise ValueError(f"num_layers must be between 1 and {total - 1} for a model with {total} layers, got {num_layers}.")


def candidate_blocks(total: int, n: int, first: int = 0) -> list[tuple[int, int]]:
    """(s, e) for every contiguous block s..e-1 of n layers with s >= first; e == total is the final
    norm's input. `first` is 0 except for replaceme-ls, which needs a kept layer before the block."""
    return [(s, s + n) for s in range(first, total - n + 1)]


def selection_plan(criterion: str, num_layers: int, total: int, weighting: str = "none",
                   skip_first_tokens: int = 0, first: int = 0) -> StatisticsPlan:
    """The statistics a criterion needs, for one pass over the calibration data."""
    check_criterion(criterion)
    blocks = frozenset(candidate_blocks(total, num_layers, first)) if criterion != "manual" else frozenset()
    if criterion in ("streamline", "angular"):
        return StatisticsPlan(cosines=blocks, weighting=weighting, skip_first_tokens=skip_first_tokens)
    if criterion == "ghost-aware":
        return StatisticsPlan(grams=frozenset(s for s, _ in blocks), pairs=blocks, weighting=weighting,
                              skip_first_tokens=skip_first_tokens)
    if criterion == "shortgpt":
        return StatisticsPlan(cosines=frozenset((i, i + 1) for i in range(first, total)), weighting=weighting,
                              skip_first_tokens=skip_first_tokens)
    return StatisticsPlan(weighting=weighting, skip_first_tokens=skip_first_tokens)


def _block_name(s: int, e: int) -> str:
    return f"{s}-{e - 1}"


def select_layers(stats: CalibrationStatistics, criterion: str, num_layers: int, ridge: float = 1e-6,
                  layers: list[int] | None = None, first: int = 0) -> Selection:
    check_criterion(criterion)
    total = stats.num_layers
    if criterion == "manual":
        if not layers:
            raise ValueError("criterion='manual' needs the layer indices to remove (layers=[...]).")
        return Selection(sorted(layers), criterion, {}, "n/a")
    check_num_layers(num_layers, total)
    if criterion == "shortgpt":
        scores = {str(i): 1.0 - stats.mean_cosine(i, i + 1) for i in range(first, total)}
        ranked = sorted(range(first, total), key=lambda i: (scores[str(i)], i))
        return Selection(sorted(ranked[:num_layers]), criterion, scores, "lower")
    blocks = candidate_blocks(total, num_layers, first)
    if criterion == "streamline":
        scores = {_block_name(s, e): stats.mean_cosine(s, e) for s, e in blocks}
        best = max(blocks, key=lambda b: scores[_block_name(*b)])
        return Selection(list(range(*best)), criterion, scores, "higher")
    if criterion == "angular":
        scores = {_block_name(s, e): stats.mean_angular(s, e) for s, e in blocks}
    else:  # ghost-aware
        scores = {}
        for s, e in blocks:
            m, _ = solve_ghost(stats.gram(s), stats.cross(s, e), ridge)
            m.diagonal().add_(1.0)
            scores[_block_name(s, e)] = fit_figures(stats, s, e, m)["residual_vs_target"]
    best = min(blocks, key=lambda b: scores[_block_name(*b)])
    return Selection(list(range(*best)), criterion, scores, "lower")
