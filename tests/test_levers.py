"""Closed-form levers beyond the ghost operator: the affine operator (x W + b), the operator at the final norm's
input (norm_operator) and the one-layer lookahead refit, from the fit to the saved format."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from ghosted_hf import ghost_prune, prune_layers
from ghosted_hf.calibration import StatisticsAccumulator, StatisticsPlan, token_mask
from ghosted_hf.data import tokenize_texts
from ghosted_hf.errors import GhostedError
from ghosted_hf.files import verify_folder
from ghosted_hf.healing import target_modules
from ghosted_hf.operators import OPERATOR_KINDS, lookahead_correction
from ghosted_hf.options import PruneOptions, add_arguments, from_namespace
from ghosted_hf.summary import render_text, summarize
from ghosted_hf.surgery import export_plain
from isolated import assert_loads_with_same_logits
from tiny import HIDDEN, batch, build, char_tokenizer, plant_identity_layers, random_operator, texts

C = 16
FAST = dict(seq_len=64, num_sequences=12, batch_size=4)


def offset_data(n: int = 2000, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """X with a large mean (as a residual stream has), Y = X A + c + noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, C, generator=g, dtype=torch.float64) * torch.logspace(0, 1, C, dtype=torch.float64) + 3.0
    a = torch.eye(C, dtype=torch.float64) + 0.3 * torch.randn(C, C, generator=g, dtype=torch.float64)
    c = 2.0 * torch.randn(C, generator=g, dtype=torch.float64)
    return x, x @ a + c + 0.5 * torch.randn(n, C, generator=g, dtype=torch.float64)


def affine_stats(x: torch.Tensor, y: torch.Tensor, weighting: str = "none"):
    plan = OPERATOR_KINDS["ghost-affine"].statistics(0, 1)
    accumulator = StatisticsAccumulator(plan, C, weighting=weighting)
    for xs, ys in zip(x.chunk(5), y.chunk(5)):
        accumulator.update({0: xs, 1: ys})
    return accumulator.result(depth=1)


@pytest.mark.parametrize("weighting", ["none", "rms"])
def test_affine_fit_equals_lstsq_with_a_ones_column(weighting: str) -> None:
    x, y = offset_data()
    fit = OPERATOR_KINDS["ghost-affine"].fit(affine_stats(x, y, weighting), 0, 1, ridge=0.0)
    w = torch.ones(len(x), dtype=torch.float64) if weighting == "none" else C / x.square().sum(1)
    root = w.sqrt()[:, None]
    ones = np.ones((len(x), 1))
    expected, *_ = np.linalg.lstsq(np.hstack([x.numpy(), ones]) * root.numpy(), y.numpy() * root.numpy(), rcond=None)
    np.testing.assert_allclose(fit.operator.numpy(), expected[:C], rtol=0, atol=1e-8)
    np.testing.assert_allclose(fit.bias.numpy(), expected[C], rtol=0, atol=1e-8)
    if weighting == "none":  # the figures, from the statistics alone, agree with the direct residuals
        direct = float((x @ fit.operator + fit.bias - y).square().sum())
        untouched = float((x - y).square().sum())
        assert fit.figures["relative_residual"] == pytest.approx(direct / untouched, rel=1e-9)
        linear = OPERATOR_KINDS["ghost"].fit(affine_stats(x, y), 0, 1, ridge=0.0)
        assert fit.figures["relative_residual"] < 0.9 * linear.figures["relative_residual"]


def test_affine_ridge_shrinks_the_matrix_toward_identity_not_the_bias() -> None:
    x, y = offset_data()
    stats = affine_stats(x, y)
    strong = OPERATOR_KINDS["ghost-affine"].fit(stats, 0, 1, ridge=1e6)
    eye = torch.eye(C, dtype=torch.float64)
    assert float(torch.linalg.norm(strong.operator - eye)) < 1e-3
    # With W = I the best bias is the mean difference.
    torch.testing.assert_close(strong.bias, (y - x).mean(0), rtol=0, atol=1e-3)


