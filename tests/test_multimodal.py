"""Multimodal checkpoints (Gemma 3, Llama 4, Qwen3.5): the language decoder is pruned, the vision tower, projector and
processor are kept as they are, and the result is the same image-text-to-text class, saved and loaded without
ghosted_hf."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from compat_child import skipped_reference
from isolated import assert_all_load_with_same_logits, run_without_ghosted
from safetensors.torch import load_file
from tiny import (batch, char_tokenizer, gemma3_processor, image_inputs, multimodal_processor, random_operator, texts,
                  tiny_multimodal)

from ghosted_hf import ghost_prune, prune_layers, save_with_card
from ghosted_hf.architectures import architecture, decoder_layers, final_norm, stream_width
from ghosted_hf.io.files import verify_folder
from ghosted_hf.model.loading import load_model
from ghosted_hf.remote.format_ghosted import expected_boundaries
from ghosted_hf.statistics.patch import apply_matrix

FAMILIES = ["gemma3", "llama4", "qwen3_5", "qwen3_5_moe", "gemma4", "qwen4_exp"]
# Gemma 4's last layer must stay full attention and its layers 4 and 5 reuse layers 2's and 3's keys and values
REMOVED = {"gemma4": [1, 4, 5]}


def _loaded(model_type: str, folder: Path):
    """The tiny model as `AutoModelForImageTextToText.from_pretrained` loads it (through ghosted_hf's loader)."""
    tiny_multimodal(model_type).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    model, _ = load_model(str(folder))
    return model


def test_multimodal_models_language_decoders_are_pruned_and_reload_as_the_same_class(tmp_path: Path) -> None:
    """`prune_layers` and `ghost_prune` take each multimodal model as it loads: the result is still the family's
    image-text-to-text class, equals the skip reference on text, and loads in a fresh process without ghosted_hf
    (one for all) with `AutoModelForImageTextToText` and the same logits on text and on a prompt with an image; every
    vision-tower and projector tensor is the dense model's, bit for bit."""
    saved = []
    for model_type in FAMILIES:
        dense = _loaded(model_type, tmp_path / model_type / "dense")
        family_class, layers = type(dense), architecture(dense).layout.layers
        assert "language_model" in layers, model_type
        language = layers.rsplit(".", 1)[0] + "."
        outside = {name: tensor.clone() for name, tensor in dense.state_dict().items()
                   if not name.startswith(language) and "lm_head" not in name}
        assert any("vision" in name or "visual" in name for name in outside)
        removed = REMOVED.get(model_type, [1, 2, 5])
        spans = [(b["removed"][0], b["removed"][-1] + 1) for b in expected_boundaries(6, removed)]
        operators = {start: random_operator(k + 1, width=stream_width(dense)) for k, (start, _) in enumerate(spans)}
        expected = skipped_reference(dense, removed, {fed: apply_matrix(operators[start]) for start, fed in spans},
                                     batch(), decoder_layers(dense), final_norm(dense))
        ghosted = prune_layers(dense, removed, operators, operator_kind="ghost")
        assert isinstance(ghosted, family_class) and ghosted.config.ghost_layout["layers"] == layers
        with torch.no_grad():
            torch.testing.assert_close(ghosted(**batch()).logits, expected, rtol=1e-5, atol=1e-5)
        folder = tmp_path / model_type / "ghosted"
        save_with_card(ghosted, folder, char_tokenizer())
        stored = load_file(folder / "model.safetensors")
        assert all(torch.equal(stored[name], tensor) for name, tensor in outside.items() if name in stored)
        assert {name for name in outside if "vision" in name or "visual" in name} <= set(stored)
        assert "vision tower and projector" in (folder / "README.md").read_text()
        assert verify_folder(folder)["ghost_layout"]["layers"] == layers  # (what push checks)
        saved.append((folder, ghosted, [batch(), image_inputs(model_type)]))

        fitted = ghost_prune(_loaded(model_type, tmp_path / model_type / "again"), char_tokenizer(), texts(),
                             num_layers=2, seq_len=48, num_sequences=24)
        assert isinstance(fitted, family_class) and len(fitted.config.removed_layers) == 2
    # (1e-6: Qwen3.5's linear-attention layers sum in another order in another process, 6e-8 apart)
    printed = assert_all_load_with_same_logits(saved, tmp_path, atol=1e-6, auto_class="AutoModelForImageTextToText")
    assert printed.count("LOADED transformers_modules") == len(FAMILIES)
    assert printed.count("GhostedForConditionalGeneration 3") == len(FAMILIES)


def test_a_pruned_gemma3_answers_an_image_text_prompt_through_the_pipeline_without_ghosted_hf(tmp_path: Path) -> None:
    """The processor is saved beside the pruned model; `pipeline("image-text-to-text")` loads the folder in a process
    without ghosted_hf and answers a prompt with an image."""
    processor = gemma3_processor()
    ghosted = ghost_prune(tiny_multimodal("gemma3"), processor.tokenizer, texts(), num_layers=2, seq_len=48,
                          num_sequences=24)
    save_with_card(ghosted, tmp_path / "ghosted", processor)
    printed = run_without_ghosted(
        f"""
        import numpy as np
        from PIL import Image
        from transformers import pipeline
        pipe = pipeline("image-text-to-text", model={str(tmp_path / "ghosted")!r}, trust_remote_code=True)
        image = Image.fromarray((np.random.RandomState(0).rand(32, 32, 3) * 255).astype("uint8"))
        out = pipe(images=image, text="What is <start_of_image> this?", max_new_tokens=4, do_sample=False)
        print("ANSWER", type(pipe.model).__name__, repr(out[0]["generated_text"]))
        """,
        tmp_path,
    )
    assert "ANSWER GhostedForConditionalGeneration 'What is <start_of_image> this?" in printed


@pytest.mark.torchvision
def test_pruned_llama4_qwen3_5_and_qwen4_exp_answer_image_text_prompts_through_the_pipeline(tmp_path: Path) -> None:
    """As Gemma 3's, with the processors that need torchvision: each pruned model loads in one process without
    ghosted_hf through `pipeline("image-text-to-text")` and answers a prompt with an image."""
    prompts = {"llama4": "What is <|image|> this?", "qwen3_5": "What is <|vision_start|><|image_pad|><|vision_end|> "
               "this?"}
    prompts["qwen4_exp"] = prompts["qwen3_5"]
    for model_type in prompts:
        processor = multimodal_processor(model_type)
        ghosted = ghost_prune(tiny_multimodal(model_type), processor.tokenizer, texts(), num_layers=2, seq_len=48,
                              num_sequences=24)
        save_with_card(ghosted, tmp_path / model_type, processor)
    printed = run_without_ghosted(
        f"""
        import numpy as np
        from PIL import Image
        from transformers import pipeline
        for model_type, prompt in {prompts!r}.items():
            pipe = pipeline("image-text-to-text", model=f"{tmp_path}/{{model_type}}", trust_remote_code=True)
            image = Image.fromarray((np.random.RandomState(0).rand(32, 32, 3) * 255).astype("uint8"))
            out = pipe(images=image, text=prompt, max_new_tokens=4, do_sample=False)
            print("ANSWER", model_type, type(pipe.model).__name__, repr(out[0]["generated_text"][:len(prompt)]))
        """,
        tmp_path,
    )
    for model_type, prompt in prompts.items():
        assert f"ANSWER {model_type} GhostedForConditionalGeneration {prompt!r}" in printed


def test_a_multimodal_model_whose_language_decoder_cannot_be_pruned_is_refused_by_name() -> None:
    """Mllama's language decoder (cross-attention layers reading the image) is no causal LM of its own; Gemma 3n's
    (AltUp: per-layer projections beside its layers) has no layer list that can be told apart: each refused naming
    why, before anything is loaded or fitted."""
    from transformers import AutoConfig

    from ghosted_hf.errors import GhostedError

    with pytest.raises(GhostedError, match=r"'mllama' is a multimodal model whose language decoder "
                                           r"\('mllama_text_model'\) cannot be pruned"):
        architecture(AutoConfig.for_model("mllama"))
    with pytest.raises(GhostedError, match=r"'gemma3n' is a multimodal model whose language decoder "
                                           r"\('gemma3n_text'\) cannot be pruned: .* layers cannot be told apart"):
        architecture(AutoConfig.for_model("gemma3n"))

