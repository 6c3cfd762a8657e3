"""Every family of the architecture registry, by one definition of correct: a pruned model equals the dense model
with the removed layers skipped (their input passed through) and each operator applied to the stream entering the
next kept layer or the final norm, in memory, in cached generation and after a reload in a fresh process without
ghosted_hf. Tiny random models with non-trivial norm gains and biases; scattered removals, one touching the first
layer and one the last."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from compat_child import skipped_reference
from isolated import run_without_ghosted
from peft.tuners.lora.layer import ParamWrapper
from safetensors.torch import save_file
from tiny import HIDDEN, LAYERS, batch, char_tokenizer, random_operator, sequences, texts, tiny_family

from ghosted_hf import GhostedError, ghost_prune, prune_layers, save_with_card, to_stock_model
from ghosted_hf.architectures import (ARCHITECTURES, LAYER_FIELDS, architecture, decoder_layers, lora_target_parameters,
                                     reads_layer_by_layer)
from ghosted_hf.io.summary import summarize
from ghosted_hf.pipelines.healing import heal
from ghosted_hf.remote.format_ghosted import check_sizes_against_weights, expected_boundaries
from ghosted_hf.remote.modeling_ghosted import rms_normalized
from ghosted_hf.statistics import collect_statistics, least_squares
from ghosted_hf.statistics.layerwise import LayerwisePass
from ghosted_hf.statistics.patch import apply_matrix
from ghosted_hf.text.tokens import batch_sequences

FAMILIES = sorted(ARCHITECTURES)
REMOVALS = ([1, 2, 5], [0, 3])  # a run of two and the last layer; the first layer and a single one


def recovery(removed: list[int]) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Random operators for every boundary of `removed`, and a normed term on the first."""
    firsts = [b["removed"][0] for b in expected_boundaries(6, removed)]
    operators = {f: random_operator(f + 10, 0.1) for f in firsts}
    return operators, {firsts[0]: 0.1 * random_operator(firsts[0] + 20, 1.0)}


def skipped_reference_logits(dense, removed: list[int], operators, normed, inputs) -> torch.Tensor:
    """The dense model's logits with `removed` layers passing their input through and each boundary's map applied
    by a pre-hook to what it feeds: the definition of a pruned, ghosted model, built without ghosted_hf's surgery."""
    maps = {}
    for boundary in expected_boundaries(len(decoder_layers(dense)), removed):
        first = boundary["removed"][0]
        operator, term = operators[first], normed.get(first)
        maps[boundary["removed"][-1] + 1] = (lambda x, w=operator, t=term:
                                             x @ w + (rms_normalized(x) @ t if t is not None else 0))
    return skipped_reference(dense, removed, maps, inputs)


def pruned_family(model_type: str, removed: list[int]):
    dense = tiny_family(model_type)
    operators, normed = recovery(removed)
    expected = skipped_reference_logits(dense, removed, operators, normed, batch())
    return prune_layers(dense, removed, operators, normed=normed, operator_kind="ghost"), expected


@pytest.mark.parametrize("model_type", FAMILIES)
def test_pruned_equals_the_dense_model_with_the_layers_skipped(model_type: str) -> None:
    for removed in REMOVALS:
        pruned, expected = pruned_family(model_type, removed)
        assert pruned.config.text_config.num_hidden_layers == 6 - len(removed)
        with torch.no_grad():
            got = pruned(**batch()).logits
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
        prompt = batch()["input_ids"][1:2]
        cached = pruned.generate(input_ids=prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
        uncached = pruned.generate(input_ids=prompt, max_new_tokens=6, do_sample=False, pad_token_id=0,
                                   use_cache=False)
        assert torch.equal(cached, uncached), (model_type, removed)


def test_a_ghosted_model_names_the_attention_its_family_runs(tmp_path: Path) -> None:
    """Gemma 2 has no fused attention (it soft-caps the scores): its ghosted model, reloaded, names the eager kernel its
    decoder runs, not the fused one the ghosted class would pick alone, so that rebuilding it from its config (as
    sharded healing does) and switching its attention and back (as healing on a CPU does) work; Llama keeps SDPA."""
    from transformers import AutoModelForCausalLM

    for model_type, kernel in [("gemma2", "eager"), ("llama", "sdpa")]:
        save_with_card(pruned_family(model_type, REMOVALS[0])[0], tmp_path / model_type, char_tokenizer())
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / model_type, trust_remote_code=True)
        assert loaded.config._attn_implementation == loaded.get_decoder().config._attn_implementation == kernel
        assert type(loaded)._from_config(loaded.config).config._attn_implementation == kernel
        loaded.set_attn_implementation("eager")
        loaded.set_attn_implementation(kernel)


