"""Closed-form operators on synthetic data, and the Hadamard rotations they use."""

from __future__ import annotations

import pytest
import torch

from ghosted_hf.errors import GhostedError
from ghosted_hf.fitting.operators import OPERATOR_KINDS, operator_kind, reduced_rank, solve_ghost, squared_residual
from ghosted_hf.remote.modeling_ghosted import rms_normalized
from ghosted_hf.statistics import ABS, ROTATED_ABS, StatisticsPlan, least_squares, normed_terms
from ghosted_hf.statistics.accumulate import StatisticsAccumulator
from ghosted_hf.statistics.declarations import mlp, source, target
from ghosted_hf.utils.hadamard import hadamard, rotation

C = 24


def synthetic(n: int = 3000, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """X with uneven channel scales and a few outlier tokens; Y = X A + noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, C, generator=g, dtype=torch.float64) * torch.logspace(0, 1, C, dtype=torch.float64)
    x[:5] *= 30.0
    a = torch.eye(C, dtype=torch.float64) + 0.3 * torch.randn(C, C, generator=g, dtype=torch.float64)
    y = x @ a + 0.5 * torch.randn(n, C, generator=g, dtype=torch.float64)
    return x, y


def stats_of(x: torch.Tensor, y: torch.Tensor, batches: int = 7):  # float64 partial sums: exact to lstsq
    plan = least_squares(0, 1) | StatisticsPlan.of(ABS(0), ABS(1), ROTATED_ABS(0), ROTATED_ABS(1))
    acc = StatisticsAccumulator(plan, C, partial="float64")
    for xs, ys in zip(x.chunk(batches), y.chunk(batches)):
        acc.add({source(0): xs, target(1): ys, source(1): ys})
        acc.tokens += xs.shape[0]
    return acc.result(depth=1)


def fit_boundary(stats, kind: str, s: int, e: int, ridge: float):
    return OPERATOR_KINDS[kind].fit(stats, s, e, ridge)


def residual(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> float:
    return float((x @ w - y).square().sum())


def test_ghost_solve_matches_lstsq() -> None:
    x, y = synthetic()
    stats = stats_of(x, y)
    m, eps = solve_ghost(stats.gram(0), stats.cross(0, 1), ridge=0.0)
    assert eps == 0.0
    expected = torch.linalg.lstsq(x, y - x).solution
    assert float(torch.linalg.norm(m - expected) / torch.linalg.norm(expected)) < 1e-8


def test_a_reduced_rank_map_is_the_best_of_its_rank() -> None:
    """Without ridge, the rank-r map's residual is ||Y||^2 less the r largest eigenvalues of the fitted values' Gram
    (reduced-rank regression), computed here from the tokens; no other rank-r map does better (the full map truncated
    by its own SVD, random factors); at full rank it is the least-squares map; with ridge it minimises the ridge loss
    among maps of its rank (checked against the full ridge map's truncation)."""
    x, y = synthetic()
    stats = stats_of(x, y)
    gram, cross, energy = stats.gram(0), stats.cross(0, 1), float(y.square().sum())
    full = torch.linalg.lstsq(x, y).solution
    fitted = torch.linalg.eigvalsh((x @ full).T @ (x @ full)).flip(0)
    g = torch.Generator().manual_seed(3)
    for rank in (1, 4, 12):
        down, up = reduced_rank(gram, cross, 0.0, rank)
        assert down.shape == (C, rank) and up.shape == (rank, C)
        got = residual(x, y, down @ up)
        assert abs(got - (energy - float(fitted[:rank].sum()))) < 1e-8 * energy
        u, sv, vh = torch.linalg.svd(full)
        assert got < residual(x, y, (u[:, :rank] * sv[:rank]) @ vh[:rank]) * (1 - 1e-6)
        for _ in range(5):
            other = torch.randn(C, rank, generator=g, dtype=torch.float64) @ torch.randn(rank, C, generator=g, dtype=torch.float64)
            assert got < residual(x, y, other)
    down, up = reduced_rank(gram, cross, 0.0, C)
    assert float(torch.linalg.norm(down @ up - full) / torch.linalg.norm(full)) < 1e-8
    ridge = 1.0  # relative: eps is the Gram's mean diagonal
    eps = float(gram.diagonal().mean())
    ridged = lambda a: residual(x, y, a) + eps * float(a.square().sum())
    down, up = reduced_rank(gram, cross, ridge, 4)
    a = torch.linalg.solve(gram + eps * torch.eye(C, dtype=gram.dtype), cross)
    u, sv, vh = torch.linalg.svd(a)
    assert ridged(down @ up) < ridged((u[:, :4] * sv[:4]) @ vh[:4])


def test_ghost_residual_is_below_every_other_operator() -> None:
    x, y = synthetic()
    stats = stats_of(x, y)
    ghost = fit_boundary(stats, "ghost", 0, 1, ridge=0.0)
    best = residual(x, y, ghost.operator)
    # The figures computed from statistics alone agree with the direct computation.
    assert squared_residual(stats.gram(0), stats.cross(0, 1), stats.energy(0, 1), ghost.operator) == pytest.approx(best, rel=1e-9)
    diagonal_ls = torch.diag((x * y).sum(0) / x.square().sum(0))  # the best diagonal operator
    symmetric = (ghost.operator + ghost.operator.T) / 2
    g = torch.Generator().manual_seed(3)
    random_sym = torch.randn(C, C, generator=g, dtype=torch.float64)
    others = {
        "identity": torch.eye(C, dtype=torch.float64),
        "diagonal": diagonal_ls,
        "linearpatch-diag": fit_boundary(stats, "linearpatch-diag", 0, 1, 0.0).operator,
        "linearpatch-rotate": fit_boundary(stats, "linearpatch-rotate", 0, 1, 0.0).operator,
        "symmetric part": symmetric,
        "perturbed symmetric": symmetric + 1e-3 * (random_sym + random_sym.T),
    }
    for name, w in others.items():
        assert residual(x, y, w) > best, name
    figures = ghost.figures
    assert 0 < figures["relative_residual"] < 1
    assert figures["condition_number"] > 1
    assert 0 < figures["antisymmetric_share"] < 1


def test_normed_fits_are_the_least_squares_fits_on_the_tokens() -> None:
    """`normed` solves X_e - X_s ~ n(X_s) A and `ghost-normed` ~ [X_s, n(X_s)] [M; A] exactly as lstsq on the
    tokens does; the joint fit leaves less than either term alone, and its figure is its true residual."""
    x, y = synthetic()
    # A target that depends on the token norms, which a linear map of X alone cannot follow.
    y = y + 3.0 * rms_normalized(x) @ torch.randn(C, C, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    acc = StatisticsAccumulator(least_squares(0, 1) | normed_terms(0, 1), C, partial="float64")
    for xs, ys in zip(x.chunk(7), y.chunk(7)):
        acc.add({source(0): xs, target(1): ys})
        acc.tokens += xs.shape[0]
    stats = acc.result(depth=1)
    n = rms_normalized(x)
    normed = fit_boundary(stats, "normed", 0, 1, ridge=0.0)
    assert torch.equal(normed.operator, torch.eye(C, dtype=torch.float64))
    torch.testing.assert_close(normed.normed, torch.linalg.lstsq(n, y - x).solution, rtol=1e-7, atol=1e-9)
    joint = fit_boundary(stats, "ghost-normed", 0, 1, ridge=0.0)
    both = torch.linalg.lstsq(torch.cat([x, n], 1), y - x).solution
    torch.testing.assert_close(joint.operator, torch.eye(C, dtype=torch.float64) + both[:C], rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(joint.normed, both[C:], rtol=1e-6, atol=1e-8)
    ghost = fit_boundary(stats, "ghost", 0, 1, ridge=0.0)
    untouched = residual(x, y, torch.eye(C, dtype=torch.float64))
    left = float((x @ joint.operator + n @ joint.normed - y).square().sum())
    assert joint.figures["relative_residual"] == pytest.approx(left / untouched, rel=1e-6)
    assert joint.figures["relative_residual"] < min(ghost.figures["relative_residual"],
                                                    normed.figures["relative_residual"])


def test_ridge_shrinks_toward_identity() -> None:
    x, y = synthetic()
    stats = stats_of(x, y)
    norms = [float(torch.linalg.norm(solve_ghost(stats.gram(0), stats.cross(0, 1), r)[0])) for r in (0.0, 1e-2, 1.0)]
    assert norms[0] > norms[1] > norms[2]


def test_linearpatch_diag_is_the_ratio_of_mean_magnitudes() -> None:
    x, y = synthetic()
    w = fit_boundary(stats_of(x, y), "linearpatch-diag", 0, 1, 0.0).operator
    torch.testing.assert_close(torch.diagonal(w), y.abs().mean(0) / x.abs().mean(0))
    assert torch.count_nonzero(w - torch.diag(torch.diagonal(w))) == 0


def test_unknown_operator_lists_valid_ones() -> None:
    with pytest.raises(GhostedError, match="Unknown operator 'magic'; choose one of: ghost, normed, ghost-normed, none, "
                                           "linearpatch-diag, linearpatch-rotate, replaceme-ls"):
        operator_kind("magic")


def test_every_kind_declares_what_its_fit_reads() -> None:
    """Each registry entry's `statistics` plan is exactly enough for its `fit` (statistics collected from that
    plan alone fit without a missing-statistic error), and the residual figure it reports from the statistics
    is the one its operator and transform give on the tokens themselves."""
    x, y = synthetic()
    m = x.flip(1) * 0.1  # stands in for the MLP output of the layer before the boundary
    for kind in OPERATOR_KINDS.values():
        plan = kind.statistics(1, 2)
        if not plan:  # plain pruning fits nothing
            assert kind.fit(None, 1, 2, 1e-8).operator is None
            continue
        acc = StatisticsAccumulator(plan, C, partial="float64")
        for xs, ys, ms in zip(x.chunk(5), y.chunk(5), m.chunk(5)):
            acc.add({source(1): xs, target(2): ys, source(2): ys, mlp(0): ms})
            acc.tokens += xs.shape[0]
        fit = kind.fit(acc.result(depth=2), 1, 2, 1e-8)
        assert fit.kind == kind.name
        z = x - m + m @ fit.fused if fit.fused is not None else x  # the stream after the folded MLP transform
        prediction = z @ fit.operator if fit.operator is not None else z
        if fit.normed is not None:
            prediction = prediction + rms_normalized(x) @ fit.normed
        expected = residual(prediction, y, torch.eye(C, dtype=torch.float64)) / residual(x, y, torch.eye(C, dtype=torch.float64))
        assert fit.figures["relative_residual"] == pytest.approx(expected, rel=1e-6), kind.name
        if kind.name in ("ghost", "replaceme-ls"):  # least-squares fits never do worse than leaving X_s as is
            assert fit.figures["relative_residual"] < 1.0, kind.name


@pytest.mark.parametrize("n", [12, 20, 28, 36, 64, 576, 896, 1536, 2048])
def test_hadamard_is_orthonormal(n: int) -> None:
    h = hadamard(n)
    assert h is not None
    torch.testing.assert_close(h @ h.T, torch.eye(n, dtype=torch.float64))
    assert set((h * n**0.5).round().unique().tolist()) == {-1.0, 1.0}


def test_rotation_falls_back_to_seeded_orthogonal() -> None:
    h, kind = rotation(100)
    assert kind.startswith("random-orthogonal")
    torch.testing.assert_close(h @ h.T, torch.eye(100, dtype=torch.float64))
    assert torch.equal(h, rotation(100)[0])


def test_developer_guide_worked_example_adds_an_operator_kind() -> None:
    """The developer guide's 'Adding an operator kind' snippet: one registry entry is all a new kind needs."""
    from pathlib import Path

    from tiny import build, char_tokenizer, texts

    from ghosted_hf import ghost_prune
    from ghosted_hf.options import PruneOptions

    guide = (Path(__file__).parents[1] / "docs" / "developer-guide.md").read_text()
    snippet = guide.split("### Adding an operator kind", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(snippet, "docs/developer-guide.md", "exec"), {})
    try:
        assert "diagonal-ls" in OPERATOR_KINDS
        model = ghost_prune(build("llama"), char_tokenizer(), texts(), criterion="manual", layers=[1, 3],
                            operator="diagonal-ls", seq_len=48, num_sequences=24)
        for record in model.config.ghost_boundaries:
            assert record["operator"] == "diagonal-ls" and record["fit"]["relative_residual"] < 1.0
        w = model.model.layers[1].ghost.operator
        assert torch.count_nonzero(w - torch.diag(torch.diagonal(w))) == 0
        assert PruneOptions(operator="diagonal-ls").operator == "diagonal-ls"
    finally:
        OPERATOR_KINDS.pop("diagonal-ls", None)


def test_a_fit_the_ridge_decides_is_named(caplog: pytest.LogCaptureFixture) -> None:
    """Directions of X_s with less energy than the ridge: the fit warns how many (one rule, documented)."""
    x, y = synthetic()
    x[:, -3:] = 0.0  # three channels never excited by the calibration text
    with caplog.at_level("WARNING", logger="ghosted_hf.fitting.operators"):
        fit_boundary(stats_of(x, y), "ghost", 0, 1, 1e-6)
    assert "3 of 24 directions of the calibration hidden states carry less energy than the ridge" in caplog.text
    caplog.clear()
    x, y = synthetic()
    with caplog.at_level("WARNING", logger="ghosted_hf.fitting.operators"):
        fit_boundary(stats_of(x, y), "ghost", 0, 1, 1e-6)
    assert "directions" not in caplog.text
