"""Local distillation (healing's first phase): where its runs start and stop, that it trains only the layers it runs
and the operators toward the dense states, and what it refuses."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from tiny import build, char_tokenizer, texts

from ghosted_hf import ghost_prune
from ghosted_hf.pipelines.healing import HealOptions, heal
from ghosted_hf.pipelines.healing.local import LocalRun, dense_states, distill_locally, local_loss, local_runs
from ghosted_hf.pipelines.healing.recipe import _lora
from ghosted_hf.text.tokens import tokenize_texts

FAST = dict(seq_len=48, num_sequences=24)


def config(**fields) -> SimpleNamespace:
    return SimpleNamespace(**{"original_num_hidden_layers": 10, "removed_layers": [2, 3, 7], "ghost_subblocks": [
        {"layer": 0, "block": "mlp"}], "ghost_boundaries": [{"layer": 2, "target": "layer", "removed": [2, 3]},
                                                          {"layer": 5, "target": "layer", "removed": [7]}], **fields})


def test_runs_start_at_each_boundary_and_sub_block_and_an_overlapping_start_extends_a_run() -> None:
    # kept dense layers 0 1 4 5 6 8 9, the final norm (10) at pruned index 7
    assert local_runs(config(), 2) == [LocalRun(0, 0, ((2, 4),)), LocalRun(2, 2, ((4, 6),)), LocalRun(5, 7, ((7, 10),))]
    assert local_runs(config(), 3) == [LocalRun(0, 0, ((3, 5), (5, 8))), LocalRun(5, 7, ((7, 10),))]
    ends = config(removed_layers=[8, 9], ghost_subblocks=[],
                  ghost_boundaries=[{"layer": None, "target": "norm", "removed": [8, 9]}])
    with pytest.raises(ValueError, match="neither .*feeds the final norm.*local_layers at 0"):
        local_runs(ends, 2)


def pruned():
    return ghost_prune(build("llama"), char_tokenizer(), texts(), criterion="manual", layers=[2, 3], **FAST)


def measured(model, dense, ids, runs) -> float:
    with torch.no_grad():
        return float(local_loss(model, ids, runs, dense_states(dense, ids, runs, 4, progress=False)))


def test_the_local_phase_trains_the_run_s_layers_and_the_operator_toward_the_dense_states() -> None:
    dense, model = build("llama"), pruned()
    ids = tokenize_texts(char_tokenizer(), texts(), 48, batch_size=4).batches[0]["input_ids"]
    sequences = torch.cat([b["input_ids"] for b in tokenize_texts(char_tokenizer(), texts(), 48, batch_size=4).batches])
    options = HealOptions(local_layers=1, local_steps=40, local_sequences=16, seq_len=48, learning_rate=5e-3)
    runs = local_runs(model.config, 1)
    assert runs == [LocalRun(2, 2, ((3, 5),))]  # the boundary after dense layers 2-3 feeds pruned layer 2
    operator = model.model.layers[2].ghost.operator.detach().clone()
    before = measured(model, dense, ids, runs)
    peft_model = _lora(model, options)
    losses = distill_locally(peft_model, dense, sequences, options, "fp32", progress=False)
    assert len(losses) == 40 and measured(model, dense, ids, runs) < 0.7 * before
    assert not torch.equal(model.model.layers[2].ghost.operator, operator)  # trained here ...
    assert not model.model.layers[2].ghost.operator.requires_grad  # ... and frozen again for the global phase
    moved = {int(re.search(r"layers\.(\d+)\.", n)[1]) for n, p in peft_model.named_parameters()
             if "lora_B" in n and p.abs().sum() > 0}
    assert moved == {2}  # only the run's layer: the others are not run


def test_heal_runs_the_local_phase_first_and_records_it() -> None:
    dense = build("llama")
    healed = heal(pruned(), char_tokenizer(), texts(), teacher=dense, local_layers=2, local_steps=5,
                  local_sequences=4, max_steps=1, seq_len=48, progress=False)  # one batch: every step sees it
    first, last = healed.record["local_loss"]
    assert last < first and healed.record["local_layers"] == 2 and healed.record["local_steps"] == 5


@pytest.mark.parametrize("override, message", [
    (dict(local_layers=-1), "local_layers must be 0 (no local phase) or more, got -1"),
    (dict(local_layers=2, local_steps=0), "local_steps must be positive, got 0"),
    (dict(local_layers=2, local_sequences=0), "local_sequences must be positive, got 0"),
])
def test_bad_local_options_are_refused(override: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        heal(pruned(), char_tokenizer(), texts(), progress=False, **override)


def test_a_stock_export_and_a_resumed_run_are_refused(tmp_path) -> None:
    stock = ghost_prune(build("llama"), char_tokenizer(), texts(), criterion="manual", layers=[2, 3],
                        operator="folded", **FAST)
    with pytest.raises(ValueError, match="local_layers needs a ghosted model"):
        heal(stock, char_tokenizer(), texts(), local_layers=2, progress=False)
    with pytest.raises(ValueError, match="A run with local_layers cannot be resumed"):
        heal(pruned(), char_tokenizer(), texts(), local_layers=2, resume="last", checkpoints=tmp_path, progress=False)


def test_a_pool_of_dense_states_that_does_not_fit_is_refused_before_the_pass(monkeypatch) -> None:
    dense = build("llama")
    ids = torch.zeros(16, 48, dtype=torch.long)
    runs = [LocalRun(2, 2, ((3, 5),))]  # two states: dense inputs of layers 2 and 5
    needed = 2 * 16 * 48 * dense.config.hidden_size * 2  # bytes in bf16
    monkeypatch.setattr("ghosted_hf.utils.memory.available_bytes", lambda: needed)  # half of it is free
    calls = []
    monkeypatch.setattr("ghosted_hf.pipelines.healing.local.capture_hidden_states", lambda *a: calls.append(a))
    with pytest.raises(ValueError, match=r"2 hidden states of 16 sequences .*lower local_sequences \(at most 8 fit\)"):
        dense_states(dense, ids, runs, 4, progress=False)
    assert not calls  # refused before any forward
    monkeypatch.undo()  # the machine's own memory: the pool fits
    assert set(dense_states(dense, ids, runs, 4, progress=False)) == {2, 5}