@pytest.mark.slow
def test_every_family_reloads_in_a_fresh_process_without_ghosted_hf(tmp_path: Path) -> None:
    """Saved with its card, each family's pruned model loads with trust_remote_code in a process where ghosted_hf
    cannot be imported, and gives the same logits."""
    inputs = batch()
    for model_type in FAMILIES:
        pruned, _ = pruned_family(model_type, REMOVALS[0])
        save_with_card(pruned, tmp_path / model_type, char_tokenizer())
        with torch.no_grad():
            save_file({"expected": pruned(**inputs).logits, **inputs}, tmp_path / f"{model_type}.safetensors")
    printed = run_without_ghosted(f"""
        import torch
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM
        for model_type in {FAMILIES!r}:
            io = load_file(model_type + ".safetensors")
            model = AutoModelForCausalLM.from_pretrained(model_type, trust_remote_code=True)
            with torch.no_grad():
                got = model(input_ids=io["input_ids"], attention_mask=io["attention_mask"]).logits
            torch.testing.assert_close(got, io["expected"], rtol=0, atol=0)
            print("LOADED", model_type, type(model).__module__)
        """, tmp_path, timeout=600)
    loaded = [line.split()[1] for line in printed.splitlines() if line.startswith("LOADED")]
    assert loaded == FAMILIES and "ghosted_hf" not in printed


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_family_calibrates_layer_by_layer_selects_fits_and_heals(model_type: str, tmp_path: Path) -> None:
    """The rest of the workflow per family: layer-by-layer statistics equal the full-model pass (computed buffers
    such as Gemma's two rotary embeddings rebuilt), ghost-aware selection and a normed fit from real calibration
    text, `inspect`'s summary, and LoRA healing with distillation on every linear layer of the kept decoder
    layers (fused projections included, and the experts' fused 3-D weights through PEFT's target_parameters)."""
    dense = tiny_family(model_type)
    dense.save_pretrained(tmp_path / "dense")
    batches = batch_sequences(sequences(), 3, 0)
    plan = least_squares(1, 3) | least_squares(4, 6)
    full = collect_statistics(dense, batches, plan, progress=False)
    if not reads_layer_by_layer(model_type):  # transformers converts the stored layout on load
        with pytest.raises(GhostedError, match="layer-by-layer calibration cannot read it"):
            LayerwisePass(tmp_path / "dense")
    else:
        layerwise = collect_statistics(LayerwisePass(tmp_path / "dense"), batches, plan, progress=False)
        for key, value in full.tensors.items():
            torch.testing.assert_close(layerwise.tensors[key], value, rtol=1e-9, atol=1e-9 * float(value.abs().max()))

    model = ghost_prune(tiny_family(model_type), char_tokenizer(), texts(8), num_layers=2, operator="normed",
                        seq_len=32, num_sequences=8)
    assert summarize(model.config).removed == model.config.removed_layers
    fused = lora_target_parameters(model)  # experts' 3-D weights: PEFT's parameter wrapper adapts them
    expected_wrappers = sum(name.split(".", 1)[1] in fused for name, _ in decoder_layers(model).named_parameters())
    has_fused_experts = any(p.ndim == 3 and ".experts." in name for name, p in decoder_layers(model).named_parameters())
    peft_model, losses, _, _ = heal(model, char_tokenizer(), texts(8), teacher=dense, max_steps=2, seq_len=32,
                                    per_device_train_batch_size=2, progress=False)
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    adapted = {name.split(".lora_A.")[0] for name, _ in peft_model.named_parameters() if ".lora_A." in name}
    plain = [name for name, module in peft_model.named_modules() if isinstance(module, torch.nn.Linear)
             and type(module).forward is torch.nn.Linear.forward  # (not a router that returns a tuple)
             and ".layers." in name and ".lora_" not in name and not name.endswith(".base_layer")]
    assert adapted and not plain, plain  # every linear layer of the decoder layers carries an adapter
    wrappers = sum(isinstance(module, ParamWrapper) for module in peft_model.modules())
    assert wrappers == expected_wrappers and (wrappers > 0) == has_fused_experts, fused


