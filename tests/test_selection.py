"""Layer selection on tiny models with planted structure."""

from __future__ import annotations

import pytest

from ghosted_hf.statistics import collect_statistics
from ghosted_hf.data import batch_sequences
from ghosted_hf.errors import GhostedError
from ghosted_hf.selection import CRITERIA, SelectionRequest, candidate_layers, candidate_name, candidate_spans, criterion
from tiny import LAYERS, PAD, build, plant_identity_layers, sequences


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
    assert list(CRITERIA) == ["ghost-aware", "streamline", "angular", "shortgpt", "manual"]
    with pytest.raises(GhostedError, match="Unknown criterion 'best'; choose one of: ghost-aware, streamline"):
        criterion("best")


def test_manual_criterion_needs_no_statistics() -> None:
    request = SelectionRequest(depth=LAYERS, num_layers=0, layers=(4, 1))
    assert not criterion("manual").statistics(request)
    assert criterion("manual").select(None, request).removed == [1, 4]