def _affine_model(tmp_path: Path):
    dense = build("llama")
    model = prune_layers(dense, [1, 2], {1: random_operator(1), 6: random_operator(2)},
                         biases={1: 0.1 * torch.randn(HIDDEN), 6: 0.1 * torch.randn(HIDDEN)}, operator_kind="ghost")
    model.save_pretrained(tmp_path / "model")
    return model, tmp_path / "model"


def test_affine_and_norm_operator_apply_where_they_belong() -> None:
    torch.manual_seed(0)
    b1, bn = torch.randn(HIDDEN), torch.randn(HIDDEN)
    w1, wn = random_operator(1), random_operator(2)
    model = prune_layers(build("llama"), [1, 2], {1: w1, 6: wn}, biases={1: b1, 6: bn}, operator_kind="ghost")
    assert [(b["removed"], b["target"], b.get("bias")) for b in model.config.ghost_boundaries] == [
        ([1, 2], "layer", True), ([], "norm", True)]
    seen = {}
    model.model.layers[1].register_forward_pre_hook(lambda m, a, k: seen.update(layer=k.get("hidden_states", a[0] if a else None)), with_kwargs=True)
    reference = prune_layers(build("llama"), [1, 2])
    captured = {}
    reference.model.layers[1].register_forward_pre_hook(lambda m, a, k: captured.update(layer=k.get("hidden_states", a[0] if a else None)), with_kwargs=True)
    with torch.no_grad():
        model(**batch())
        reference(**batch())
    torch.testing.assert_close(seen["layer"], captured["layer"] @ w1 + b1)


