"""The ghosted model format: surgery, operators, save/load through remote code, generation."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from fake_hub import build_hub_cache
from isolated import assert_loads_with_same_logits, run_without_ghosted
from safetensors.torch import load_file, save_file
from tiny import HIDDEN, LAYERS, batch, build, char_tokenizer, deleted_reference, random_operator, tiny_family
from transformers import AutoModelForCausalLM

import ghosted_hf
from ghosted_hf import GhostedForCausalLM, prune_layers
from ghosted_hf.io.files import REMOTE_FILES

ARCHS = ["llama", "qwen2", "qwen3"]
REMOVALS = {
    "contiguous": [2, 3],
    "scattered": [1, 3],
    "first": [0],
    "last": [4, 5],
}


def logits(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("removal", list(REMOVALS))
def test_identity_operators_equal_plain_deletion(arch: str, removal: str) -> None:
    removed = REMOVALS[removal]
    dense = build(arch)
    reference = deleted_reference(dense, removed)
    ghosted = prune_layers(dense, removed)
    inputs = batch()
    assert torch.equal(logits(ghosted, inputs), logits(reference, inputs))
    kept = LAYERS - len(removed)
    assert ghosted.config.num_hidden_layers == kept
    assert [layer.self_attn.layer_idx for layer in ghosted.model.layers] == list(range(kept))
    if arch == "qwen2":
        expected = [d for i, d in enumerate(build(arch).config.layer_types) if i not in removed]
        assert ghosted.config.text_config.layer_types == expected
    assert ghosted.config.removed_layers == removed


@pytest.mark.parametrize("arch", ARCHS)
def test_weights_are_moved_not_copied(arch: str) -> None:
    dense = build(arch)
    q_proj = dense.model.layers[4].self_attn.q_proj.weight
    embed = dense.model.embed_tokens.weight
    ghosted = prune_layers(dense, [1, 2])
    assert ghosted.model.layers[2].self_attn.q_proj.weight.data_ptr() == q_proj.data_ptr()
    assert ghosted.model.embed_tokens.weight.data_ptr() == embed.data_ptr()
    tied = arch == "qwen3"
    assert (ghosted.lm_head.weight.data_ptr() == ghosted.model.embed_tokens.weight.data_ptr()) == tied


def _hidden(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def record(module: torch.nn.Module, store: dict, key: str) -> None:
    """Record the (already transformed) hidden state a module receives."""
    module.register_forward_pre_hook(lambda m, a, k: store.__setitem__(key, _hidden(a, k)), with_kwargs=True)


def multiply_input(module: torch.nn.Module, w: torch.Tensor) -> None:
    def hook(m, args, kwargs):
        if args:
            return (args[0] @ w, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"] @ w}

    module.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_operators_act_as_x_at_w_where_they_belong(arch: str) -> None:
    removed = [1, 2, 5]  # one boundary feeding pruned layer 1, one before the final norm
    dense = build(arch)
    reference = deleted_reference(dense, removed)
    w_layer, w_norm = random_operator(10), random_operator(11)
    ghosted = prune_layers(dense, removed, {1: w_layer, 5: w_norm})

    seen: dict[str, torch.Tensor] = {}
    record(ghosted.model.layers[1], seen, "ghost")
    record(reference.model.layers[1], seen, "plain")
    inputs = batch()
    ghost_logits = logits(ghosted, inputs)
    logits(reference, inputs)
    torch.testing.assert_close(seen["ghost"], seen["plain"] @ w_layer, rtol=0, atol=0)

    # Hand computation of the whole model: the plain-deleted model with x @ W inserted at both places.
    multiply_input(reference.model.layers[1], w_layer)
    multiply_input(reference.model.norm, w_norm)
    torch.testing.assert_close(ghost_logits, logits(reference, inputs), rtol=0, atol=0)
    assert set(ghosted.ghost_operators()) == {"model.layers.1.ghost.operator", "model.norm.ghost.operator"}


def test_a_normed_term_acts_as_x_at_w_plus_n_of_x_at_a(tmp_path: Path) -> None:
    """A `normed` boundary computes x W + n(x) A, n(x) = x / sqrt(mean(x^2) + 1e-6) (format 1.1), saves both
    tensors with their hashes, and loads back (in process and through the remote code) to the same logits; a
    boundary without one stays as it was, and the format version says 1.1 only where a term exists."""
    removed = [1, 2, 5]
    dense = build("llama")
    reference = deleted_reference(dense, removed)
    w, a = random_operator(10), 0.3 * torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(4))
    ghosted = prune_layers(dense, removed, {1: w}, normed={1: a})
    assert ghosted.config.ghost_format_version == "1.1"
    assert [b.get("normed", False) for b in ghosted.config.ghost_boundaries] == [True, False]
    seen: dict[str, torch.Tensor] = {}
    record(ghosted.model.layers[1], seen, "ghost")
    record(reference.model.layers[1], seen, "plain")
    inputs = batch()
    expected_logits = logits(ghosted, inputs)
    logits(reference, inputs)
    x = seen["plain"]
    n = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(seen["ghost"], x @ w + n @ a, rtol=1e-6, atol=1e-6)
    folder = _save(ghosted, tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    assert config["ghost_format_version"] == "1.1"
    assert config["ghost_boundaries"][0]["normed_sha256"] and "normed_sha256" not in config["ghost_boundaries"][1]
    assert sorted(k for k in load_file(folder / "model.safetensors") if ".ghost." in k) == [
        "model.layers.1.ghost.normed", "model.layers.1.ghost.operator", "model.norm.ghost.operator"]
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(folder), inputs), expected_logits)
    assert_loads_with_same_logits(folder, ghosted, inputs, tmp_path)
    # Without a normed term the checkpoint stays 1.0, readable by every 1.x reader.
    plain = _save(prune_layers(build("llama"), removed, {1: w}), tmp_path / "plain")
    assert json.loads((plain / "config.json").read_text())["ghost_format_version"] == "1.0"


def test_a_damaged_or_missing_normed_term_is_refused(tmp_path: Path) -> None:
    folder = _save(prune_layers(build("llama"), [2, 3], normed={2: random_operator(3)}), tmp_path / "model")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.2.ghost.normed"][0, 0] += 1.0
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.2.ghost.normed does not match the sha256"):
        AutoModelForCausalLM.from_pretrained(folder)
    del tensors["model.layers.2.ghost.normed"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing from the checkpoint: \['model.layers.2.ghost.normed'\]"):
        AutoModelForCausalLM.from_pretrained(folder)


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_with_cache_equals_without_cache_left_padded(arch: str) -> None:
    ghosted = prune_layers(build(arch), [1, 4], {1: random_operator(3), 4: random_operator(4)})
    inputs = batch(rows=3, length=10, pad_first=4)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)
    with_cache = ghosted.generate(**inputs, use_cache=True, **kwargs)
    without_cache = ghosted.generate(**inputs, use_cache=False, **kwargs)
    assert with_cache.shape == (3, 18)
    assert torch.equal(with_cache, without_cache)


def _save(model: GhostedForCausalLM, path: Path, with_tokenizer: bool = False) -> Path:
    model.save_pretrained(path)
    if with_tokenizer:
        char_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("removal", list(REMOVALS))
def test_round_trip_in_process(arch: str, removal: str, tmp_path: Path) -> None:
    removed = REMOVALS[removal]
    starts = sorted({r for r in removed if r - 1 not in removed})
    ghosted = prune_layers(build(arch), removed, {s: random_operator(s) for s in starts})
    _save(ghosted, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(loaded, GhostedForCausalLM)
    inputs = batch()
    assert torch.equal(logits(loaded, inputs), logits(ghosted, inputs))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_remote_code_load_without_ghosted_hf(arch: str, tmp_path: Path) -> None:
    ghosted = prune_layers(build(arch), [0, 3, 5], {0: random_operator(1), 3: random_operator(2), 5: random_operator(5)})
    folder = _save(ghosted, tmp_path / "model")
    files = sorted(p.name for p in folder.iterdir())
    assert files == sorted(["config.json", "generation_config.json", "model.safetensors", *REMOTE_FILES])
    assert set(REMOTE_FILES) == {"cache_ghosted.py", "configuration_ghosted.py", "format_ghosted.py",
                                 "integrity_ghosted.py", "modeling_ghosted.py", "staging_ghosted.py"}
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_ghosted.GhostedConfig",
        "AutoModel": "modeling_ghosted.GhostedModel",
        "AutoModelForCausalLM": "modeling_ghosted.GhostedForCausalLM",
    }
    for source in REMOTE_FILES:
        imports = [l for l in (folder / source).read_text().splitlines() if l.startswith(("import ", "from "))]
        allowed = {"__future__", "torch", "transformers", ""} | set(sys.stdlib_module_names)
        assert all(l.split()[1].split(".")[0] in allowed for l in imports), imports

    out = assert_loads_with_same_logits(folder, ghosted, batch(), tmp_path)
    assert "LOADED transformers_modules" in out and "GhostedForCausalLM" in out


@pytest.mark.slow
def test_load_by_repo_id_from_offline_hub_cache(tmp_path: Path) -> None:
    ghosted = prune_layers(build("qwen3"), [2, 3], {2: random_operator(7)})
    folder = _save(ghosted, tmp_path / "model", with_tokenizer=True)
    build_hub_cache(tmp_path / "hub", "ghosted-test/tiny-qwen3-ghost", folder)
    out = assert_loads_with_same_logits("ghosted-test/tiny-qwen3-ghost", ghosted, batch(), tmp_path,
                                        env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    assert "LOADED transformers_modules" in out


@pytest.mark.slow
def test_automodel_loads_the_decoder_with_its_operators(tmp_path: Path) -> None:
    ghosted = prune_layers(build("qwen3"), [2, 3], {2: random_operator(7)})
    folder = _save(ghosted, tmp_path / "model")
    inputs = batch()
    with torch.no_grad():
        expected = ghosted(**inputs, output_hidden_states=True).hidden_states[-1]
    save_file({"expected": expected, **inputs}, tmp_path / "io.safetensors")
    out = run_without_ghosted(
        f"""
        import torch
        from safetensors.torch import load_file
        from transformers import AutoModel
        io = load_file("io.safetensors")
        model = AutoModel.from_pretrained({str(folder)!r}, trust_remote_code=True)
        with torch.no_grad():
            got = model(input_ids=io["input_ids"], attention_mask=io["attention_mask"]).last_hidden_state
        assert torch.equal(got, io["expected"])
        print("AUTOMODEL", type(model).__name__)
        """,
        cwd=tmp_path,
    )
    assert "AUTOMODEL GhostedModel" in out


@pytest.mark.slow
def test_pipeline_text_generation(tmp_path: Path) -> None:
    ghosted = prune_layers(build("llama"), [2], {2: random_operator(9)})
    folder = _save(ghosted, tmp_path / "model", with_tokenizer=True)
    out = run_without_ghosted(
        f"""
        from transformers import pipeline
        generator = pipeline("text-generation", model="{folder}", trust_remote_code=True)
        text = generator("hello", max_new_tokens=6, do_sample=False)[0]["generated_text"]
        assert text.startswith("hello") and len(text) > len("hello"), text
        print("PIPELINE", repr(text))
        """,
        cwd=tmp_path,
    )
    assert "PIPELINE" in out


def test_bfloat16_load_keeps_float32_operators(tmp_path: Path) -> None:
    ghosted = prune_layers(build("qwen2"), [1, 5], {1: random_operator(1), 5: random_operator(2)})
    _save(ghosted, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert loaded.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    for name, operator in loaded.ghost_operators().items():
        assert operator.dtype == torch.float32, name
        assert torch.equal(operator, ghosted.get_parameter(name))
    out = logits(loaded, batch())
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_bfloat16_operator_option(tmp_path: Path) -> None:
    ghosted = prune_layers(build("llama"), [3], {3: random_operator(1)}, operator_dtype=torch.bfloat16)
    assert ghosted.config.operator_dtype == "bfloat16"
    _save(ghosted, tmp_path)
    assert load_file(tmp_path / "model.safetensors")["model.layers.3.ghost.operator"].dtype == torch.bfloat16
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert loaded.ghost_operators()["model.layers.3.ghost.operator"].dtype == torch.bfloat16


def test_eager_and_sdpa_agree_and_hidden_states(tmp_path: Path) -> None:
    ghosted = prune_layers(build("qwen2"), [2, 3], {2: random_operator(1)})
    _save(ghosted, tmp_path)
    inputs = batch()
    eager = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    sdpa = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    assert eager.model.config._attn_implementation == "eager"
    assert sdpa.model.config._attn_implementation == "sdpa"
    real = inputs["attention_mask"].bool()  # fully masked (padding) rows differ between kernels by design
    torch.testing.assert_close(logits(eager, inputs)[real], logits(sdpa, inputs)[real], rtol=1e-4, atol=1e-4)
    # hidden_states are what the decoder computes: the embeddings, then each kept layer's output (the
    # operator is applied as the next layer reads its input, so it does not show here), the last one normed.
    outputs: list[torch.Tensor] = []
    hooks = [sdpa.model.embed_tokens.register_forward_hook(lambda m, a, o: outputs.append(o))]
    hooks += [layer.register_forward_hook(lambda m, a, o: outputs.append(o[0] if isinstance(o, tuple) else o))
              for layer in sdpa.model.layers]
    hooks.append(sdpa.model.norm.register_forward_hook(lambda m, a, o: outputs.append(o)))
    with torch.no_grad():
        out = sdpa(**inputs, output_hidden_states=True)
    for hook in hooks:
        hook.remove()
    assert len(out.hidden_states) == LAYERS - 2 + 1
    expected = outputs[:-2] + outputs[-1:]  # the last layer's output is reported after the final norm
    for i, (got, want) in enumerate(zip(out.hidden_states, expected)):
        assert torch.equal(got, want), i


def test_gradient_checkpointing_trains_operators() -> None:
    ghosted = prune_layers(build("llama"), [1, 2], {1: random_operator(1)})
    ghosted.activation_checkpointing_enable()
    ghosted.train()
    inputs = batch()
    loss = ghosted(**inputs, labels=inputs["input_ids"]).loss
    loss.backward()
    grad = ghosted.model.layers[1].ghost.operator.grad
    assert grad is not None and grad.abs().sum() > 0


def test_device_map_with_disk_offload(tmp_path: Path) -> None:
    ghosted = prune_layers(build("llama"), [0, 3], {0: random_operator(1), 3: random_operator(2)})
    _save(ghosted, tmp_path / "model")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.layers.2": "disk", "model.layers.3": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu",
                  "lm_head": "cpu"}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map, offload_folder=tmp_path / "off")
    inputs = batch()
    assert torch.equal(logits(loaded, inputs), logits(ghosted, inputs))
    assert loaded.model.layers[2].ghost.operator.device.type == "meta"  # offloaded: verified all the same
    loaded.save_pretrained(tmp_path / "resaved")  # an offloaded operator's hash is recorded from its value
    assert all(b["sha256"] for b in json.loads((tmp_path / "resaved" / "config.json").read_text())["ghost_boundaries"])
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "resaved"), inputs), logits(ghosted, inputs))
    tensors = load_file(tmp_path / "model" / "model.safetensors")
    tensors["model.layers.2.ghost.operator"][0, 0] += 0.125  # finite, plausible, not the recorded bytes
    save_file(tensors, tmp_path / "model" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="operator model.layers.2.ghost.operator does not match the sha256"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map,
                                             offload_folder=tmp_path / "off2")


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "remove, message",
    [
        (list(range(LAYERS)), "Cannot remove all 6 layers"),
        ([2, 6], r"\[6\] are out of range: the model has layers 0..5"),
        ([-1], r"\[-1\] are out of range"),
        ([2, 2], r"\[2\] are listed more than once"),
        ([], "No layer to remove"),
        (["3"], "must be integers"),
    ],
)
def test_bad_layer_indices(remove, message) -> None:
    with pytest.raises(ValueError, match=message):
        prune_layers(build("llama"), remove)


def test_unsupported_architecture() -> None:
    """A causal LM whose decoder layers cannot be found (HRM's are not one list as long as its layer count) is refused
    by what is missing."""
    with pytest.raises(ValueError, match=r"HrmTextForCausalLM has no module lists as long as its decoder layers"):
        prune_layers(tiny_family("hrm_text"), [0])


def test_already_ghosted_model_is_refused() -> None:
    ghosted = prune_layers(build("llama"), [1])
    with pytest.raises(ValueError, match="already ghosted"):
        prune_layers(ghosted, [0])


@pytest.mark.parametrize(
    "operators, message",
    [
        ({2: torch.eye(HIDDEN + 1)}, r"shape \(33, 33\); expected \(32, 32\)"),
        ({2: torch.full((HIDDEN, HIDDEN), float("nan"))}, "NaN or Inf"),
        ({2: torch.eye(HIDDEN, dtype=torch.int64)}, "floating-point"),
        ({3: torch.eye(HIDDEN)}, r"Operators given for \[3\], but boundaries start at \[2\]"),
    ],
)
def test_bad_operators(operators, message) -> None:
    with pytest.raises(ValueError, match=message):
        prune_layers(build("llama"), [2, 3], operators)


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    ghosted = prune_layers(build("llama"), [1, 4], {1: random_operator(1), 4: random_operator(2)})
    return _save(ghosted, tmp_path / "model")


def test_checkpoint_missing_operator_fails_loudly(saved: Path) -> None:
    tensors = load_file(saved / "model.safetensors")
    del tensors["model.layers.1.ghost.operator"]
    save_file(tensors, saved / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing from the checkpoint: \['model.layers.1.ghost.operator'\]"):
        AutoModelForCausalLM.from_pretrained(saved)


def test_checkpoint_non_finite_operator_fails_loudly(saved: Path) -> None:
    tensors = load_file(saved / "model.safetensors")
    tensors["model.layers.3.ghost.operator"][0, 0] = float("inf")
    save_file(tensors, saved / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.3.ghost.operator holds NaN or Inf"):
        AutoModelForCausalLM.from_pretrained(saved)


def test_checkpoint_operator_wrong_shape_fails_loudly(saved: Path) -> None:
    tensors = load_file(saved / "model.safetensors")
    tensors["model.layers.1.ghost.operator"] = torch.eye(HIDDEN + 2)
    save_file(tensors, saved / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"wrong shape: \['model.layers.1.ghost.operator \(checkpoint \(34, 34\), config \(32, 32\)\)"):
        AutoModelForCausalLM.from_pretrained(saved)


def test_config_disagreeing_with_tensors_fails_loudly(saved: Path) -> None:
    config = json.loads((saved / "config.json").read_text())
    # Claim the first run was layers [1, 2]: the boundary now feeds pruned layer 1... but one more layer
    # is removed, so the config itself is inconsistent.
    config["removed_layers"] = [1, 2, 4]
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="original_num_hidden_layers is 6, not the 4 kept layers plus the 3 removed"):
        AutoModelForCausalLM.from_pretrained(saved)


def test_config_boundary_moved_fails_loudly(saved: Path) -> None:
    config = json.loads((saved / "config.json").read_text())
    config["removed_layers"] = [2, 4]  # same counts, but the first boundary now feeds pruned layer 2
    config["ghost_boundaries"][0].update(removed=[2], layer=2, original_layer=3)
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="does not match its config.json"):
        AutoModelForCausalLM.from_pretrained(saved)


def test_config_wrong_boundaries_fails_loudly(saved: Path) -> None:
    config = json.loads((saved / "config.json").read_text())
    config["ghost_boundaries"] = config["ghost_boundaries"][:1]
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="ghost_boundaries .* do not match removed_layers"):
        AutoModelForCausalLM.from_pretrained(saved)


def test_saved_folder_holds_no_pickle(saved: Path) -> None:
    suffixes = {p.suffix for p in saved.iterdir()}
    assert suffixes == {".json", ".py", ".safetensors"}


def test_public_api_is_documented_and_registered() -> None:
    import importlib.metadata

    from transformers import AutoConfig

    names = [n for n in ghosted_hf.__all__ if n != "__version__"]
    assert {"ghost_prune", "export_stock", "heal", "GhostedForCausalLM", "LayerwisePass"} <= set(names)
    undocumented = [n for n in names if not (getattr(ghosted_hf, n).__doc__ or "").strip()
                    and not isinstance(getattr(ghosted_hf, n), dict)]
    assert undocumented == []
    assert ghosted_hf.__version__ == importlib.metadata.version("ghosted_hf")
    assert type(AutoConfig.for_model("ghosted")) is ghosted_hf.GhostedConfig


def test_saved_config_records_format_1_0(saved: Path) -> None:
    assert json.loads((saved / "config.json").read_text())["ghost_format_version"] == "1.0"


@pytest.mark.parametrize("version, refused", [
    ("1.0", None), ("1.9", None),
    ("2.0", r"Ghosted format 2.0, newer than this code reads \(1.x\): update ghosted_hf"),
    ("one", r"ghost_format_version 'one' is not of the form MAJOR.MINOR .*: the config.json is damaged")])
def test_format_version_policy(saved: Path, version: str, refused: str | None) -> None:
    """Every 1.x loads; a newer major version is refused with one line naming it and the fix."""
    config = json.loads((saved / "config.json").read_text())
    (saved / "config.json").write_text(json.dumps({**config, "ghost_format_version": version}))
    if refused is None:
        assert AutoModelForCausalLM.from_pretrained(saved).config.ghost_format_version == version
        return
    with pytest.raises(ValueError, match=refused) as error:
        AutoModelForCausalLM.from_pretrained(saved)
    assert "\n" not in str(error.value)


def test_a_config_without_a_version_reads_as_1_0(saved: Path) -> None:
    config = json.loads((saved / "config.json").read_text())
    del config["ghost_format_version"]
    (saved / "config.json").write_text(json.dumps(config))
    assert AutoModelForCausalLM.from_pretrained(saved).config.ghost_format_version == "1.0"


def test_a_config_claiming_more_layers_than_the_weights_is_refused_before_building(saved: Path) -> None:
    config = json.loads((saved / "config.json").read_text())
    config["text_config"]["num_hidden_layers"] = 10**9
    config["original_num_hidden_layers"] = 10**9 + 2
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"claims 1000000000 decoder layers .* but the weight files hold 4"):
        AutoModelForCausalLM.from_pretrained(saved)


@pytest.mark.parametrize("field, value", [("hidden_size", 10**7), ("vocab_size", 10**9)])
def test_a_config_claiming_other_sizes_than_the_embedding_is_refused(saved: Path, field: str, value: int) -> None:
    config = json.loads((saved / "config.json").read_text())
    config["text_config"][field] = value
    (saved / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json claims a vocabulary of .* but the weight files' embedding is \[128, 32\]"):
        AutoModelForCausalLM.from_pretrained(saved)
