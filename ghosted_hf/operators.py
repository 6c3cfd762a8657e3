"""Closed-form boundary operators from calibration statistics alone (float64 throughout).

Every operator maps the hidden state entering the first removed layer, X_s, toward the one the dense
model sends to the first kept layer, X_e, as ``x -> x @ W``:

- ``ghost``: ``W = I + M``, ``(X_s^T X_s + eps I) M = X_s^T (X_e - X_s)`` (Ghosted Layers);
- ``none``: ``W = I`` (plain pruning);
- ``linearpatch-diag``: per-channel scale mean|X_e| / mean|X_s|;
- ``linearpatch-rotate``: the same scale in a Hadamard basis, ``W = H diag(d) H^T`` (LinearPatch);
- ``replaceme-ls``: no operator; a least-squares ``T`` on the MLP output of the last kept layer, folded
  into its ``down_proj`` (ReplaceMe), so the result is a plain Llama/Qwen checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .calibration import CalibrationStatistics
from .hadamard import rotation

OPERATORS = ("ghost", "none", "linearpatch-diag", "linearpatch-rotate", "replaceme-ls")


@dataclass
class BoundaryFit:
    """One boundary's operator (x -> x @ operator) or, for fused kinds, the transform to fold."""

    kind: str
    source: int
    target: int
    operator: torch.Tensor | None = None
    fused: torch.Tensor | None = None
    figures: dict[str, float] = field(default_factory=dict)


def check_operator_kind(kind: str) -> None:
    if kind not in OPERATORS:
        raise ValueError(f"Unknown operator {kind!r}; choose one of: {', '.join(OPERATORS)}.")


def ridge_epsilon(gram: torch.Tensor, ridge: float) -> float:
    """eps = ridge * mean diagonal of G: scale-free, so one default fits every depth and model."""
    if ridge < 0:
        raise ValueError(f"ridge must be >= 0, got {ridge}.")
    return ridge * float(torch.diagonal(gram).mean())


def solve_ghost(gram: torch.Tensor, cross: torch.Tensor, ridge: float) -> tuple[torch.Tensor, float]:
    """M of ``(G + eps I) M = X^T (Y - X) = cross - G`` by a linear solve (never an explicit inverse)."""
    eps = ridge_epsilon(gram, ridge)
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    return torch.linalg.solve(gram + eps * eye, cross - gram), eps


def squared_residual(gram: torch.Tensor, cross: torch.Tensor, energy: float, w: torch.Tensor) -> float:
    """||X W - Y||^2 = tr(W^T G W) - 2 tr(W^T X^T Y) + ||Y||^2, from the statistics."""
    w = w.to(gram)
    return float(((gram @ w) * w).sum() - 2.0 * (w * cross).sum()) + energy


def fit_figures(stats: CalibrationStatistics, s: int, e: int, w: torch.Tensor) -> dict[str, float]:
    """Relative residuals of `w` on the calibration tokens (where the pair statistics exist)."""
    if not stats.has_pair(s, e):
        return {}
    gram, cross, energy = stats.gram(s), stats.cross(s, e), stats.energy(s, e)
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    untouched = squared_residual(gram, cross, energy, eye)
    residual = squared_residual(gram, cross, energy, w)
    return {
        # ||X W - X_e||^2 / ||X_e - X||^2: share of the pruning error left (1 = no recovery).
        "relative_residual": _ratio(residual, untouched),
        # ||X W - X_e||^2 / ||X_e||^2 and, for comparison, what plain pruning leaves.
        "residual_vs_target": _ratio(residual, energy),
        "pruned_residual_vs_target": _ratio(untouched, energy),
    }