def test_affine_norm_model_reloads_without_ghosted_hf_with_identical_logits(tmp_path: Path) -> None:
    model, folder = _affine_model(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    assert all(b["bias"] and len(b["bias_sha256"]) == 64 for b in config["ghost_boundaries"])
    assert config["ghost_boundaries"][-1]["removed"] == []
    assert set(load_file(folder / "model.safetensors")) >= {"model.layers.1.ghost.bias", "model.norm.ghost.bias"}
    verify_folder(folder)  # the verification before a push covers the biases
    out = assert_loads_with_same_logits(folder, model, batch(), tmp_path)
    assert "GhostedForCausalLM" in out


def test_checkpoint_missing_bias_fails_loudly(tmp_path: Path) -> None:
    _, folder = _affine_model(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.norm.ghost.bias"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing from the checkpoint: \['model.norm.ghost.bias'\]"):
        AutoModelForCausalLM.from_pretrained(folder)
    with pytest.raises(GhostedError, match="model.norm.ghost.bias is missing"):
        verify_folder(folder)


def test_checkpoint_altered_bias_fails_loudly(tmp_path: Path) -> None:
    _, folder = _affine_model(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.ghost.bias"][3] += 1.0
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.ghost.bias does not match the sha256"):
        AutoModelForCausalLM.from_pretrained(folder)
    with pytest.raises(GhostedError, match="does not match the bias_sha256"):
        verify_folder(folder)


def test_config_without_bias_flag_refuses_the_bias_tensor(tmp_path: Path) -> None:
    _, folder = _affine_model(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    del config["ghost_boundaries"][0]["bias"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"the config has no boundary for: \['model.layers.1.ghost.bias'\]"):
        AutoModelForCausalLM.from_pretrained(folder)


def test_norm_correction_only_where_no_boundary_feeds_the_norm(tmp_path: Path) -> None:
    with pytest.raises(GhostedError, match="only where no boundary feeds the norm"):
        prune_layers(build("llama"), [4, 5], {4: random_operator(1), 6: random_operator(2)})
    _, folder = _affine_model(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["ghost_boundaries"].insert(0, dict(config["ghost_boundaries"][-1]))  # a correction not at the end
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="do not match removed_layers"):
        AutoModelForCausalLM.from_pretrained(folder)


def test_plain_export_refuses_a_bias_clearly() -> None:
    model = prune_layers(build("llama"), [2], {2: torch.eye(HIDDEN)}, biases={2: torch.zeros(HIDDEN)})
    with pytest.raises(GhostedError, match="bias cannot be folded into a plain checkpoint"):
        export_plain(model)


def _calibration_inputs(model, module, options) -> torch.Tensor:
    """The real calibration tokens' (ghost_prune's batches) hidden states entering `module` of `model`, as the
    module sees them (after any operator of its own)."""
    data = tokenize_texts(char_tokenizer(), texts(), options.seq_len, options.num_sequences, options.batch_size)
    rows = []
    handle = module.register_forward_pre_hook(lambda m, a, k: rows.append(a[0] if a else k["hidden_states"]),
                                              with_kwargs=True)
    for b in data.batches:
        with torch.no_grad():
            model(**b)
        rows[-1] = rows[-1][token_mask(b["attention_mask"], 0)].double()
    handle.remove()
    return torch.cat(rows)


def test_norm_operator_is_the_least_squares_fit_on_the_patched_model() -> None:
    options = PruneOptions(criterion="manual", layers=[1, 2], ridge=0.0, norm_operator=True, **FAST)
    model = ghost_prune(build("llama"), char_tokenizer(), texts(), options)
    assert [b["removed"] for b in model.config.ghost_boundaries] == [[1, 2], []]
    assert model.config.ghost_provenance["norm_operator"] is True
    boundary = model.get_parameter("model.layers.1.ghost.operator").detach()
    patched = prune_layers(build("llama"), [1, 2], {1: boundary})
    x = _calibration_inputs(patched, patched.model.norm, options)
    dense = build("llama")
    y = _calibration_inputs(dense, dense.model.norm, options)
    expected = torch.linalg.lstsq(x, y).solution
    got = model.get_parameter("model.norm.ghost.operator").detach().double()
    assert float(torch.linalg.norm(got - expected) / torch.linalg.norm(expected)) < 1e-4
    record = model.config.ghost_boundaries[-1]
    assert 0 < record["fit"]["relative_residual"] < 1
    summary = summarize(model.config)
    assert "operator at the final norm's input" in summary.recovery
    assert "final norm (a correction: no layer removed there)" in render_text(summary)
    # LoRA healing targets the last kept layer too (it feeds the corrected norm input).
    assert target_modules(model, "boundary").startswith(r"model\.layers\.(0|1|3)\.")


def test_norm_operator_adds_nothing_when_a_boundary_feeds_the_norm() -> None:
    model = ghost_prune(build("llama"), char_tokenizer(), texts(), criterion="manual", layers=[4, 5],
                        norm_operator=True, **FAST)
    assert [b["removed"] for b in model.config.ghost_boundaries] == [[4, 5]]


def test_affine_prune_end_to_end_beats_linear_on_calibration() -> None:
    kwargs = dict(criterion="manual", layers=[1, 2, 4], **FAST)
    linear = ghost_prune(build("llama"), char_tokenizer(), texts(), **kwargs)
    affine = ghost_prune(build("llama"), char_tokenizer(), texts(), operator="ghost-affine", **kwargs)
    for a, b in zip(affine.config.ghost_boundaries, linear.config.ghost_boundaries):
        assert a["bias"] and "bias" not in b
        assert a["fit"]["relative_residual"] <= b["fit"]["relative_residual"] + 1e-9
    assert "affine: x W + b" in render_text(summarize(affine.config))


@pytest.mark.parametrize("mode", ["frozen-update", "linearised"])
def test_lookahead_leaves_an_exact_fit_unchanged(mode: str) -> None:
    # Layer 3 (the first kept one after the boundary) is an identity: its output matches exactly when its input
    # does, so the refit must change nothing.
    dense = plant_identity_layers(build("llama"), [3])
    options = dict(criterion="manual", layers=[1, 2], ridge=0.0, **FAST)
    plain = ghost_prune(plant_identity_layers(build("llama"), [3]), char_tokenizer(), texts(), **options)
    ahead = ghost_prune(dense, char_tokenizer(), texts(), lookahead=mode, **options)
    record = ahead.config.ghost_boundaries[0]
    assert record["fit"]["lookahead_change"] < 1e-6
    torch.testing.assert_close(ahead.get_parameter("model.layers.1.ghost.operator"),
                               plain.get_parameter("model.layers.1.ghost.operator"), rtol=0, atol=1e-5)


def test_lookahead_is_one_closed_form_refit_on_the_first_kept_layer_output() -> None:
    # On the model patched with W: u = X W enters kept layer 3, z leaves it; holding the layer's update z - u, the
    # output matches the dense X_4 when u R = X_4 - z + u: W' = W R.
    options = PruneOptions(criterion="manual", layers=[1, 2], ridge=0.0, **FAST)
    first = ghost_prune(build("llama"), char_tokenizer(), texts(), options)
    w = first.get_parameter("model.layers.1.ghost.operator").detach().double()
    ahead = ghost_prune(build("llama"), char_tokenizer(), texts(), options, lookahead="frozen-update")
    assert ahead.config.ghost_provenance["lookahead"] == "frozen-update"
    patched = prune_layers(build("llama"), [1, 2], {1: w})
    u = _calibration_inputs(patched, patched.model.layers[1], options)
    z = _calibration_inputs(patched, patched.model.layers[2], options)
    dense = build("llama")
    target = _calibration_inputs(dense, dense.model.layers[4], options)
    r = torch.linalg.lstsq(u, target - z + u).solution
    got = ahead.get_parameter("model.layers.1.ghost.operator").detach().double()
    assert float(torch.linalg.norm(got - w @ r) / torch.linalg.norm(w @ r - w)) < 1e-3
    assert ahead.config.ghost_boundaries[0]["fit"]["lookahead_change"] > 0.01


@pytest.mark.parametrize("flag", [dict(norm_operator=True), dict(lookahead="linearised")])
def test_levers_need_a_retargetable_kind(flag: dict) -> None:
    with pytest.raises(GhostedError, match=f"{next(iter(flag))} refits the operator .* use one of: ghost, ghost-affine"):
        PruneOptions(operator="linearpatch-diag", **flag)


def test_levers_are_command_line_flags() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser, PruneOptions)
    options = from_namespace(PruneOptions, parser.parse_args(["--operator", "ghost-affine", "--norm-operator",
                                                               "--lookahead", "linearised"]))
    assert (options.operator, options.norm_operator, options.lookahead) == ("ghost-affine", True, "linearised")


def test_card_describes_the_bias_and_the_norm_correction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util
    import sys

    from ghosted_hf.card import build_card

    # This checkout's template, whichever ghosted_hf is installed (an editable install may map another checkout's).
    root = Path(__file__).resolve().parent.parent / "model_cards"
    spec = importlib.util.spec_from_file_location("ghosted_hf.model_cards", root / "__init__.py",
                                                  submodule_search_locations=[str(root)])
    monkeypatch.setitem(sys.modules, "ghosted_hf.model_cards", importlib.util.module_from_spec(spec))
    model, _ = _affine_model(tmp_path)
    text = str(build_card(model.config))
    assert "affine boundaries also hold `...ghost.bias`" in text
    assert "| [] | final norm (a correction: no layer removed there) | ghost, affine: x W + b |" in text
    assert "corrects the final norm's input" in text


@pytest.mark.parametrize("affine", [False, True])
def test_linearised_lookahead_is_exact_for_a_linear_layer(affine: bool) -> None:
    # A layer z = u A (+ a): the output target Y = (u B + b) A (+ a) is reached exactly by R = B (c = b); the
    # frozen-update step, which ignores how the layer maps a change of its input, is not exact.
    g = torch.Generator().manual_seed(0)
    u = torch.randn(800, C, generator=g, dtype=torch.float64) + (2.0 if affine else 0.0)
    a = torch.eye(C, dtype=torch.float64) + 0.4 * torch.randn(C, C, generator=g, dtype=torch.float64)
    b_matrix = torch.eye(C, dtype=torch.float64) + 0.2 * torch.randn(C, C, generator=g, dtype=torch.float64)
    shift = torch.randn(C, generator=g, dtype=torch.float64) if affine else torch.zeros(C, dtype=torch.float64)
    offset = torch.randn(C, generator=g, dtype=torch.float64) if affine else torch.zeros(C, dtype=torch.float64)
    z, y = u @ a + offset, (u @ b_matrix + shift) @ a + offset
    sums = (u.sum(0), z.sum(0), y.sum(0), float(len(u))) if affine else None
    results = {mode: lookahead_correction(u.T @ u, u.T @ z, u.T @ y, 0.0, mode, sums)
               for mode in ("linearised", "frozen-update")}
    r, c = results["linearised"]
    torch.testing.assert_close(r, b_matrix, rtol=0, atol=1e-8)
    if affine:
        torch.testing.assert_close(c, shift, rtol=0, atol=1e-8)
    assert float(torch.linalg.norm(results["frozen-update"][0] - b_matrix)) > 0.1


def test_layerwise_pass_gives_the_affine_sums_and_refuses_a_sequential_affine_fit(tmp_path: Path) -> None:
    from ghosted_hf.calibration import collect_statistics
    from ghosted_hf.data import batch_sequences
    from ghosted_hf.layerwise import LayerwiseModel
    from tiny import PAD, sequences

    model = build("llama")
    model.save_pretrained(tmp_path / "model")
    plan = StatisticsPlan(grams=frozenset({1}), sums=frozenset({(1, 3), (2, 6)}))
    batches = batch_sequences(sequences(), 4, PAD)
    full = collect_statistics(model, batches, plan, progress=False)
    lazy = collect_statistics(LayerwiseModel(tmp_path / "model"), batches, plan, progress=False)
    assert set(full.tensors) == set(lazy.tensors) == {"gram.1", "sum.1", "count.1", "sum_target.1.3", "sum.2",
                                                      "count.2", "sum_target.2.6"}
    for key, value in full.tensors.items():
        torch.testing.assert_close(lazy.tensors[key], value, rtol=1e-10, atol=1e-9, msg=key)
    assert float(full.tensors["count.1"]) == full.tokens
    with pytest.raises(GhostedError, match="cannot refit 'ghost-affine' sequentially"):
        ghost_prune(LayerwiseModel(tmp_path / "model"), char_tokenizer(), texts(), criterion="manual", layers=[1, 3],
                    operator="ghost-affine", **FAST)


def test_plain_export_folds_a_norm_correction_too() -> None:
    from ghosted_hf.recipe import plain_export

    model = ghost_prune(build("llama"), char_tokenizer(), texts(), criterion="manual", layers=[1, 2], norm_operator=True,
                        **FAST)
    plain = plain_export(model, char_tokenizer(), texts(), operator="folded", **FAST)
    boundaries = plain.config.ghost_provenance["plain_export"]["boundaries"]
    assert [b["removed"] for b in boundaries] == [[1, 2], []]
    assert boundaries[-1]["fused_into"] == "model.layers.3.mlp.down_proj"  # the last kept layer feeds the norm
    assert type(plain).__name__ == "LlamaForCausalLM"
    assert "final norm (a correction" in render_text(summarize(plain.config))
    with torch.no_grad():
        assert torch.isfinite(plain(**batch()).logits).all()
