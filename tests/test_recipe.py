"""ghost_prune end to end on tiny models: fitting modes, fused export, statistics reuse, bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from isolated import assert_loads_with_same_logits
from tiny import EOS, LAYERS, build, char_tokenizer, kl_to_dense, texts

from ghosted_hf import GhostedForCausalLM, PruneOptions, ghost_prune, to_stock_model
from ghosted_hf.errors import GhostedError
from ghosted_hf.fitting.selection import SelectionRequest, candidate_name, criterion
from ghosted_hf.statistics import CalibrationStatistics, collect_statistics
from ghosted_hf.text.tokens import tokenize_texts

FAST = dict(seq_len=48, num_sequences=24, batch_size=6)


def final_hidden(model, batches) -> torch.Tensor:
    """Input of the final norm on all real tokens."""
    out = []
    handle = model.model.norm.register_forward_pre_hook(lambda m, a: out.append(a[0]))
    with torch.no_grad():
        for b in batches:
            model(**b)
            out[-1] = out[-1][b["attention_mask"].bool()]
    handle.remove()
    return torch.cat(out)


def held_out(tokenizer, count: int = 6):
    return tokenize_texts(tokenizer, texts(count, seed=99), 48, batch_size=3).batches


@pytest.mark.slow
def test_ghost_prune_end_to_end_beats_plain_pruning_and_reloads(tmp_path: Path) -> None:
    tokenizer = char_tokenizer()
    dense = build("qwen3")
    ghosted = ghost_prune(build("qwen3"), tokenizer, texts(), num_layers=2, **FAST)
    plain = ghost_prune(build("qwen3"), tokenizer, texts(), num_layers=2, operator="none", **FAST)
    report = ghosted.config.ghost_provenance
    # Plain pruning is a stock checkpoint: its layout travels in the provenance.
    assert plain.config.model_type == "qwen3"
    assert (ghosted.config.removed_layers == plain.config.ghost_provenance["stock_export"]["removed_layers"]
            == report["selection"]["removed"])
    assert report["calibration"]["tokens"] == 24 * 48 and len(report["calibration"]["sha256"]) == 64
    assert report["versions"]["transformers"] and report["solver"]["ridge"] == PruneOptions().ridge
    assert ghosted.config.ghost_boundaries[0]["fit"]["relative_residual"] < 1.0

    batches = held_out(tokenizer)
    assert kl_to_dense(dense, ghosted, batches) < 0.7 * kl_to_dense(dense, plain, batches)

    ghosted.save_pretrained(tmp_path / "model")
    saved = json.loads((tmp_path / "model" / "config.json").read_text())
    assert saved["ghost_provenance"]["selection"]["removed"] == ghosted.config.removed_layers
    assert "LOADED transformers_modules" in assert_loads_with_same_logits(tmp_path / "model", ghosted, batches[0], tmp_path)


def test_sequential_fitting_beats_independent_with_several_boundaries() -> None:
    tokenizer = char_tokenizer()
    removed = [1, 3]  # two boundaries
    options = dict(criterion="manual", layers=removed, **FAST)
    sequential = ghost_prune(build("llama"), tokenizer, texts(), fitting="sequential", **options)
    independent = ghost_prune(build("llama"), tokenizer, texts(), fitting="independent", **options)
    # The first boundary is the same fit; the second sees the patched model's hidden state.
    assert torch.equal(sequential.model.layers[1].ghost.operator, independent.model.layers[1].ghost.operator)
    assert not torch.equal(sequential.model.layers[2].ghost.operator, independent.model.layers[2].ghost.operator)
    passes = sequential.config.ghost_provenance["cost"]["passes"]
    assert [p["sequential"] for p in passes] == [False, True]

    calibration = tokenize_texts(tokenizer, texts(), FAST["seq_len"], FAST["num_sequences"], FAST["batch_size"]).batches
    target = final_hidden(build("llama"), calibration)
    error = {name: float((final_hidden(m, calibration) - target).square().sum())
             for name, m in (("sequential", sequential), ("independent", independent))}
    assert error["sequential"] < error["independent"]


def test_the_provenance_records_the_fitting_each_boundary_had() -> None:
    """Asked for sequential fitting, replaceme-ls is fitted on the dense model (it cannot be refitted on a patched
    stream): the record, inspect and the card say independent; the ghost kind's second boundary is sequential."""
    from ghosted_hf.io.summary import render_text, summarize

    two = dict(criterion="manual", layers=[1, 3], **FAST)
    stock = ghost_prune(build("llama"), char_tokenizer(), texts(), operator="replaceme-ls", **two)
    assert stock.config.ghost_provenance["options"]["fitting"] == "sequential"
    assert stock.config.ghost_provenance["fitting"] == "independent"
    assert "recovery        : replaceme-ls, independent fitting" in render_text(summarize(stock.config))
    ghost = ghost_prune(build("llama"), char_tokenizer(), texts(), **two)
    assert [b["fit"]["fitted_on"] for b in ghost.config.ghost_boundaries] == ["dense model", "pruned and patched model"]
    assert "recovery        : ghost, sequential fitting" in render_text(summarize(ghost.config))
    plain = ghost_prune(build("llama"), char_tokenizer(), texts(), operator="none", **two)
    assert "recovery        : none, no fit" in render_text(summarize(plain.config))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_replaceme_fused_export_is_a_stock_checkpoint(arch: str, tmp_path: Path) -> None:
    tokenizer = char_tokenizer()
    plain = ghost_prune(build(arch), tokenizer, texts(), num_layers=2, operator="replaceme-ls", **FAST)
    assert type(plain).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    layout = plain.config.ghost_provenance["stock_export"]
    record = layout["boundaries"][0]
    assert layout["removed_layers"][0] >= 1 and record["fused_into"].endswith("mlp.down_proj")
    assert record["fit"]["relative_residual"] < 1.0 and layout["folded_operators"] == 0
    plain.save_pretrained(tmp_path / "plain")
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert config["model_type"] == arch and "auto_map" not in config
    assert not list((tmp_path / "plain").glob("*.py"))

    out = assert_loads_with_same_logits(tmp_path / "plain", plain, held_out(tokenizer)[0], tmp_path,
                                        trust_remote_code=False, atol=1e-5)
    assert "LOADED transformers.models" in out


