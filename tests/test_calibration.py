"""Streaming statistics on tiny models: exactness, padding, truncation, errors, offload, files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from ghosted_hf.calibration import CalibrationStatistics, StatisticsPlan, collect_statistics
from ghosted_hf.errors import GhostedError
from ghosted_hf.data import batch_sequences
from tiny import LAYERS, PAD, build, sequences

PLAN = StatisticsPlan(
    grams=frozenset({0, 2}),
    pairs=frozenset({(0, 3), (2, 6)}),
    cosines=frozenset({(1, 2), (2, 6)}),
    abs_sums=frozenset({2, 6}),
    rotated_abs_sums=frozenset({2}),
    mlp_terms=frozenset({(2, 4)}),
)


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float(torch.linalg.norm(got - expected) / torch.linalg.norm(expected))


def in_memory(model, seqs: list[list[int]]) -> dict[str, torch.Tensor]:
    """Reference: all activations in memory, one sequence at a time (no padding), then the sums."""
    inputs: dict[int, list[torch.Tensor]] = {i: [] for i in range(LAYERS + 1)}
    mlp_out: list[torch.Tensor] = []
    hooks = [model.model.layers[i].register_forward_pre_hook(
        lambda m, a, k, i=i: inputs[i].append(a[0][0] if a else k["hidden_states"][0]), with_kwargs=True)
        for i in range(LAYERS)]
    hooks.append(model.model.norm.register_forward_pre_hook(lambda m, a: inputs[LAYERS].append(a[0][0])))
    hooks.append(model.model.layers[1].mlp.register_forward_hook(lambda m, a, o: mlp_out.append(o[0])))
    with torch.no_grad():
        for seq in seqs:
            model(torch.tensor([seq]))
    for h in hooks:
        h.remove()
    x = {i: torch.cat(v).double() for i, v in inputs.items()}
    m = torch.cat(mlp_out).double()
    cos = lambda a, b: torch.nn.functional.cosine_similarity(a, b, dim=1)
    return {
        "gram.0": x[0].T @ x[0], "gram.2": x[2].T @ x[2], "cross.0.3": x[0].T @ x[3], "cross.2.6": x[2].T @ x[6],
        "energy.2.6": x[6].square().sum().reshape(1), "cos.1.2": cos(x[1], x[2]).sum().reshape(1),
        "abs.6": x[6].abs().sum(0), "mlp_gram.2": m.T @ m, "mlp_source.2": m.T @ x[2], "mlp_target.2.4": m.T @ x[4],
    }


def test_streaming_equals_in_memory_and_padding_is_excluded() -> None:
    model = build("llama")
    seqs = sequences()
    reference = in_memory(model, seqs)
    # One sequence per batch: the same float32 activations, so only float64 summation order differs.
    # Four per batch (right-padded): float32 kernels on other shapes differ in the last bits.
    for batch_size, tolerance in ((1, 1e-12), (4, 1e-5)):
        stats = collect_statistics(model, batch_sequences(seqs, batch_size, PAD), PLAN, progress=False)
        assert stats.tokens == sum(map(len, seqs))
        for key, expected in reference.items():
            assert relative_error(stats.tensors[key], expected) < tolerance, (batch_size, key)


def test_pad_token_ids_do_not_change_statistics() -> None:
    model = build("qwen2")
    batches = batch_sequences(sequences(), 3, PAD)
    first = collect_statistics(model, batches, PLAN, progress=False)
    for b in batches:
        b["input_ids"][b["attention_mask"] == 0] = 77  # other ids under the mask
    second = collect_statistics(model, batches, PLAN, progress=False)
    for key in first.tensors:
        assert torch.equal(first.tensors[key], second.tensors[key]), key


def test_pass_stops_after_deepest_needed_layer() -> None:
    model = build("llama")
    calls = []
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(lambda m, a, o, i=i: calls.append(i))
    plan = StatisticsPlan(grams=frozenset({1}), pairs=frozenset({(1, 3)}))
    collect_statistics(model, batch_sequences(sequences(), 2, PAD), plan, progress=False)
    assert set(calls) == {0, 1, 2}  # layer 3 is never run: its input is the deepest statistic
    assert plan.deepest() == 3


def test_non_finite_activations_name_the_layer() -> None:
    model = build("llama")
    with torch.no_grad():
        model.model.layers[2].mlp.down_proj.weight[0, 0] = float("inf")
    plan = StatisticsPlan(grams=frozenset({1, 4}))
    with pytest.raises(FloatingPointError, match="the input of layer 3"):
        collect_statistics(model, batch_sequences(sequences(), 2, PAD), plan, progress=False)


def test_skip_first_tokens_masks_leading_positions() -> None:
    model = build("llama")
    seqs = sequences()
    plan = StatisticsPlan(grams=frozenset({0}))
    stats = collect_statistics(model, batch_sequences(seqs, 3, PAD), plan, skip_first_tokens=2, progress=False)
    assert stats.tokens == sum(len(s) - 2 for s in seqs)
    embed = model.model.embed_tokens.weight.double()
    x = torch.cat([embed[torch.tensor(s[2:])] for s in seqs])
    torch.testing.assert_close(stats.gram(0), x.T @ x)


def test_statistics_file_round_trip(tmp_path: Path) -> None:
    model = build("qwen3")
    stats = collect_statistics(model, batch_sequences(sequences(), 2, PAD), PLAN, progress=False)
    stats.save(tmp_path / "stats.safetensors")
    loaded = CalibrationStatistics.load(tmp_path / "stats.safetensors")
    assert (loaded.tokens, loaded.depth, loaded.hidden_size) == (stats.tokens, stats.depth, stats.hidden_size)
    assert loaded.rotation_kind == "hadamard"
    assert set(loaded.tensors) == set(stats.tensors)
    for key in stats.tensors:
        assert torch.equal(loaded.tensors[key], stats.tensors[key])


def test_statistics_with_disk_offloaded_model(tmp_path: Path) -> None:
    model = build("llama")
    batches = batch_sequences(sequences(), 3, PAD)
    expected = collect_statistics(model, batches, PLAN, progress=False)
    model.save_pretrained(tmp_path / "dense")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.layers.2": "disk", "model.layers.3": "cpu", "model.layers.4": "disk", "model.layers.5": "cpu",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    offloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "dense", device_map=device_map,
                                                     offload_folder=tmp_path / "offload")
    assert any(p.device.type == "meta" for p in offloaded.parameters())
    got = collect_statistics(offloaded, batches, PLAN, device="cpu", progress=False)
    for key in expected.tensors:
        assert relative_error(got.tensors[key], expected.tensors[key]) < 1e-12, key


def test_unknown_weighting_and_mlp_terms_at_layer_zero_are_refused() -> None:
    with pytest.raises(GhostedError, match="Unknown token weighting 'cube'; choose one of: none, rms"):
        collect_statistics(build("llama"), batch_sequences(sequences(), 2, PAD), PLAN, weighting="cube", progress=False)
    with pytest.raises(GhostedError, match="MLP terms need a layer before the source index"):
        StatisticsPlan(mlp_terms=frozenset({(0, 2)}))


def test_plans_combine_and_know_what_is_missing() -> None:
    a = StatisticsPlan(grams=frozenset({1}), pairs=frozenset({(1, 3)}))
    b = StatisticsPlan(grams=frozenset({2}), abs_sums=frozenset({1, 3}))
    union = a | b
    assert union == StatisticsPlan(grams=frozenset({1, 2}), pairs=frozenset({(1, 3)}), abs_sums=frozenset({1, 3}))
    assert StatisticsPlan.union([a, b]) == union and not StatisticsPlan()
    stats = collect_statistics(build("llama"), batch_sequences(sequences(), 2, PAD), a, progress=False)
    assert set(stats.tensors) == {"gram.1", "cross.1.3", "energy.1.3"}
    assert union.missing_from(stats) == StatisticsPlan(grams=frozenset({2}), abs_sums=frozenset({1, 3}))
    assert not a.missing_from(stats)
    at_source, rest = union.split_at(1)
    assert at_source == StatisticsPlan(grams=frozenset({1}), pairs=frozenset({(1, 3)}), abs_sums=frozenset({1}))
    assert rest == StatisticsPlan(grams=frozenset({2}), abs_sums=frozenset({3}))


def test_calibration_runs_in_eval_mode_and_restores_the_mode() -> None:
    dropout = build("llama", attention_dropout=0.5)
    batches = batch_sequences(sequences(), 3, PAD)
    expected = collect_statistics(dropout, batches, PLAN, progress=False)
    dropout.train()
    got = collect_statistics(dropout, batches, PLAN, progress=False)
    assert dropout.training and all(m.training for m in dropout.modules())
    for key in expected.tensors:
        assert torch.equal(got.tensors[key], expected.tensors[key]), key


def test_a_batch_activations_are_freed_before_the_next_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Peak memory must not be two batches' activations from the second batch on: nothing captured for
    one batch may still be alive when the next batch's forward starts."""
    import weakref

    from ghosted_hf import calibration

    model = build("llama")
    captured: list[weakref.ref] = []
    capture = calibration.capture_hidden_states

    def recording(*args, **kwargs):
        got = capture(*args, **kwargs)
        captured.extend(weakref.ref(t) for t in got.values())
        return got

    alive_at_start: list[int] = []
    model.model.layers[0].register_forward_pre_hook(
        lambda m, a: alive_at_start.append(sum(ref() is not None for ref in captured)))
    monkeypatch.setattr(calibration, "capture_hidden_states", recording)
    collect_statistics(model, batch_sequences(sequences(), 2, PAD), PLAN, progress=False)
    assert len(alive_at_start) >= 3 and captured
    assert alive_at_start == [0] * len(alive_at_start)