@pytest.mark.parametrize("model_type", FAMILIES)
def test_stock_export_is_exact_where_the_family_folds_and_refused_with_the_reason_elsewhere(model_type: str) -> None:
    """A scaled rotation at every boundary folded into a stock checkpoint of the same family gives the ghosted
    model's logits; a family where the fold cannot be exact refuses it in one line that says why."""
    removed = [1, 2, 5]
    q, _ = torch.linalg.qr(torch.randn(32, 32, generator=torch.Generator().manual_seed(3)))
    operators = {b["removed"][0]: 1.3 * q for b in expected_boundaries(6, removed)}
    # The fold is exact up to the norm's eps (rms(s x) + eps is not s (rms(x) + eps)); a negligible eps makes
    # the comparison test the fold's structure, not each family's default eps against these small activations.
    dense = tiny_family(model_type, rms_norm_eps=1e-12)
    ghosted = prune_layers(dense, removed, operators, operator_kind="folded")
    with torch.no_grad():
        expected = ghosted(**batch()).logits
    if not architecture(ghosted).stock_folds:
        with pytest.raises(GhostedError, match=r"cannot hold exactly \((a norm gain|its norms|its LayerNorms|its fold "
                                               r"is not implemented)"):
            to_stock_model(ghosted)
        return
    stock = to_stock_model(ghosted)
    assert stock.config.model_type == model_type and type(stock).__name__ != "GhostedForCausalLM"
    with torch.no_grad():
        got = stock(**batch()).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


@pytest.mark.parametrize("model_type", [t for t in FAMILIES if ARCHITECTURES[t].stock_folds])
def test_replaceme_fold_into_the_mlp_writers_is_exact(model_type: str) -> None:
    """ReplaceMe's fused export maps a kept layer's MLP output m to m @ T through every weight that writes the
    stream there (down_proj; experts' and shared experts' down projections and biases)."""
    from ghosted_hf.model.folding import fold_into_mlp_writers

    ghosted = prune_layers(tiny_family(model_type, rms_norm_eps=1e-12), [2])
    transform = torch.eye(32) + 0.3 * torch.randn(32, 32, generator=torch.Generator().manual_seed(4))
    mlp = ARCHITECTURES[model_type].mlp.module(decoder_layers(ghosted)[1])
    handle = mlp.register_forward_hook(lambda m, a, out: (out[0] @ transform, *out[1:]) if isinstance(out, tuple)
                                       else out @ transform)
    with torch.no_grad():
        expected = ghosted(**batch()).logits
    handle.remove()
    fold_into_mlp_writers(ghosted, 1, transform)
    with torch.no_grad():
        got = ghosted(**batch()).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


def test_a_per_layer_field_the_registry_does_not_know_is_refused_by_name() -> None:
    dense = tiny_family("llama")
    dense.config.attention_scales_per_layer = [1.0] * 6  # one entry per layer, meaning unknown
    with pytest.raises(GhostedError, match=r"\['attention_scales_per_layer'\] of 'llama' hold one entry per layer"):
        prune_layers(dense, [2])


def test_a_per_layer_field_re_indexed_wrongly_is_caught_before_a_model_is_built(monkeypatch) -> None:
    """The layer-by-layer comparison with the dense model catches what a wrong rule would build: here Qwen3-MoE's
    dense and sparse layers re-indexed as if nothing moved."""
    monkeypatch.setitem(LAYER_FIELDS, "mlp_only_layers", lambda value, kept, values: value)
    monkeypatch.setitem(LAYER_FIELDS, "decoder_sparse_step", lambda value, kept, values: value)
    with pytest.raises(GhostedError, match=r"Pruned layer 1 would not be built like dense layer 2"):
        prune_layers(tiny_family("qwen3_moe"), [1])


def test_index_encoded_fields_re_index() -> None:
    """Layer types sliced, index lists renumbered, prefix counts counted, Qwen-MoE's step spelled out."""
    # kept 1 2 4 5: sparse, dense, dense, sparse
    pruned = prune_layers(tiny_family("qwen3_moe"), [0, 3]).config.text_config
    assert (pruned.decoder_sparse_step, pruned.mlp_only_layers) == (1, [1, 2])
    assert prune_layers(tiny_family("deepseek_v3"), [0]).config.text_config.first_k_dense_replace == 1
    smol = tiny_family("smollm3")
    assert prune_layers(smol, [1, 2]).config.text_config.no_rope_layers == [smol.config.no_rope_layers[i]
                                                                            for i in (0, 3, 4, 5)]