def test_to_stock_model_refuses_real_operators() -> None:
    ghosted = ghost_prune(build("llama"), char_tokenizer(), texts(), num_layers=2, **FAST)
    with pytest.raises(ValueError, match="is not a scaled rotation c Q"):
        to_stock_model(ghosted)


def test_linearpatch_baselines_run_and_never_beat_the_least_squares_fit() -> None:
    """The LinearPatch baselines are restricted maps (a scaling, in a Hadamard basis for -rotate): on the same span
    their recorded residual is at least the ghost fit's, the unrestricted least-squares optimum."""
    fits = {}
    for operator in ("ghost", "linearpatch-diag", "linearpatch-rotate"):
        ghosted = ghost_prune(build("llama"), char_tokenizer(), texts(), criterion="shortgpt", num_layers=2,
                              operator=operator, **FAST)
        (record,) = ghosted.config.ghost_boundaries
        assert record["operator"] == operator
        fits[operator] = (tuple(record["removed"]), record["fit"])
    spans = {span for span, _ in fits.values()}
    assert len(spans) == 1  # shortgpt chose the same layers for each
    best = fits["ghost"][1]["residual_vs_target"]
    for operator in ("linearpatch-diag", "linearpatch-rotate"):
        fit = fits[operator][1]
        assert math.isfinite(fit["residual_vs_target"]) and fit["residual_vs_target"] >= best - 1e-12, (operator, fit)
    assert fits["linearpatch-rotate"][1]["rotation"] == "hadamard"


def test_normed_kinds_prune_select_by_their_own_fit_and_refuse_a_stock_export() -> None:
    """`normed` and `ghost-normed` give a 1.1 ghosted model whose boundary has both tensors; ghost-aware selection
    scores each span by the kind's own residual (the joint fit never leaves more than the ghost fit at a span), a
    sequential second boundary refits on the patched stream, and the stock paths refuse the normed term."""
    from ghosted_hf import export_stock
    from ghosted_hf.fitting.operators import operator_kind

    tokenizer = char_tokenizer()
    ghost = ghost_prune(build("llama"), tokenizer, texts(), num_layers=2, **FAST)
    for kind in ("normed", "ghost-normed"):
        model = ghost_prune(build("llama"), tokenizer, texts(), num_layers=2, operator=kind, **FAST)
        assert model.config.ghost_format_version == "1.1"
        (record,) = model.config.ghost_boundaries
        assert record["operator"] == kind and record["normed"] and 0 < record["fit"]["relative_residual"] < 1
        parent = f"model.layers.{record['layer']}" if record["target"] == "layer" else "model.norm"
        assert set(model.ghost_operators()) == {f"{parent}.ghost.operator", f"{parent}.ghost.normed"}
        scores = model.config.ghost_provenance["selection"]["scores"]
        assert min(scores, key=scores.get) == candidate_name(record["removed"][0], record["removed"][-1] + 1)
        if kind == "ghost-normed":
            ghost_scores = ghost.config.ghost_provenance["selection"]["scores"]
            assert all(scores[name] <= ghost_scores[name] + 1e-12 for name in scores)
        with pytest.raises(GhostedError, match="has a normed term"):
            to_stock_model(model)
        with pytest.raises(GhostedError, match="have a normed term, which export_stock cannot imitate"):
            export_stock(model, tokenizer, texts(), **FAST)
    assert operator_kind("normed").sequential
    two = ghost_prune(build("llama"), tokenizer, texts(), criterion="manual", layers=[1, 4], operator="ghost-normed",
                      **FAST)
    assert [b["fit"]["fitted_on"] for b in two.config.ghost_boundaries] == ["dense model", "pruned and patched model"]


