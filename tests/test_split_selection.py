"""Ghost-aware selection over split removals (max_blocks) and its verification by sequential fits."""

from __future__ import annotations

import itertools

import pytest

from ghosted_hf import ghost_prune
from ghosted_hf.calibration import collect_statistics
from ghosted_hf.data import batch_sequences
from ghosted_hf.errors import GhostedError
from ghosted_hf.operators import fit_figures, ghost_operator
from ghosted_hf.options import PruneOptions
from ghosted_hf.selection import (SelectionRequest, best_splits, blocks_name, block_spans, candidate_layers,
                                  candidate_spans, criterion)
from ghosted_hf.summary import render_text, summarize
from tiny import LAYERS, PAD, build, char_tokenizer, plant_identity_layers, sequences, texts

FAST = dict(seq_len=48, num_sequences=12, batch_size=6, ridge=1e-8)


def dense_stats(model, request: SelectionRequest):
    return collect_statistics(model, batch_sequences(sequences(), 3, PAD), criterion("ghost-aware").statistics(request),
                              progress=False)


def brute_force(score: dict, depth: int, n: int, max_blocks: int) -> list[tuple[float, str]]:
    """Every removal of n layers as at most max_blocks separated blocks, scored by the sum of its blocks."""
    found = []
    for layers in itertools.combinations(range(depth), n):
        blocks, start = [], layers[0]
        for a, b in zip(layers, layers[1:] + (None,)):
            if b != a + 1:
                blocks.append((start, a + 1))
                start = b
        if len(blocks) <= max_blocks:
            found.append((sum(score[span] for span in blocks), blocks_name(tuple(blocks))))
    return sorted(found)


@pytest.mark.parametrize("max_blocks", [2, 3])
def test_best_splits_is_exact_against_brute_force(max_blocks: int) -> None:
    depth, n = 9, 4
    spans = block_spans(depth, n)
    score = {span: ((7 * span[0] + 3 * span[1]) % 11) / 10 + 0.05 * (span[1] - span[0]) for span in spans}
    found = best_splits(score, depth, n, max_blocks, keep=15)
    expected = brute_force(score, depth, n, max_blocks)[:15]
    assert [round(total, 12) for total, _ in found] == [round(total, 12) for total, _ in expected]
    assert blocks_name(found[0][1]) == expected[0][1]
    assert all(sum(e - s for s, e in blocks) == n and len(blocks) <= max_blocks for _, blocks in found)


def test_one_block_reproduces_the_contiguous_choice() -> None:
    """max_blocks=1 (the default) scores exactly the contiguous spans, as the ghost-aware criterion always did."""
    model = plant_identity_layers(build("llama"), [2, 3])
    request = SelectionRequest(depth=LAYERS, num_layers=2, ridge=1e-8)
    stats = dense_stats(model, request)
    selection = criterion("ghost-aware").select(stats, request)
    reference = {f"{s}-{e - 1}": fit_figures(stats, s, e, ghost_operator(stats, s, e, 1e-8)[0])["residual_vs_target"]
                 for s, e in candidate_spans(LAYERS, 2)}
    assert selection.scores == reference
    assert selection.removed == [2, 3] and selection.max_blocks == 1
    assert "max_blocks" not in selection.describe()


@pytest.mark.parametrize("planted, max_blocks", [([1, 4], 2), ([0, 2, 4], 3)])
def test_split_removal_finds_planted_separate_blocks(planted: list[int], max_blocks: int) -> None:
    model = plant_identity_layers(build("qwen2"), planted)
    request = SelectionRequest(depth=LAYERS, num_layers=len(planted), ridge=1e-8, max_blocks=max_blocks)
    stats = dense_stats(model, request)
    selection = criterion("ghost-aware").select(stats, request)
    assert selection.removed == planted
    best = selection.ranked()[0]
    assert candidate_layers(best) == planted and selection.scores[best] < 1e-6
    # the contiguous choice is worse: no contiguous span of identity layers exists
    contiguous = criterion("ghost-aware").select(stats, SelectionRequest(depth=LAYERS, num_layers=len(planted),
                                                                         ridge=1e-8))
    assert min(contiguous.scores.values()) > 1e-3
    # one block per separate identity layer scores ~0; block scores cover every block of 1..n layers
    assert set(selection.block_scores) == {f"{s}" if e == s + 1 else f"{s}-{e - 1}"
                                           for s, e in block_spans(LAYERS, len(planted))}
    assert all(selection.block_scores[str(i)] < 1e-6 for i in planted)


def test_fewer_blocks_allowed_than_planted_cannot_reach_them() -> None:
    model = plant_identity_layers(build("qwen2"), [0, 2, 4])
    request = SelectionRequest(depth=LAYERS, num_layers=3, ridge=1e-8, max_blocks=2)
    selection = criterion("ghost-aware").select(dense_stats(model, request), request)
    assert selection.removed != [0, 2, 4] and len(selection.removed) == 3
    assert all(len(name.split(",")) <= 2 for name in selection.scores)


def test_ghost_prune_with_split_removal_and_verification_records_it() -> None:
    ghosted = ghost_prune(plant_identity_layers(build("llama"), [1, 4]), char_tokenizer(), texts(), num_layers=2,
                          max_blocks=2, verify_candidates=3, **FAST)
    assert ghosted.config.removed_layers == [1, 4]
    selection = ghosted.config.ghost_provenance["selection"]
    assert selection["max_blocks"] == 2 and len(selection["verified"]) == 3
    assert selection["verified"]["1,4"] == min(selection["verified"].values()) < 1e-6
    assert ghosted.config.ghost_provenance["options"]["max_blocks"] == 2
    assert [b["removed"] for b in ghosted.config.ghost_boundaries] == [[1], [4]]
    assert ghosted.config.ghost_boundaries[1]["fit"]["fitted_on"] == "pruned and patched model"
    text = render_text(summarize(ghosted.config))
    assert "ghost-aware, up to 2 blocks, best 3 verified" in text and "1,4 : " in text.replace("  ", " ")


def test_split_options_need_an_additive_criterion() -> None:
    with pytest.raises(GhostedError, match="need a criterion whose scores add up over blocks \\(ghost-aware\\), "
                                           "not 'streamline'"):
        PruneOptions(criterion="streamline", max_blocks=2)
    with pytest.raises(GhostedError, match="max_blocks must be positive"):
        PruneOptions(max_blocks=0)
    assert PruneOptions().max_blocks == 1 and PruneOptions().verify_candidates == 1
