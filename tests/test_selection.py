"""Layer selection on tiny models with planted structure."""

from __future__ import annotations

import pytest

from ghosted_hf.calibration import collect_statistics
from ghosted_hf.data import batch_sequences
from ghosted_hf.selection import candidate_blocks, select_layers, selection_plan
from test_calibration import sequences
from tiny import LAYERS, PAD, build, plant_identity_layers


@pytest.mark.parametrize("planted", [[0, 1], [2, 3], [4, 5]])  # the first and the last block are candidates too
@pytest.mark.parametrize("criterion", ["ghost-aware", "streamline", "angular", "shortgpt"])
def test_each_criterion_finds_planted_identity_layers(criterion: str, planted: list[int]) -> None:
    model = plant_identity_layers(build("qwen2"), planted)
    plan = selection_plan(criterion, 2, LAYERS)
    stats = collect_statistics(model, batch_sequences(sequences(), 3, PAD), plan, progress=False)
    selection = select_layers(stats, criterion, 2, ridge=1e-8)
    assert selection.removed == planted
    assert len(selection.scores) == (LAYERS if criterion == "shortgpt" else LAYERS - 1)


def test_candidates_and_errors() -> None:
    assert candidate_blocks(6, 2) == [(0, 2), (1, 3), (2, 4), (3, 5), (4, 6)]
    assert candidate_blocks(6, 2, first=1)[0] == (1, 3)
    with pytest.raises(ValueError, match="Unknown criterion 'best'; choose one of: ghost-aware, streamline"):
        selection_plan("best", 2, 6)
