"""Closed-form boundary operators from calibration statistics alone (float64 throughout), as a registry.

Every kind maps X_s, entering the first removed layer, toward X_e, what the dense model sends to the first kept
layer. A kind is one `OperatorKind` subclass registered with `@register`; nothing outside it compares its name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from tqdm.auto import tqdm

from ..errors import GhostedError
from ..statistics import ABS, ROTATED_ABS, CalibrationStatistics, StatisticsPlan, least_squares, mlp_terms, normed_terms
from ..utils.hadamard import rotation
from ..utils.registry import Registry


@dataclass
class BoundaryFit:
    """One boundary's fit: the operator x -> x @ operator (+ n(x) @ normed for the normed kinds) and, for kinds
    that fold into the weights, the transform of the last upstream MLP output to fold into its output weights."""

    kind: str
    source: int
    target: int
    operator: torch.Tensor | None = None
    fused: torch.Tensor | None = None
    normed: torch.Tensor | None = None
    figures: dict[str, Any] = field(default_factory=dict)


class OperatorKind:
    """One way to recover a boundary. Subclasses set the class attributes and implement `fit`."""

    name: ClassVar[str]
    summary: ClassVar[str]
    stock: ClassVar[bool] = False  # folds into the weights: ghost_prune returns a stock checkpoint
    sequential: ClassVar[bool] = True  # can be refitted on the model already pruned and patched upstream
    first_removable: ClassVar[int] = 0  # the lowest layer a boundary of this kind may start at
    regressors: ClassVar[int] = 1  # inputs of the fit per output channel, in multiples of C (the token budget)

    def statistics(self, s: int, e: int) -> StatisticsPlan:
        """What `fit` reads for the boundary removing layers s..e-1 (with the fit figures)."""
        return least_squares(s, e)

    def fit(self, stats: CalibrationStatistics, s: int, e: int, ridge: float) -> BoundaryFit:
        """The closed-form fit of boundary (s, e) from `stats`."""
        raise NotImplementedError

    def selection_statistics(self, s: int, e: int) -> StatisticsPlan:
        """What `selection_residual` reads beyond the least-squares statistics."""
        return StatisticsPlan()

    def selection_residual(self, stats: CalibrationStatistics, s: int, e: int, ridge: float) -> float:
        """||fit - X_e||^2 / ||X_e||^2, as ghost-aware selection scores the span for this kind: by default the ghost
        fit's (for a kind whose own fit is not a least-squares fit of X_e)."""
        return fit_figures(stats, s, e, ghost_operator(stats, s, e, ridge)[0])["residual_vs_target"]


logger = logging.getLogger(__name__)

OPERATOR_KINDS: Registry[OperatorKind] = Registry("operator")
register = OPERATOR_KINDS.register
operator_kind = OPERATOR_KINDS.lookup


def ridge_epsilon(gram: torch.Tensor, ridge: float) -> float:
    """eps = ridge * mean diagonal of G: scale-free, so one default fits every depth and model."""
    if not ridge >= 0:
        raise GhostedError(f"ridge must be >= 0, got {ridge}.")
    return ridge * float(torch.diagonal(gram).mean())


def ridge_solve(gram: torch.Tensor, rhs: torch.Tensor, ridge: float) -> tuple[torch.Tensor, float]:
    """(A, eps) of ``(G + eps I) A = rhs`` by a linear solve (never an explicit inverse): every fit here."""
    eps = ridge_epsilon(gram, ridge)
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    return torch.linalg.solve(gram + eps * eye, rhs), eps


def solve_ghost(gram: torch.Tensor, cross: torch.Tensor, ridge: float) -> tuple[torch.Tensor, float]:
    """M of ``(G + eps I) M = X^T (Y - X) = cross - G``."""
    return ridge_solve(gram, cross - gram, ridge)


def squared_residual(gram: torch.Tensor, cross: torch.Tensor, energy: float, w: torch.Tensor) -> float:
    """||X W - Y||^2 = tr(W^T G W) - 2 tr(W^T X^T Y) + ||Y||^2, from the statistics."""
    w = w.to(gram)
    return float(((gram @ w) * w).sum() - 2.0 * (w * cross).sum()) + energy