def test_layers_keep_what_their_family_builds_from_their_position() -> None:
    """Gemma 4 (derived): the last two layers reuse layers 2's and 3's keys and values, each layer adds its own block
    of the per-layer input embeddings, and the config makes the last layer full attention. A removal that takes a
    source whose reader stays, or leaves a sliding layer last, is refused in one line before anything is fitted; any
    other equals the skip reference with the per-layer blocks of the kept layers, and the criteria choose among those
    only."""
    dense = tiny_family("gemma4_text")
    with pytest.raises(GhostedError, match=r"Removing layers \[2\] removes layers \[2\], whose keys and values kept "
                                           r"layers \[4\] reuse: keep them, or remove their readers too"):
        prune_layers(dense, [2])
    with pytest.raises(GhostedError, match=r"Removing layers \[5\] gives a config whose layer_types Gemma4TextConfig "
                                           r"rewrites \(pruned layer 4: 'sliding_attention' -> 'full_attention'\)"):
        prune_layers(dense, [5])
    for removed in ([1], [4], [4, 5], [0, 1]):
        operators, normed = recovery(removed)
        expected = skipped_reference_logits(dense, removed, operators, normed, batch())
        pruned = prune_layers(dense, removed, operators, normed=normed, operator_kind="ghost")
        with torch.no_grad():
            torch.testing.assert_close(pruned(**batch()).logits, expected, rtol=1e-5, atol=1e-5)
        kept = [i for i in range(LAYERS) if i not in removed]
        assert pruned.config.text_config.num_kv_shared_layers == sum(i >= 4 for i in kept), removed
        per_layer = pruned.get_submodule("model.embed_tokens_per_layer").weight
        blocks = dense.model.embed_tokens_per_layer.weight.unflatten(1, (LAYERS, 8))[:, kept].flatten(1)
        assert torch.equal(per_layer, blocks)
    for chosen in ("ghost-aware", "shortgpt", "lorp"):
        removed = ghost_prune(tiny_family("gemma4_text"), char_tokenizer(), texts(), criterion=chosen, num_layers=2,
                              seq_len=48, num_sequences=24).config.removed_layers
        readers_go_with_their_source = all(source not in removed or reader in removed for source, reader in ((2, 4), (3, 5)))
        assert len(removed) == 2 and readers_go_with_their_source and (5 not in removed or 4 in removed), (chosen, removed)


def test_families_that_cannot_be_pruned_are_refused_by_name() -> None:
    """NanoChat runs its one final norm before the layers too, so a boundary before it would map the embeddings as
    well: its derived layout fails the check against the skip reference (which maps the last kept layer's output)."""
    from transformers import BartConfig, BartForCausalLM

    with pytest.raises(GhostedError, match=r"'nanochat' has no entry .* failed its check on a small instance \(whole "
                                           r"layers\): removing layers \[1, 5\] gives logits .* away from the dense"):
        prune_layers(tiny_family("nanochat"), [3])
    bart = BartForCausalLM(BartConfig(vocab_size=64, d_model=16, decoder_layers=2, encoder_layers=2,
                                      decoder_attention_heads=2, encoder_attention_heads=2, decoder_ffn_dim=16,
                                      encoder_ffn_dim=16))
    with pytest.raises(GhostedError, match=r"'bart' is an encoder-decoder model"):
        prune_layers(bart, [0])


def test_the_supported_architectures_page_names_every_family() -> None:
    """(tests/test_docs.py checks the generated table is current; this, that it is generated from every entry.)"""
    page = (Path(__file__).parents[1] / "docs" / "architectures.md").read_text()
    assert all(f"`{t}`" in page for t in FAMILIES)


@pytest.mark.parametrize("model_type", ["starcoder2", "gemma3_text", "deepseek_v3"])
def test_a_config_with_another_mlp_width_is_refused_from_the_headers_in_the_family_s_names(model_type: str,
                                                                                        tmp_path: Path) -> None:
    """The header check reads the family's own MLP output weight (starcoder2: c_proj; DeepSeek-V3's first layer
    is dense); another width is refused before any model is built."""
    import json

    from ghosted_hf.model.checkpoint import check_folder

    tiny_family(model_type).save_pretrained(tmp_path)
    check_folder(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] + 1}))
    with pytest.raises(GhostedError, match=r"claims \(hidden_size, intermediate_size\)"):
        check_folder(tmp_path)