def _ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, 0 when there was nothing to explain (a block that is exactly the identity)."""
    return max(numerator, 0.0) / denominator if denominator > 0 else 0.0


def ghost_fit(stats: CalibrationStatistics, s: int, e: int, ridge: float) -> BoundaryFit:
    gram, cross = stats.gram(s), stats.cross(s, e)
    m, eps = solve_ghost(gram, cross, ridge)
    w = m + torch.eye(m.shape[0], dtype=m.dtype, device=m.device)
    eigenvalues = torch.linalg.eigvalsh(gram)
    figures = fit_figures(stats, s, e, w)
    figures.update(
        condition_number=float(eigenvalues[-1] / eigenvalues[0].clamp_min(torch.finfo(torch.float64).tiny)),
        antisymmetric_share=float(torch.linalg.norm((m - m.T) / 2) / torch.linalg.norm(m).clamp_min(1e-300)),
        ridge_eps=eps,
    )
    return BoundaryFit("ghost", s, e, operator=w, figures=figures)


def _safe_ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    ratio = numerator / denominator.clamp_min(torch.finfo(torch.float64).tiny)
    return torch.where(denominator > 0, ratio, torch.ones_like(ratio))


def linearpatch_diag_fit(stats: CalibrationStatistics, s: int, e: int) -> BoundaryFit:
    w = torch.diag(_safe_ratio(stats.abs_mean(e), stats.abs_mean(s)))
    return BoundaryFit("linearpatch-diag", s, e, operator=w, figures=fit_figures(stats, s, e, w))


def linearpatch_rotate_fit(stats: CalibrationStatistics, s: int, e: int) -> BoundaryFit:
    h, kind = rotation(stats.hidden_size)
    if kind != stats.rotation_kind:
        raise ValueError(f"Statistics were rotated with {stats.rotation_kind}, but {kind} is available now.")
    h = h.to(stats.rotated_abs_mean(s).device)
    w = h @ torch.diag(_safe_ratio(stats.rotated_abs_mean(e), stats.rotated_abs_mean(s))) @ h.T
    figures = fit_figures(stats, s, e, w)
    figures["rotation"] = kind
    return BoundaryFit("linearpatch-rotate", s, e, operator=w, figures=figures)


def replaceme_fit(stats: CalibrationStatistics, s: int, e: int, ridge: float) -> BoundaryFit:
    """T minimising ||M T - (X_e - Y)||, with M the MLP output of layer s-1 and Y = X_s - M its residual."""
    mm, m_source, m_target = stats.mlp_terms(s, e)
    rhs = m_target - m_source + mm  # M^T (X_e - X_s + M)
    eps = ridge_epsilon(mm, ridge)
    t = torch.linalg.solve(mm + eps * torch.eye(mm.shape[0], dtype=mm.dtype, device=mm.device), rhs)
    figures: dict[str, float] = {"ridge_eps": eps}
    if stats.has_pair(s, e) and stats.weighting == "none":
        gram, cross, energy = stats.gram(s), stats.cross(s, e), stats.energy(s, e)
        untouched = energy - 2.0 * float(torch.trace(cross)) + float(torch.trace(gram))  # ||X_e - X_s||^2
        target = untouched + 2.0 * float(torch.trace(m_target) - torch.trace(m_source)) + float(torch.trace(mm))
        residual = float(((mm @ t) * t).sum() - 2.0 * (t * rhs).sum()) + target
        figures.update(relative_residual=_ratio(residual, untouched), residual_vs_target=_ratio(residual, energy),
                       pruned_residual_vs_target=_ratio(untouched, energy))
    return BoundaryFit("replaceme-ls", s, e, fused=t, figures=figures)


def identity_fit(stats: CalibrationStatistics, s: int, e: int) -> BoundaryFit:
    w = torch.eye(stats.hidden_size, dtype=torch.float64)
    return BoundaryFit("none", s, e, operator=w, figures=fit_figures(stats, s, e, w))


def fit_boundary(stats: CalibrationStatistics, kind: str, s: int, e: int, ridge: float) -> BoundaryFit:
    check_operator_kind(kind)
    if kind == "ghost":
        return ghost_fit(stats, s, e, ridge)
    if kind == "linearpatch-diag":
        return linearpatch_diag_fit(stats, s, e)
    if kind == "linearpatch-rotate":
        return linearpatch_rotate_fit(stats, s, e)
    if kind == "replaceme-ls":
        return replaceme_fit(stats, s, e, ridge)
    return identity_fit(stats, s, e)