def test_saved_statistics_replace_the_calibration_pass(tmp_path: Path) -> None:
    tokenizer = char_tokenizer()
    data = tokenize_texts(tokenizer, texts(), FAST["seq_len"], FAST["num_sequences"], FAST["batch_size"])
    plan = (criterion("ghost-aware").statistics(SelectionRequest(depth=LAYERS, num_layers=2))
            | criterion("ghost-aware").statistics(SelectionRequest(depth=LAYERS, num_layers=3)))
    collect_statistics(build("llama"), data.batches, plan, progress=False).save(tmp_path / "stats.safetensors")
    for n in (2, 3):  # several numbers of removed layers from one file, no calibration text
        from_file = ghost_prune(build("llama"), statistics=tmp_path / "stats.safetensors", num_layers=n)
        from_text = ghost_prune(build("llama"), tokenizer, texts(), num_layers=n, **FAST)
        assert from_file.config.removed_layers == from_text.config.removed_layers
        for name, operator in from_text.ghost_operators().items():
            torch.testing.assert_close(from_file.get_parameter(name), operator, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="lack what selection by 'streamline' needs"):
        ghost_prune(build("llama"), statistics=CalibrationStatistics.load(tmp_path / "stats.safetensors"),
                    criterion="streamline", num_layers=2)


def test_calibration_from_file_and_dataset(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    tokenizer = char_tokenizer()
    (tmp_path / "cal.txt").write_text("\n\n".join(texts()))
    from_file = ghost_prune(build("llama"), tokenizer, tmp_path / "cal.txt", num_layers=2, **FAST)
    from_dataset = ghost_prune(build("llama"), tokenizer, datasets.Dataset.from_dict({"text": texts()}), num_layers=2, **FAST)
    a, b = from_file.config.ghost_provenance["calibration"], from_dataset.config.ghost_provenance["calibration"]
    assert a["sha256"] == b["sha256"] and a["tokens"] == b["tokens"]
    assert from_file.config.removed_layers == from_dataset.config.removed_layers


def test_tokenizer_without_pad_token_is_handled() -> None:
    tokenizer = char_tokenizer()
    tokenizer.pad_token = None
    assert tokenizer.pad_token_id is None
    data = tokenize_texts(tokenizer, texts(), 40, batch_size=4)
    assert any((b["attention_mask"] == 0).any() for b in data.batches)  # the last sequence is padded ...
    assert all((b["input_ids"][b["attention_mask"] == 0] == EOS).all() for b in data.batches)  # ... with EOS
    ghosted = ghost_prune(build("llama"), tokenizer, texts(), num_layers=2, seq_len=40, batch_size=4)
    assert ghosted.config.num_hidden_layers == LAYERS - 2


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(num_layers=LAYERS), ValueError, f"num_layers must be between 1 and {LAYERS - 1}"),
        (dict(num_layers=0), ValueError, "num_layers must be between 1"),
        (dict(criterion="best"), ValueError, "Unknown criterion 'best'; choose one of: ghost-aware, streamline, angular"),
        (dict(operator="magic"), ValueError, "Unknown operator 'magic'; choose one of: ghost, normed, ghost-normed, none, linearpatch-diag"),
        (dict(criterion="manual"), ValueError, "needs the layer indices"),
        (dict(bogus=1), TypeError, r"Unknown option\(s\) \['bogus'\]"),
        (dict(num_layers=2, seq_len=8, num_sequences=2), ValueError, r"gave 16 usable tokens, but fitting a 32x32 operator needs at least 32"),
    ],
)
def test_bad_options(kwargs, error, message) -> None:
    with pytest.raises(error, match=message):
        ghost_prune(build("llama"), char_tokenizer(), texts(), **kwargs)


def test_empty_calibration_text() -> None:
    with pytest.raises(ValueError, match="calibration text .* is empty"):
        ghost_prune(build("llama"), char_tokenizer(), ["", "   "], num_layers=2)


def test_returns_a_ghosted_model_that_records_its_choice() -> None:
    model = ghost_prune(build("llama"), char_tokenizer(), texts(), num_layers=1, **FAST)
    assert isinstance(model, GhostedForCausalLM)
    selection = model.config.ghost_provenance["selection"]
    best = min(selection["scores"], key=selection["scores"].get)  # ghost-aware: lowest residual wins
    assert model.config.removed_layers == [int(best)] and model.config.num_hidden_layers == LAYERS - 1


def test_plain_pruning_runs_no_calibration_pass_of_its_own() -> None:
    """`operator="none"` fits nothing: with given layers it needs no text and runs no pass; with a criterion
    only the criterion's pass runs. Either way the result is a stock checkpoint."""
    given = ghost_prune(build("llama"), criterion="manual", layers=[2, 3], operator="none")
    assert type(given).__name__ == "LlamaForCausalLM"
    assert given.config.ghost_provenance["cost"]["passes"] == []
    chosen = ghost_prune(build("llama"), char_tokenizer(), texts(), num_layers=2, operator="none", **FAST)
    passes = chosen.config.ghost_provenance["cost"]["passes"]
    assert [p["purpose"] for p in passes] == ["selection by 'ghost-aware'"]
    assert chosen.config.ghost_provenance["stock_export"]["boundaries"][0]["fit"]["relative_residual"] == 1.0