def test_every_decoder_only_type_is_derived_or_refused_with_a_reason(capsys) -> None:
    """A type with no registry entry gets a derived layout, used only once a small instance of its own default config
    passed the skip-reference check (in memory and with the cache), for whole layers and for sub-blocks apart;
    otherwise it is refused with one GhostedError naming what failed. Registered families are checked the same way by
    the tests above; docs/architectures.md lists what was found here."""
    from ghosted_hf.architectures import decoder_only_types
    from ghosted_hf.model.surgery import prune_layers
    from ghosted_hf.model.verify import derivation_verdicts

    types = decoder_only_types()
    verdicts = derivation_verdicts(types, prune_layers)
    registered = [t for t in types if t in ARCHITECTURES]
    derived = [t for t, (_, whole, _) in verdicts.items() if whole is None]
    with_subblocks = [t for t, (_, whole, sub) in verdicts.items() if whole is None and sub is None]
    refused = {t: whole or sub for t, (_, whole, sub) in verdicts.items() if whole is not None or sub is not None}
    assert all(reason.strip() for reason in refused.values())
    with capsys.disabled():
        print(f"\n{len(types)} decoder-only types: {len(registered)} registered, {len(derived)} derived and checked "
              f"({len(with_subblocks)} of them for sub-blocks too), {len(types) - len(registered) - len(derived)} "
              "refused with a reason")
    assert set(ARCHITECTURES) <= set(types) | {"gemma3_text", "qwen3_5_text"}
    assert {"llama4_text", "qwen3_5_moe_text", "exaone4", "apertus", "internlm3", "ministral3", "olmo", "stablelm",
            "bitnet", "vaultgemma", "jetmoe", "granitemoeshared", "cohere2_moe", "deepseek_v4", "deepseek_v32",
            "glm4_moe_lite"} <= set(with_subblocks)
    assert "ergo" not in with_subblocks  # its layer reads self_attn.o_proj itself: whole layers only
    assert "ergo" not in types or "ergo" in derived
    assert len(registered) + len(derived) >= 120
    # Other layouts (GPT-2's transformer.h, GPT-NeoX's and Phi's parallel blocks, Falcon, MPT, LFM2's final
    # embedding_norm), with sub-blocks; state-space and post-norm ones (no MLP, or no final norm) as whole layers.
    assert {"gpt2", "gpt_neox", "phi", "bloom", "falcon", "mpt", "gptj", "codegen", "lfm2", "falcon_h1"} <= \
        set(with_subblocks)
    assert {"mamba", "opt", "xglm", "nemotron_h", "openai-gpt", "recurrent_gemma"} <= set(derived)
    assert "has none of the sub-blocks" in refused["mamba"]
    assert "away from the dense instance" in refused["nanochat"]  # its final norm also runs before the layers
    page = (Path(__file__).parents[1] / "docs" / "architectures.md").read_text()
    generate = importlib.util.spec_from_file_location("generate", Path(__file__).parents[1] / "docs/reference/generate.py")
    module = importlib.util.module_from_spec(generate)
    generate.loader.exec_module(module)
    assert module.derived_families_table(verdicts) in page, "docs/architectures.md: run python docs/reference/generate.py"


DERIVED_END_TO_END = ["llama4_text", "exaone4", "olmo", "gpt2", "gpt_neox", "mamba", "openai-gpt"]


