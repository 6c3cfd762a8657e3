"""The folded plain export: a stock Llama/Qwen checkpoint that computes what the ghosted model with
W = c Q (and the fused T) computes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from isolated import assert_loads_with_same_logits, run_without_ghosted
from tiny import HIDDEN, LAYERS, batch, build, char_tokenizer, kl_to_dense, texts

from ghosted_hf import GhostedError, export_stock, ghost_prune, prune_layers, save_with_card, to_stock_model
from ghosted_hf.model.folding import fold_into_mlp_writers

ARCHS = ["llama", "qwen2", "qwen3"]  # Qwen2: biases on q/k/v; Qwen3: q/k norms, tied embeddings
FAST = dict(seq_len=48, num_sequences=24)


def scaled_rotation(seed: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(HIDDEN, HIDDEN, generator=g, dtype=torch.float64))
    return (scale * q).float()


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch()).logits


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tied", [False, True])
def test_folding_c_q_and_t_is_exact(arch: str, tied: bool) -> None:
    """Boundaries feeding layer 0, a middle layer and the final norm, each with its own c Q, plus a T fused
    into the down_proj before the middle one: the plain model's logits equal the ghosted model's."""
    removed = [0, 2, 3, 5]
    ghosted = prune_layers(build(arch, tie_word_embeddings=tied), removed,
                           {0: scaled_rotation(1, 1.3), 2: scaled_rotation(2, 0.7), 5: scaled_rotation(3, 1.9)})
    t = torch.eye(HIDDEN) + 0.2 * torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(4))
    fold_into_mlp_writers(ghosted, 1, t.double())  # dense layer 1 = the last kept layer before boundary [2, 3]
    plain = to_stock_model(ghosted)
    assert type(plain).__name__ == type(build(arch)).__name__
    assert plain.config.tie_word_embeddings is False  # the embeddings carry the first rotation
    expected = logits(ghosted)
    torch.testing.assert_close(logits(plain), expected, rtol=0, atol=2e-5 * float(expected.abs().max()))


def test_pure_scale_keeps_tied_embeddings_tied() -> None:
    eye = torch.eye(HIDDEN)
    ghosted = prune_layers(build("qwen3"), [2, 3], {2: 1.5 * eye})
    plain = to_stock_model(ghosted)
    assert plain.config.tie_word_embeddings is True
    assert plain.lm_head.weight.data_ptr() == plain.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(logits(plain), logits(ghosted), rtol=0, atol=1e-5)


def test_export_refuses_an_operator_that_is_not_a_scaled_rotation() -> None:
    ghosted = prune_layers(build("llama"), [2], {2: torch.eye(HIDDEN) + 0.3 * torch.ones(HIDDEN, HIDDEN)})
    with pytest.raises(GhostedError, match="model.layers.2.ghost.operator is not a scaled rotation c Q"):
        to_stock_model(ghosted)


def test_a_normed_term_is_refused_with_a_way_that_works() -> None:
    normed = prune_layers(build("llama"), [2], normed={2: torch.randn(HIDDEN, HIDDEN)})
    with pytest.raises(GhostedError, match="export-stock cannot refit it. Prune the dense model with --operator folded"):
        to_stock_model(normed)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_folded_prune_is_a_stock_checkpoint_that_loads_without_remote_code(arch: str, tmp_path: Path) -> None:
    plain = ghost_prune(build(arch), char_tokenizer(), texts(), criterion="manual", layers=[0, 2, 3],
                        operator="folded", **FAST)
    assert type(plain).__name__ == type(build(arch)).__name__
    save_with_card(plain, tmp_path / "plain", char_tokenizer())
    files = sorted(p.name for p in (tmp_path / "plain").iterdir())
    assert not [f for f in files if f.endswith(".py")]
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert config["model_type"] == arch and "auto_map" not in config
    assert config["ghost_provenance"]["stock_export"]["removed_layers"] == [0, 2, 3]
    card = (tmp_path / "plain" / "README.md").read_text()
    assert "stock " + arch + " checkpoint" in card and "trust_remote_code" not in card
    out = assert_loads_with_same_logits(tmp_path / "plain", plain, batch(), tmp_path, trust_remote_code=False,
                                        atol=1e-5)
    assert "LOADED transformers.models" in out
    generated = run_without_ghosted(
        f"""
        from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'plain')!r})
        ids = AutoTokenizer.from_pretrained({str(tmp_path / 'plain')!r})("hello", return_tensors="pt")["input_ids"]
        kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert (model.generate(ids, use_cache=True, **kwargs) == model.generate(ids, use_cache=False, **kwargs)).all()
        text = pipeline("text-generation", model={str(tmp_path / 'plain')!r})("hello", **kwargs)[0]["generated_text"]
        print("GENERATED", text.startswith("hello"))
        """,
        cwd=tmp_path,
    )
    assert "GENERATED True" in generated


def test_folded_beats_replaceme_and_approaches_the_ghost() -> None:
    dense, tokenizer = build("llama"), char_tokenizer()
    held_out = __import__("ghosted_hf.text.tokens", fromlist=["tokenize_texts"]).tokenize_texts(
        tokenizer, texts(6, seed=99), 48, batch_size=3).batches
    options = dict(criterion="manual", layers=[2, 3], **FAST)
    kl = {kind: kl_to_dense(dense, ghost_prune(build("llama"), tokenizer, texts(), operator=kind, **options), held_out)
          for kind in ("none", "replaceme-ls", "folded-tied", "folded", "ghost")}
    assert kl["ghost"] <= kl["folded"] < kl["folded-tied"] < kl["none"]
    assert kl["folded"] < kl["replaceme-ls"] < kl["none"]


def test_sequential_folded_fits_see_the_earlier_folds() -> None:
    tokenizer = char_tokenizer()
    options = dict(criterion="manual", layers=[1, 3], operator="folded", **FAST)
    sequential = ghost_prune(build("llama"), tokenizer, texts(), fitting="sequential", **options)
    independent = ghost_prune(build("llama"), tokenizer, texts(), fitting="independent", **options)
    fits = [b["fit"]["fitted_on"] for b in sequential.config.ghost_provenance["stock_export"]["boundaries"]]
    assert fits == ["dense model", "pruned and patched model"]
    held_out = __import__("ghosted_hf.text.tokens", fromlist=["tokenize_texts"]).tokenize_texts(
        tokenizer, texts(6, seed=99), 48, batch_size=3).batches
    dense = build("llama")
    assert kl_to_dense(dense, sequential, held_out) < kl_to_dense(dense, independent, held_out)
    assert LAYERS - 2 == sequential.config.num_hidden_layers


def test_export_stock_command_turns_a_ghosted_folder_into_a_stock_checkpoint(tmp_path: Path, capsys) -> None:
    from ghosted_hf.cli import main

    tokenizer = char_tokenizer()
    ghosted = ghost_prune(build("llama"), tokenizer, texts(), criterion="manual", layers=[0, 2, 3], **FAST)
    save_with_card(ghosted, tmp_path / "ghosted", tokenizer)
    (tmp_path / "cal.txt").write_text("\n\n".join(texts()))
    argv = ["export-stock", str(tmp_path / "ghosted"), "--output", str(tmp_path / "plain"), "--calibration",
            str(tmp_path / "cal.txt"), "--seq-len", "48", "--num-sequences", "24"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert config["model_type"] == "llama" and "auto_map" not in config
    boundaries = config["ghost_provenance"]["stock_export"]["boundaries"]
    assert [b["fit"]["fitted_on"] for b in boundaries] == ["imitating the ghost operator"] * 2
    assert all(0.0 <= b["fit"]["relative_residual"] < 1.0 for b in boundaries)  # keeps part of each correction
    assert f"relative_residual={boundaries[0]['fit']['relative_residual']:.4g}" in out
    assert main(argv) == 2  # the output exists now: refused, nothing overwritten


def test_export_stock_refuses_as_little_text_as_prune_does() -> None:
    from ghosted_hf import export_stock

    ghosted = ghost_prune(build("llama"), char_tokenizer(), texts(), criterion="manual", layers=[2, 3], **FAST)
    for call in (lambda: export_stock(ghosted, char_tokenizer(), ["nine char"]),
                 lambda: ghost_prune(build("llama"), char_tokenizer(), ["nine char"], criterion="manual", layers=[2, 3])):
        with pytest.raises(GhostedError, match=r"gave \d+ usable tokens, but fitting a 32x32 operator needs at least 32"):
            call()


def test_export_stock_records_its_own_calibration_and_options() -> None:
    """inspect and the card of an export show the export's refit (its kind, its text, its options), and keep the
    ghosted model's own calibration under refitted_from."""
    from tiny import build, char_tokenizer, texts

    from ghosted_hf import export_stock, ghost_prune
    from ghosted_hf.io.summary import summarize

    ghosted = ghost_prune(build("llama"), char_tokenizer(), texts(), num_layers=2, seq_len=48, num_sequences=16)
    before = dict(ghosted.config.ghost_provenance["calibration"])
    stock = export_stock(ghosted, char_tokenizer(), texts(12), seq_len=32, num_sequences=16)
    prov = stock.config.ghost_provenance
    assert prov["operator"] == "folded" and prov["options"]["seq_len"] == 32
    assert prov["calibration"]["name"] == "12 texts given as a list of strings" and prov["calibration"]["tokens"] == 512
    assert prov["refitted_from"]["calibration"] == before and prov["refitted_from"]["operator"] == "ghost"
    summary = summarize(stock.config)
    assert summary.recovery == "folded, imitation of the ghost operators" and "512 tokens" in summary.calibration


def test_export_stock_refuses_a_model_that_is_not_ghosted() -> None:
    """The Python function refuses a dense model itself (not only the CLI): it has no operator to refit."""
    with pytest.raises(GhostedError, match="export_stock refits a ghosted model's operators; got a LlamaForCausalLM"):
        export_stock(build("llama"), char_tokenizer(), texts())
