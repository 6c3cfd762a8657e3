"""Layer selection on tiny models with planted structure."""

from __future__ import annotations

import pytest
from tiny import LAYERS, PAD, build, plant_identity_layers, sequences

from ghosted_hf.errors import GhostedError
from ghosted_hf.fitting.selection import (CRITERIA, SelectionRequest, candidate_layers, candidate_name, candidate_spans,
                                          criterion, locality_choice, spectral_clusters)
from ghosted_hf.statistics import collect_statistics
from ghosted_hf.text.tokens import batch_sequences


@pytest.mark.parametrize("planted", [[0, 1], [2, 3], [4, 5]])  # the first and the last span are candidates too
@pytest.mark.parametrize("name", ["ghost-aware", "streamline", "angular", "shortgpt"])
def test_each_criterion_finds_planted_identity_layers(name: str, planted: list[int]) -> None:
    model = plant_identity_layers(build("qwen2"), planted)
    request = SelectionRequest(depth=LAYERS, num_layers=2, ridge=1e-8)
    chosen = criterion(name)
    stats = collect_statistics(model, batch_sequences(sequences(), 3, PAD), chosen.statistics(request), progress=False)
    selection = chosen.select(stats, request)
    assert selection.removed == planted
    expected = [str(i) for i in range(LAYERS)] if name == "shortgpt" else [f"{s}-{s + 1}" for s in range(LAYERS - 1)]
    assert list(selection.scores) == expected


def test_candidates_names_and_errors() -> None:
    assert candidate_spans(6, 2) == [(0, 2), (1, 3), (2, 4), (3, 5), (4, 6)]
    assert candidate_spans(6, 2, first=1)[0] == (1, 3)
    assert (candidate_name(12, 20), candidate_name(7, 8)) == ("12-19", "7")
    assert (candidate_layers("12-19"), candidate_layers("7")) == (list(range(12, 20)), [7])
    assert list(CRITERIA) == ["ghost-aware", "streamline", "angular", "shortgpt", "lorp", "manual"]
    with pytest.raises(GhostedError, match="Unknown criterion 'best'; choose one of: ghost-aware, streamline"):
        criterion("best")


def test_manual_criterion_needs_no_statistics() -> None:
    request = SelectionRequest(depth=LAYERS, num_layers=0, layers=(4, 1))
    assert not criterion("manual").statistics(request)
    assert criterion("manual").select(None, request).removed == [1, 4]


def blocks(sizes: list[int], within: list[float], across: float = 0.05):
    """A layer-similarity matrix of clusters of `sizes` layers, `within` their pairwise cosine."""
    import torch

    n = sum(sizes)
    affinity = torch.full((n, n), across, dtype=torch.float64)
    start = 0
    for size, value in zip(sizes, within):
        affinity[start:start + size, start:start + size] = value
        start += size
    return affinity.fill_diagonal_(1.0)


def test_lorp_clusters_layers_and_shares_the_removal_by_redundancy() -> None:
    affinity = blocks([6, 4], [0.9, 0.5])
    assert spectral_clusters(affinity) == [list(range(6)), list(range(6, 10))]
    # redundancy beyond one layer: 5 x 0.9 = 4.5 against 3 x 0.5 = 1.5, so 3 layers split 2.25 / 0.75 -> 2 and 1
    chosen, redundancy = locality_choice(affinity, 3)
    assert sum(i < 6 for i in chosen) == 2 and sum(i >= 6 for i in chosen) == 1
    assert redundancy[0] == pytest.approx(0.9) and redundancy[9] == pytest.approx(0.5)
    affinity[7, 8] = affinity[8, 7] = 0.7  # within a cluster, the most redundant layers go first
    assert [i for i in locality_choice(affinity, 3)[0] if i >= 6] == [7]
    with pytest.raises(GhostedError, match="can give up 8 layers"):
        locality_choice(affinity, 9)


def test_lorp_removes_the_layers_asked_for_on_a_model() -> None:
    model = build("qwen2")
    request = SelectionRequest(depth=LAYERS, num_layers=2, first=1)
    chosen = criterion("lorp")
    stats = collect_statistics(model, batch_sequences(sequences(), 3, PAD), chosen.statistics(request), progress=False)
    selection = chosen.select(stats, request)
    assert len(selection.removed) == 2 and min(selection.removed) >= 1
    assert list(selection.scores) == [str(i) for i in range(1, LAYERS)] and selection.better == "higher"