def test_derived_families_prune_calibrate_save_and_reload_without_ghosted_hf(tmp_path: Path) -> None:
    """Families with no registry entry, end to end: ghost-aware selection and fits from calibration text, the result
    equal to its skip reference, saved with its card and loaded in a fresh process without ghosted_hf with the same
    logits (one process for all); sub-blocks (checked on the small instance too) are replaced where the family has
    them; stock folds are refused by name. GPT-2 keeps its layers in transformer.h, GPT-NeoX's blocks are parallel,
    Mamba's are state space (no MLP), GPT-1 has no final norm (a boundary after its last layer feeds the output
    layer)."""
    from isolated import assert_all_load_with_same_logits

    saved = []
    for model_type in DERIVED_END_TO_END:
        family = architecture(tiny_family(model_type).config)
        assert family.derived and (family.layout.as_config() is None) == (model_type in DERIVED_END_TO_END[:3])
        if model_type not in ("mamba", "openai-gpt"):
            replaced = ghost_prune(tiny_family(model_type), char_tokenizer(), texts(), unit="subblock",
                                   criterion="manual", subblocks=["1.attention", "2.mlp"], seq_len=48,
                                   num_sequences=24)
            assert [(r["original_layer"], r["block"]) for r in replaced.config.ghost_subblocks] == \
                [(1, "attention"), (2, "mlp")], model_type
        with pytest.raises(GhostedError, match="its layout is derived, not declared"):
            ghost_prune(tiny_family(model_type), char_tokenizer(), texts(), operator="folded", num_layers=2,
                        seq_len=48, num_sequences=24)
        ghosted = ghost_prune(tiny_family(model_type), char_tokenizer(), texts(), num_layers=2, seq_len=48,
                              num_sequences=24)
        assert len(ghosted.config.removed_layers) == 2
        if model_type in ("gpt2", "openai-gpt"):  # the last layer's boundary: before ln_f, or the output layer itself
            plain = prune_layers(tiny_family(model_type), [LAYERS - 1], {LAYERS - 1: 2 * torch.eye(HIDDEN)})
            norm = {"gpt2": "transformer.ln_f", "openai-gpt": "lm_head"}[model_type]
            assert plain.config.ghost_layout["norm"] == norm and f"{norm}.ghost.operator" in plain.state_dict()
        save_with_card(ghosted, tmp_path / model_type, char_tokenizer())
        saved.append((tmp_path / model_type, ghosted, batch()))
    printed = assert_all_load_with_same_logits(saved, tmp_path)
    assert printed.count("LOADED transformers_modules") == len(DERIVED_END_TO_END)


def test_hyper_connections_streams_set_the_operator_width_and_a_claimed_count_is_checked(tmp_path: Path) -> None:
    """Qwen4-exp carries 4 hidden-size streams between layers (hyper-connections): the derived layout finds them and
    the mixer that reads the last layer's output; boundary operators map the 4 C wide stream (format 1.5), equal to
    the skip reference; a sub-block's map stays C x C; whole layers and sub-blocks in one pass are refused by name;
    a config.json claiming another stream count is refused from the headers, before anything of that size is built."""
    import json

    from ghosted_hf.io.files import verify_folder

    dense = tiny_family("qwen4_exp_text")
    layout = architecture(dense).layout
    assert (layout.streams, layout.norm) == (4, "model.hyper_connection_mixer")
    width, removed = 4 * HIDDEN, [1, 2, 5]  # (layer 3, indexed attention, stays: the masks are built from it)
    operators = {1: random_operator(1, width=width), 5: random_operator(2, width=width)}
    expected = skipped_reference(dense, removed, {3: apply_matrix(operators[1]), 6: apply_matrix(operators[5])},
                                 batch(), decoder_layers(dense), dense.get_submodule(layout.norm))
    ghosted = prune_layers(dense, removed, operators, operator_kind="ghost")
    with torch.no_grad():
        torch.testing.assert_close(ghosted(**batch()).logits, expected, rtol=1e-5, atol=1e-5)
    assert ghosted.get_parameter("model.hyper_connection_mixer.ghost.operator").shape == (width, width)
    save_with_card(ghosted, tmp_path / "ghosted", char_tokenizer())
    config = verify_folder(tmp_path / "ghosted")
    assert config["ghost_format_version"] == "1.5" and config["ghost_layout"]["streams"] == 4

    replaced = ghost_prune(tiny_family("qwen4_exp_text"), char_tokenizer(), texts(), unit="subblock",
                           criterion="manual", subblocks=["3.mlp"], seq_len=48, num_sequences=24)
    assert replaced.get_parameter("model.layers.3.mlp.ghost.operator").shape == (HIDDEN, HIDDEN)
    with pytest.raises(GhostedError, match="carries 4 streams of 32 between layers.*use unit 'layer' or 'subblock'"):
        ghost_prune(tiny_family("qwen4_exp_text"), char_tokenizer(), texts(), unit="mixed", remove="20%",
                    seq_len=48, num_sequences=24)

    claimed = json.loads((tmp_path / "ghosted" / "config.json").read_text())
    claimed["ghost_layout"]["streams"] = 64  # (a 2048 x 2048 operator per boundary, were it built)
    (tmp_path / "ghosted" / "config.json").write_text(json.dumps(claimed))
    with pytest.raises(GhostedError, match="does not belong to these weights"):
        verify_folder(tmp_path / "ghosted")
    with pytest.raises(ValueError, match=r"wrong shape: \['model.layers.1.ghost.operator \(checkpoint "
                                         r"\(128, 128\), config \(2048, 2048\)\)"):
        check_sizes_against_weights(str(tmp_path / "ghosted"), {})  # (what the remote code checks, without us)