def map_spectrum(gram: torch.Tensor, cross: torch.Tensor, ridge: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(A, energies, directions): the full ridge least-squares map A and the eigen-decomposition of its fitted values'
    Gram ``A^T (G + eps I) A``, largest first: the output energy the map explains along each direction."""
    a, eps = ridge_solve(gram, cross, ridge)
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    energies, directions = torch.linalg.eigh(a.T @ (gram + eps * eye) @ a)
    return a, energies.flip(0).clamp_min(0), directions.flip(1)  # (eigh sorts ascending)


def reduced_rank(gram: torch.Tensor, cross: torch.Tensor, ridge: float, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, U), B of shape (C, r) and U (r, C): the map ``h -> h B U`` of rank at most r with the least ridge
    least-squares loss ``||Y - X A||^2 + eps ||A||^2`` (reduced-rank regression on the statistics alone). The ridge
    term is X with sqrt(eps) I appended and Y with zeros, so the full solution A is projected on the r leading
    eigenvectors of its fitted values' Gram ``A^T (G + eps I) A``: 2 C r parameters where the full map holds C^2."""
    a, _, directions = map_spectrum(gram, cross, ridge)
    return rank_factors(a, directions, rank)


def rank_factors(a: torch.Tensor, directions: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A V_r, V_r^T): map A projected on its `rank` leading output directions (`map_spectrum`), as two factors."""
    leading = directions[:, :rank]
    return a @ leading, leading.T.contiguous()


def energy_rank(energies: torch.Tensor, share: float) -> int:
    """The fewest leading directions that keep `share` of the explained energy (`energies` largest first)."""
    total = float(energies.sum())
    if total <= 0:
        return 1
    kept = torch.cumsum(energies, 0) >= share * total
    return int(torch.nonzero(kept)[0]) + 1


def share_left(numerator: float, denominator: float) -> float:
    """numerator / denominator, 0 when there was nothing to explain (a block that is exactly the identity)."""
    return max(numerator, 0.0) / denominator if denominator > 0 else 0.0


def residual_figures(stats: CalibrationStatistics, s: int, e: int, residual: float) -> dict[str, float]:
    """The fit figures reported per boundary, from the fit's squared residual ||X W - X_e||^2."""
    gram, cross, energy = stats.gram(s), stats.cross(s, e), stats.energy(s, e)
    untouched = squared_residual(gram, cross, energy, torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device))
    return {
        # ||X W - X_e||^2 / ||X_e - X||^2: share of the pruning error left (1 = no recovery).
        "relative_residual": share_left(residual, untouched),
        # ||X W - X_e||^2 / ||X_e||^2 and, for comparison, what plain pruning leaves.
        "residual_vs_target": share_left(residual, energy),
        "pruned_residual_vs_target": share_left(untouched, energy),
    }


def fit_figures(stats: CalibrationStatistics, s: int, e: int, w: torch.Tensor) -> dict[str, float]:
    """Relative residuals of `w` on the calibration tokens (where the pair statistics exist)."""
    if not stats.has_pair(s, e):
        return {}
    return residual_figures(stats, s, e, squared_residual(stats.gram(s), stats.cross(s, e), stats.energy(s, e), w))


def ghost_operator(stats: CalibrationStatistics, s: int, e: int, ridge: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(W = I + M, M, eps) of the ghost least-squares fit."""
    m, eps = solve_ghost(stats.gram(s), stats.cross(s, e), ridge)
    return m + torch.eye(m.shape[0], dtype=m.dtype, device=m.device), m, eps


@register
class Ghost(OperatorKind):
    """The Ghosted Layers operator: the ridge least-squares fit of X_s W to X_e, W = I + M."""

    name = "ghost"
    summary = "W = I + M, (X_s^T X_s + eps I) M = X_s^T (X_e - X_s) (Ghosted Layers)"

    def fit(self, stats: CalibrationStatistics, s: int, e: int, ridge: float) -> BoundaryFit:
        w, m, eps = ghost_operator(stats, s, e, ridge)
        eigenvalues = torch.linalg.eigvalsh(stats.gram(s))
        decided = int((eigenvalues < eps).sum())
        if decided:
            logger.warning("Boundary %d -> %d: %d of %d directions of the calibration hidden states carry less energy "
                           "than the ridge (eps %.3g): the ridge, not the data, sets the operator there. Add "
                           "calibration text (more, or more varied).", s, e, decided, len(eigenvalues), eps)
        figures = fit_figures(stats, s, e, w)
        figures.update(
            condition_number=float(eigenvalues[-1] / eigenvalues[0].clamp_min(torch.finfo(torch.float64).tiny)),
            antisymmetric_share=float(torch.linalg.norm((m - m.T) / 2) / torch.linalg.norm(m).clamp_min(1e-300)),
            ridge_eps=eps,
        )
        return BoundaryFit(self.name, s, e, operator=w, figures=figures)


def normed_residual(stats: CalibrationStatistics, s: int, e: int, w: torch.Tensor, a: torch.Tensor) -> float:
    """||X W + N A - X_e||^2 with N = n(X_s), from the statistics."""
    gram, cross, energy = stats.gram(s), stats.cross(s, e), stats.energy(s, e)
    ngram, nsource, ncross = stats.normed_terms(s, e)
    return float(((gram @ w) * w).sum() + 2.0 * (w * (nsource.T @ a)).sum() + ((ngram @ a) * a).sum()
                 - 2.0 * (w * cross).sum() - 2.0 * (a * ncross).sum()) + energy


def fit_normed(stats: CalibrationStatistics, s: int, e: int, ridge: float, *,
               joint: bool) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(W, A, ridge eps) of the least-squares fit X_e - X_s ~ n(X_s) A (W = I) or, `joint`, ~ X_s M + n(X_s) A
    (W = I + M): the ridge of each block is scaled by its own mean diagonal (n(X) and X differ in scale)."""
    gram, cross = stats.gram(s), stats.cross(s, e)
    ngram, nsource, ncross = stats.normed_terms(s, e)
    c = gram.shape[0]
    eye = torch.eye(c, dtype=gram.dtype, device=gram.device)
    eps_n = ridge_epsilon(ngram, ridge)
    if not joint:
        return eye, torch.linalg.solve(ngram + eps_n * eye, ncross - nsource), {"ridge_eps_normed": eps_n}
    eps_x = ridge_epsilon(gram, ridge)
    system = torch.cat([torch.cat([gram + eps_x * eye, nsource.T], 1), torch.cat([nsource, ngram + eps_n * eye], 1)])
    solution = torch.linalg.solve(system, torch.cat([cross - gram, ncross - nsource]))
    return eye + solution[:c], solution[c:], {"ridge_eps": eps_x, "ridge_eps_normed": eps_n}


@register
class Normed(OperatorKind):
    """A ghost boundary in the form of an RMSNorm-then-linear block, as llama.cpp's DeciLM "linear attention"."""

    name = "normed"
    summary = "x + n(x) A, n(x) = x / rms(x), (N^T N + eps I) A = N^T (X_e - X_s) with N = n(X_s)"
    joint: ClassVar[bool] = False

    def statistics(self, s: int, e: int) -> StatisticsPlan:
        return super().statistics(s, e) | normed_terms(s, e)

    def selection_statistics(self, s: int, e: int) -> StatisticsPlan:
        return normed_terms(s, e)

    def selection_residual(self, stats: CalibrationStatistics, s: int, e: int, ridge: float) -> float:
        w, a, _ = fit_normed(stats, s, e, ridge, joint=self.joint)
        return max(normed_residual(stats, s, e, w, a), 0.0) / stats.energy(s, e)

    def fit(self, stats: CalibrationStatistics, s: int, e: int, ridge: float) -> BoundaryFit:
        w, a, figures = fit_normed(stats, s, e, ridge, joint=self.joint)
        figures.update(residual_figures(stats, s, e, normed_residual(stats, s, e, w, a)))
        return BoundaryFit(self.name, s, e, operator=w, normed=a, figures=figures)


@register
class GhostNormed(Normed):
    """The ghost operator and the normed term fitted jointly."""

    name = "ghost-normed"
    summary = "x W + n(x) A, W = I + M, [M; A] the joint least-squares fit of X_e - X_s on [X_s, n(X_s)]"
    joint = True
    regressors = 2


@register
class NoOperator(OperatorKind):
    """Plain pruning: the removed layers are gone and nothing stands in for them."""

    name = "none"
    summary = "W = I: plain pruning (a stock checkpoint; no calibration pass beyond the criterion's)"
    stock = True
    sequential = False

    def statistics(self, s: int, e: int) -> StatisticsPlan:
        return StatisticsPlan()  # nothing to fit; the figures are reported where the criterion's statistics exist

    def fit(self, stats: CalibrationStatistics | None, s: int, e: int, ridge: float) -> BoundaryFit:
        if stats is None:
            return BoundaryFit(self.name, s, e)
        return BoundaryFit(self.name, s, e, figures=fit_figures(stats, s, e, torch.eye(stats.hidden_size)))


@register
class LinearPatchDiag(OperatorKind):
    """LinearPatch's channel scale without its rotation (a baseline)."""

    name = "linearpatch-diag"
    summary = "per-channel scale mean|X_e| / mean|X_s|"
    rotated: ClassVar[bool] = False  # the scale acts in a Hadamard basis, not on the channels themselves

    def statistics(self, s: int, e: int) -> StatisticsPlan:
        mean = ROTATED_ABS if self.rotated else ABS
        return super().statistics(s, e) | StatisticsPlan.of(mean(s), mean(e))

    def fit(self, stats: CalibrationStatistics, s: int, e: int, ridge: float) -> BoundaryFit:
        mean = stats.rotated_abs_mean if self.rotated else stats.abs_mean
        target, source = mean(e), mean(s)
        w = torch.diag(torch.where(source > 0, target / source.clamp_min(torch.finfo(torch.float64).tiny), 1.0))
        if not self.rotated:
            return BoundaryFit(self.name, s, e, operator=w, figures=fit_figures(stats, s, e, w))
        h, kind = rotation(stats.hidden_size)
        if kind != stats.rotation_kind:
            raise GhostedError(f"Statistics were rotated with {stats.rotation_kind}, but {kind} is available now.")
        w = h.to(w) @ w @ h.to(w).T
        return BoundaryFit(self.name, s, e, operator=w, figures={**fit_figures(stats, s, e, w), "rotation": kind})


@register
class LinearPatchRotate(LinearPatchDiag):
    """LinearPatch (Chen et al. 2025): a channel scale in a Hadamard basis (a baseline)."""

    name = "linearpatch-rotate"
    summary = "the same scale in a Hadamard basis, W = H diag(d) H^T (LinearPatch)"
    rotated = True


@register
class ReplaceMeLS(OperatorKind):
    """ReplaceMe's least-squares transform of the last upstream MLP output (a baseline; a stock checkpoint)."""

    name = "replaceme-ls"
    summary = ("least-squares T on the MLP output of the last kept layer before the boundary, folded into its "
               "output weights (ReplaceMe): a stock checkpoint")
    stock = True
    sequential = False
    first_removable = 1  # needs a kept layer before the boundary to fold into

    def statistics(self, s: int, e: int) -> StatisticsPlan:
        return super().statistics(s, e) | mlp_terms(s, e)

    def fit(self, stats: CalibrationStatistics, s: int, e: int, ridge: float) -> BoundaryFit:
        """T minimising ||M T - (X_e - Y)||, with M the MLP output of layer s-1 and Y = X_s - M its residual."""
        mm, m_source, m_target = stats.mlp_terms(s, e)
        rhs = m_target - m_source + mm  # M^T (X_e - X_s + M)
        eps = ridge_epsilon(mm, ridge)
        t = torch.linalg.solve(mm + eps * torch.eye(mm.shape[0], dtype=mm.dtype, device=mm.device), rhs)
        figures: dict[str, Any] = {"ridge_eps": eps}
        if stats.has_pair(s, e):
            gram, cross, energy = stats.gram(s), stats.cross(s, e), stats.energy(s, e)
            untouched = energy - 2.0 * float(torch.trace(cross)) + float(torch.trace(gram))  # ||X_e - X_s||^2
            target = untouched + 2.0 * float(torch.trace(m_target) - torch.trace(m_source)) + float(torch.trace(mm))
            figures.update(residual_figures(stats, s, e, squared_residual(mm, rhs, target, t)))
        return BoundaryFit(self.name, s, e, fused=t, figures=figures)


def fit_folded(stats: CalibrationStatistics, s: int, e: int, ridge: float, *, rotation: bool = True,
               transform: bool = True, iterations: int = 100) -> tuple[float, torch.Tensor, torch.Tensor | None, float]:
    """(c, Q, T, squared residual) minimising ||c (Y + M T) Q - X_e||^2 over c > 0, orthogonal Q and T, with M
    the MLP output of layer s-1 and Y = X_s - M (transform=False: T = I, returned as None; rotation=False:
    Q = I). Alternates the closed forms, each of which lowers the residual: scaled Procrustes (or the best
    scale) for (c, Q) given T, least squares for T given (c, Q)."""
    gram, cross, energy = stats.gram(s), stats.cross(s, e), stats.energy(s, e)
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    delta = torch.zeros_like(gram)  # T - I: Z = X_s + M delta (no M without the transform: all its terms 0)
    mm, m_source, m_target = stats.mlp_terms(s, e) if transform else (delta, delta, delta)  # M^T M, M^T X_s, M^T X_e
    system = mm + ridge_epsilon(mm, ridge) * eye  # the same ridge system at every iteration
    residual = float("inf")
    # Each iteration solves a C x C system: minutes for a wide model, so a bar shows once it takes 2 s.
    for _ in tqdm(range(iterations), desc=f"Folding the boundary before layer {e}: alternating fits", leave=False,
                  delay=2):
        z_cross = cross + delta.T @ m_target  # Z^T X_e
        z_gram = float(torch.trace(gram) + 2.0 * (delta * m_source).sum() + ((mm @ delta) * delta).sum())  # tr(Z^T Z)
        if rotation:  # scaled Procrustes: Z^T X_e = U S V^T, Q = U V^T, c = tr(S) / tr(Z^T Z)
            u, singular, vh = torch.linalg.svd(z_cross)
            q, trace = u @ vh, float(singular.sum())
            c = trace / z_gram if z_gram > 0 else 1.0
        else:  # a positive scale alone (a sign flip would not survive the norms downstream)
            q, trace = eye, float(torch.trace(z_cross))
            c = max(trace / z_gram, 1e-6) if z_gram > 0 else 1.0
        previous, residual = residual, c * c * z_gram - 2.0 * c * trace + energy
        if not transform or previous - residual <= 1e-12 * energy:
            break
        # c M (T - I) ~ X_e Q^T - c X_s
        delta = torch.linalg.solve(system, m_target @ q.T / c - m_source)
    return c, q, (eye + delta if transform else None), max(residual, 0.0)


@register
class Folded(OperatorKind):
    """The best recovery a stock checkpoint can hold: a scaled rotation and an MLP-output transform."""

    name = "folded"
    summary = ("c Q (Q orthogonal) with a transform T of the last upstream MLP output: folds exactly into the "
               "weights of a stock checkpoint (Q upstream of the boundary, 1/c into the writers after it, T into "
               "the MLP's output weights); tied embeddings are untied when Q rotates them")
    stock = True
    rotation: ClassVar[bool] = True

    def statistics(self, s: int, e: int) -> StatisticsPlan:
        plan = super().statistics(s, e)
        return plan | mlp_terms(s, e) if s >= 1 else plan

    def fit(self, stats: CalibrationStatistics, s: int, e: int, ridge: float) -> BoundaryFit:
        # At layer 0 only the embeddings are upstream: no MLP output to transform.
        c, q, t, residual = fit_folded(stats, s, e, ridge, rotation=self.rotation, transform=s >= 1)
        figures = {**residual_figures(stats, s, e, residual), "scale": c}
        return BoundaryFit(self.name, s, e, operator=c * q, fused=t, figures=figures)


@register
class FoldedScale(Folded):
    """`folded` without the rotation: tied embeddings stay tied."""

    name = "folded-tied"
    summary = ("the scale and transform of `folded` without the rotation (Q = I): nothing is folded into the "
               "embeddings, so tied embeddings stay tied (no extra parameters)")
    rotation = False
