"""Sub-blocks as the unit of removal: attention and MLP sub-blocks replaced by closed-form linear maps (format 1.2)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from isolated import assert_loads_with_same_logits
from safetensors.torch import load_file, save_file
from tiny import HIDDEN, build, char_tokenizer, texts, tiny_family
from transformers import AutoModelForCausalLM

from ghosted_hf import GhostedError, ghost_prune, prune_layers, to_stock_model
from ghosted_hf.architectures import ARCHITECTURES, decoder_layers
from ghosted_hf.fitting import subblocks as sb
from ghosted_hf.pipelines.prune import decoder_parameters
from ghosted_hf.remote.configuration_ghosted import GhostedConfig
from ghosted_hf.remote.modeling_ghosted import SubBlockBypass
from ghosted_hf.statistics import Patch
from ghosted_hf.statistics.patch import bypassed, patched_stream

CALIBRATION = dict(num_sequences=8, seq_len=64, batch_size=4)
FAMILIES = sorted(ARCHITECTURES)


def replaced_model(dense, names):
    return ghost_prune(dense, char_tokenizer(), texts(), unit="subblock", criterion="manual", subblocks=names,
                       **CALIBRATION)


def check_cache_and_reload(model, tmp_path, names, version: str = "1.2") -> None:
    """Greedy generation with the cache equals it without; attention-free layers hold no cache bytes; a reload
    through the remote code gives the same logits."""
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    cached = model.generate(ids, max_new_tokens=6, do_sample=False)
    uncached = model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(cached, uncached)
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    assert cache.get_seq_length() == ids.shape[1]
    free = {r["layer"] for r in model.config.ghost_subblocks if r["block"] == "attention"}
    for i, layer in enumerate(getattr(cache, "layers", [])):
        keys = getattr(layer, "keys", None)
        if i in free and keys is not None:
            assert keys.numel() == 0 and layer.values.numel() == 0
    model.save_pretrained(tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["ghost_format_version"] == version
    assert [f"{r['original_layer']}.{r['block']}" for r in config["ghost_subblocks"]] == names
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model", trust_remote_code=True)
    with torch.no_grad():
        # equal up to float32 rounding: MoE experts may be stored fused and reloaded with other strides (seen unequal
        # in the last bits under load)
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_replaced_subblocks_generate_with_an_empty_cache_entry_and_reload(arch, tmp_path) -> None:
    # qwen2: sliding-window layers from layer 2 on; layer 0's attention replaced (the cache's length is read there)
    names = ["0.attention", "2.attention", "3.mlp"]
    model = replaced_model(build(arch), names)
    assert [type(decoder_layers(model)[r["layer"]].get_submodule(r["module"])) for r in model.config.ghost_subblocks] \
        == [SubBlockBypass] * 3
    check_cache_and_reload(model, tmp_path, names)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_family_replaces_subblocks_and_whole_layers(model_type, tmp_path) -> None:
    dense = tiny_family(model_type)
    names = ["0.attention", "1.mlp", f"{dense.config.num_hidden_layers - 1}.attention"]
    model = ghost_prune(dense, char_tokenizer(), texts(), unit="mixed", criterion="manual", subblocks=names,
                        layers=[2], **CALIBRATION)
    assert model.config.removed_layers == [2]
    check_cache_and_reload(model, tmp_path, names)


def test_a_subblock_model_loads_without_ghosted_hf(tmp_path) -> None:
    model = replaced_model(build("llama"), ["1.attention", "4.mlp"])
    model.save_pretrained(tmp_path / "model")
    ids = torch.randint(3, 100, (2, 7))
    printed = assert_loads_with_same_logits(tmp_path / "model", model,
                                            {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, tmp_path)
    assert "GhostedForCausalLM" in printed


def captured(model, name: str, batches) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, outputs) of one sub-block over the real tokens, float64."""
    ref = sb.parse_subblock(name)
    layer, attribute = sb.slot(model, ref)
    rows_in, rows_out = [], []

    def hook(module, args, kwargs, output):
        h = args[0] if args else kwargs["hidden_states"]
        y = output[0] if isinstance(output, tuple) else output
        rows_in.append(h.reshape(-1, HIDDEN).double())
        rows_out.append(y.reshape(-1, HIDDEN).double())

    handle = getattr(layer, attribute).register_forward_hook(hook, with_kwargs=True)
    with torch.no_grad():
        for batch in batches:
            model(**batch, use_cache=False)
    handle.remove()
    keep = torch.cat([b["attention_mask"].flatten().bool() for b in batches])
    return torch.cat(rows_in)[keep], torch.cat(rows_out)[keep]


def test_maps_are_least_squares_fits_down_the_network() -> None:
    from ghosted_hf.text.tokens import tokenize_texts

    dense = build("llama")
    batches = tokenize_texts(char_tokenizer(), texts(), 64, 8, 4).batches
    model = replaced_model(copy.deepcopy(dense), ["1.mlp", "3.attention"])
    first, second = (model.get_parameter(f"model.layers.{r['layer']}.{r['module']}.ghost.operator").double()
                     for r in model.config.ghost_subblocks)
    # the first on the dense model, the second on the model whose first sub-block is already its map
    h, y = captured(dense, "1.mlp", batches)
    torch.testing.assert_close(first, torch.linalg.lstsq(h, y).solution, atol=2e-3, rtol=2e-3)
    with bypassed(dense, {(1, "mlp"): (first, 0)}):
        h, y = captured(dense, "3.attention", batches)
    torch.testing.assert_close(second, torch.linalg.lstsq(h, y).solution, atol=2e-3, rtol=2e-3)
    fitted_on = [r["fit"]["fitted_on"] for r in model.config.ghost_subblocks]
    assert fitted_on == ["dense model", "model with the ones before it replaced"]


def stream(model, layer: int, batches) -> torch.Tensor:
    """The input of decoder layer `layer` over the real tokens, float64."""
    rows = []
    handle = decoder_layers(model)[layer].register_forward_pre_hook(
        lambda module, args, kwargs: rows.append((args[0] if args else kwargs["hidden_states"]).reshape(-1, HIDDEN)),
        with_kwargs=True)
    with torch.no_grad():
        for batch in batches:
            model(**batch, use_cache=False)
    handle.remove()
    return torch.cat(rows)[torch.cat([b["attention_mask"].flatten().bool() for b in batches])].double()


def test_mixed_fits_whole_layers_as_boundaries_and_sub_blocks_down_the_network(tmp_path) -> None:
    from ghosted_hf.text.tokens import tokenize_texts

    dense = build("llama")
    batches = tokenize_texts(char_tokenizer(), texts(), 64, 8, 4).batches
    model = ghost_prune(copy.deepcopy(dense), char_tokenizer(), texts(), unit="mixed", criterion="manual",
                        subblocks=["0.mlp", "4.attention"], layers=[2, 3], **CALIBRATION)
    assert model.config.removed_layers == [2, 3]
    assert [b["removed"] for b in model.config.ghost_boundaries] == [[2, 3]]
    first, last = (model.get_parameter(f"model.layers.{r['layer']}.{r['module']}.ghost.operator").double()
                   for r in model.config.ghost_subblocks)
    (boundary,) = [n for n, _ in model.named_parameters() if n.endswith("ghost.operator") and "attn" not in n
                   and "mlp" not in n]
    # the run of layers 2-3 is one boundary, fitted as the Ghost kind fits sequentially: the stream of the model with
    # 0.mlp replaced mapped onto the dense model's input of layer 4
    with bypassed(dense, {(0, "mlp"): (first, 0)}):
        x2 = stream(dense, 2, batches)
    x4 = stream(dense, 4, batches)
    w = torch.eye(HIDDEN, dtype=torch.float64) + torch.linalg.lstsq(x2, x4 - x2).solution
    torch.testing.assert_close(model.get_parameter(boundary).double(), w, atol=3e-3, rtol=3e-3)
    # the last sub-block fitted on the model with everything before it in place (layer 4 is the pruned model's 2)
    patch = Patch((2, 3), operators={2: w.float()}, subblocks={(0, "mlp"): (first, 0)})
    with patched_stream(dense, patch):
        h, y = captured(dense, "2.attention", batches)  # ill-conditioned here (cond ~4e3): the residual, not the map
    best = (h @ torch.linalg.lstsq(h, y).solution - y).norm()
    assert (h @ last - y).norm() <= 1.01 * best
    # the saved model is the model the fits were made on
    ids = batches[0]["input_ids"]
    outputs = model.config.ghost_subblocks[1]["outputs"]
    with torch.no_grad(), patched_stream(dense, Patch((2, 3), operators={2: w.float()},
                                                      subblocks={(0, "mlp"): (first, 0), (4, "attention"): (last, outputs)})):
        torch.testing.assert_close(model(ids).logits, dense(ids, use_cache=False).logits, atol=2e-3, rtol=2e-3)
    check_cache_and_reload(model, tmp_path, ["0.mlp", "4.attention"])


def test_mixed_chooses_whole_layers_and_sub_blocks_at_a_budget() -> None:
    dense = build("llama")
    total = decoder_parameters(dense)
    model = ghost_prune(copy.deepcopy(dense), char_tokenizer(), texts(), unit="mixed", remove="40%", **CALIBRATION)
    selection = model.config.ghost_provenance["selection"]
    damage = {sb.parse_subblock(k, sb.CANDIDATE_KINDS): v
              for k, v in selection["scores"].items()}
    assert len(damage) == 3 * dense.config.num_hidden_layers
    saved = {ref: sb.subblock_parameters(dense, ref) - HIDDEN * HIDDEN for ref in damage}
    chosen = sb.choose_to_budget(damage, saved, round(0.4 * total))
    assert selection["subblocks"] == [r.name for r in chosen if r.block != sb.LAYER]
    assert model.config.removed_layers == [r.layer for r in chosen if r.block == sb.LAYER]
    parameters = model.config.ghost_provenance["parameters"]
    assert parameters["dense"] - parameters["pruned"] - parameters["operators"] >= 0.4 * total


def test_the_budget_is_met_with_the_least_measured_damage() -> None:
    dense = build("llama")
    total = decoder_parameters(dense)
    model = ghost_prune(copy.deepcopy(dense), char_tokenizer(), texts(), unit="subblock", remove="30%", **CALIBRATION)
    selection = model.config.ghost_provenance["selection"]
    damage = {sb.parse_subblock(k): v for k, v in selection["scores"].items()}
    assert len(damage) == 2 * dense.config.num_hidden_layers
    saved = {ref: sb.subblock_parameters(dense, ref) - HIDDEN * HIDDEN for ref in damage}
    assert selection["subblocks"] == [r.name for r in sb.choose_to_budget(damage, saved, round(0.3 * total))]
    parameters = model.config.ghost_provenance["parameters"]
    removed = parameters["dense"] - parameters["pruned"] - parameters["operators"]
    assert removed >= 0.3 * total
    # dropping the last chosen one would miss the budget: nothing more is removed than it takes
    assert removed - max(saved[sb.parse_subblock(n)] for n in selection["subblocks"]) < 0.3 * total


def test_choose_to_budget_takes_the_least_damage_per_parameter() -> None:
    a, b, c = (sb.SubBlockRef(i, "mlp") for i in range(3))
    assert sb.choose_to_budget({a: 1.0, b: 0.5, c: 0.02}, {a: 10, b: 10, c: 1}, 11) == [b, c]
    assert sb.choose_to_budget({a: -0.1, b: 0.5, c: 0.1}, {a: 10, b: 10, c: 1}, 5) == [a]
    with pytest.raises(GhostedError, match="short of"):
        sb.choose_to_budget({a: 0.0}, {a: 10}, 11)
    # a whole layer and its own sub-blocks exclude each other, whichever comes first
    whole = sb.SubBlockRef(0, sb.LAYER)
    assert sb.choose_to_budget({a: 0.0, whole: 0.1, b: 0.5}, {a: 10, whole: 30, b: 10}, 15) == [a, b]
    assert sb.choose_to_budget({whole: 0.0, a: 0.1, b: 0.5}, {a: 10, whole: 30, b: 10}, 35) == [whole, b]


def test_a_share_of_parameters_sets_the_number_of_whole_layers() -> None:
    dense = build("llama")
    per_layer = decoder_parameters(dense) / dense.config.num_hidden_layers
    model = ghost_prune(copy.deepcopy(dense), char_tokenizer(), texts(), remove="25%", **CALIBRATION)
    # the fewest layers whose parameters, net of one C x C operator, reach a quarter of the decoder's
    expected = next(n for n in range(1, 6) if n * per_layer - HIDDEN * HIDDEN >= 0.25 * 6 * per_layer)
    assert len(model.config.removed_layers) == expected
    model = ghost_prune(copy.deepcopy(dense), char_tokenizer(), texts(), num_parameters=int(per_layer), **CALIBRATION)
    assert len(model.config.removed_layers) == 2


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(unit="subblock"), "removes a budget"),
    (dict(unit="subblock", criterion="shortgpt", remove="25%"), "criterion"),
    (dict(unit="subblock", criterion="manual"), "needs what to replace"),
    (dict(unit="subblock", remove="25%", operator="normed"), "defaults"),
    (dict(unit="subblock", criterion="manual", subblocks=["1.mlp"], remove="25%"), "budget"),
    (dict(unit="subblock", criterion="manual", layers=[1], subblocks=["1.mlp"]), "whole layers"),
    (dict(subblocks=["1.mlp"]), "unit='subblock'"),
    (dict(remove="125%"), "share"),
    (dict(remove="a lot"), "share"),
    (dict(remove="25%", num_parameters=10), "not both"),
    (dict(unit="subblock", criterion="manual", subblocks=["1.attn"]), "LAYER.KIND"),
    (dict(unit="subblock", criterion="manual", subblocks=["9.mlp"]), "out of range"),
    (dict(unit="subblock", criterion="manual", subblocks=["1.mlp", "1.mlp"]), "more than once"),
    (dict(unit="mixed", criterion="manual", subblocks=["1.mlp"], layers=[1]), "removed whole"),
    (dict(unit="mixed", criterion="manual"), "layers="),
    (dict(unit="mixed", criterion="manual", layers=[9]), "out of range"),
    (dict(map_rank="4"), "map_rank sets the rank of sub-blocks"),
    (dict(unit="subblock", remove="25%", map_rank="half"), "map_rank is 'full'"),
    (dict(unit="subblock", remove="25%", map_rank="0"), "map_rank is 'full'"),
    (dict(joint_rounds=2), "joint_rounds sets how the sub-block choice"),
    (dict(unit="subblock", criterion="manual", subblocks=["1.mlp"], joint_rounds=2), "leave joint_rounds at 1"),
    (dict(unit="subblock", remove="25%", joint_rounds=0), "joint_rounds must be positive"),
])
def test_bad_subblock_requests_are_refused_by_name(overrides, message) -> None:
    with pytest.raises(GhostedError, match=message):
        ghost_prune(build("llama"), char_tokenizer(), texts(), **CALIBRATION, **overrides)


def test_a_budget_no_replacement_reaches_is_refused() -> None:
    with pytest.raises(GhostedError, match="short of"):
        ghost_prune(build("llama"), char_tokenizer(), texts(), unit="subblock", remove="95%", **CALIBRATION)


def test_a_removed_layer_has_no_subblock_to_replace() -> None:
    with pytest.raises(GhostedError, match="removed whole"):
        prune_layers(build("llama"), [2], subblocks={(2, "mlp"): (torch.zeros(HIDDEN, HIDDEN), 0)})


def test_whole_layers_and_subblocks_in_one_model(tmp_path) -> None:
    model = prune_layers(build("llama"), [2, 3], {2: torch.eye(HIDDEN) * 1.1},
                         subblocks={(4, "attention"): (torch.randn(HIDDEN, HIDDEN) * 0.1, 2),
                                    (0, "mlp"): (torch.randn(HIDDEN, HIDDEN) * 0.1, 0)})
    assert [(r["layer"], r["original_layer"], r["block"]) for r in model.config.ghost_subblocks] == \
        [(0, 0, "mlp"), (2, 4, "attention")]
    check_cache_and_reload(model, tmp_path, ["0.mlp", "4.attention"])


def saved_subblock_model(tmp_path):
    model = replaced_model(build("llama"), ["1.attention", "4.mlp"])
    model.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def test_a_checkpoint_missing_a_map_is_refused(tmp_path) -> None:
    folder = saved_subblock_model(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.4.mlp.ghost.operator"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="operator tensors missing.*layers.4.mlp.ghost"):
        AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)


def test_an_altered_map_is_refused(tmp_path) -> None:
    folder = saved_subblock_model(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.self_attn.ghost.operator"][0, 0] += 1
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="self_attn.ghost.operator does not match the sha256"):
        AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)


@pytest.mark.parametrize(("record", "message"), [
    ({"layer": 9, "block": "mlp", "module": "mlp"}, "kept layer"),
    ({"layer": 1, "block": "ffn", "module": "mlp"}, "block must be"),
    ({"layer": 1, "block": "mlp", "module": "mlp; rm"}, "module must"),
    ({"layer": 1, "block": "mlp", "module": "mlp", "original_layer": 3}, "dense layer 1"),
    ({"layer": 1, "block": "mlp", "module": "mlp", "outputs": -1}, "outputs"),
])
def test_contradictory_subblock_records_are_refused(record, message) -> None:
    config = GhostedConfig(text_config=build("llama").config.to_dict(), ghost_subblocks=[record])
    with pytest.raises(ValueError, match=message):
        config.validate_ghost_layout()
    twice = GhostedConfig(text_config=build("llama").config.to_dict(),
                          ghost_subblocks=[{"layer": 1, "block": "mlp", "module": "mlp"}] * 2)
    with pytest.raises(ValueError, match="listed twice"):
        twice.validate_ghost_layout()


def test_stock_exports_refuse_replaced_subblocks() -> None:
    model = replaced_model(build("llama"), ["2.mlp"])
    with pytest.raises(GhostedError, match="cannot hold replaced sub-blocks \\(2.mlp"):
        to_stock_model(model)


def test_the_cli_prunes_sub_blocks_at_a_budget_and_inspect_and_the_card_say_so(dense_folder, tmp_path, capsys) -> None:
    from ghosted_hf.cli import main
    from ghosted_hf.io.files import verify_folder

    assert main(["prune", str(dense_folder), "--calibration", str(tmp_path / "cal.txt"), "--unit", "subblock",
                 "--remove", "20%", "--seq-len", "64", "--num-sequences", "8", "--output", str(tmp_path / "out")]) == 0
    config = verify_folder(tmp_path / "out")  # every map present and the bytes its sha256 says
    chosen = config["ghost_provenance"]["selection"]["subblocks"]
    assert chosen == [f"{r['original_layer']}.{r['block']}" for r in config["ghost_subblocks"]]
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "out")]) == 0
    shown = capsys.readouterr().out
    assert "sub-blocks      : replaced by a linear map of their input (format 1.2)" in shown
    assert all(f"  {name} -> pruned layer" in shown for name in chosen)
    assert "recovery        : linear map of each replaced sub-block's input, sequential fitting" in shown
    assert f"    {chosen[0]:>8} : " in shown and "(removed)" in shown
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"with **{len(chosen)} attention and MLP sub-blocks replaced**" in card
    assert "### Replaced sub-blocks" in card and "### Boundaries" not in card
    assert all(f"| {name} | pruned layer" in card for name in chosen)


def test_verify_folder_refuses_a_sub_block_map_the_config_does_not_list(tmp_path) -> None:
    from ghosted_hf.io.files import verify_folder

    folder = saved_subblock_model(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["ghost_subblocks"] = config["ghost_subblocks"][:1]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(GhostedError, match="boundaries and sub-blocks for"):
        verify_folder(folder)


@pytest.mark.parametrize("rank", ["full", "4"])
def test_a_sub_block_model_heals_merges_and_reloads(rank, tmp_path) -> None:
    from ghosted_hf.pipelines.healing import heal, merge

    model = ghost_prune(build("llama"), char_tokenizer(), texts(), unit="subblock", criterion="manual",
                        subblocks=["1.attention", "4.mlp"], map_rank=rank, **CALIBRATION)
    healed = heal(model, char_tokenizer(), texts(), max_steps=3, seq_len=48, train_operators=True, progress=False)
    trained = {n for n, p in healed.model.named_parameters() if p.requires_grad}
    tensors = ("operator",) if rank == "full" else ("down", "up")  # a rank-r map trains both factors
    assert all(any(f"layers.{where}.ghost." in n and n.endswith(t) for n in trained)
               for where in ("1.self_attn", "4.mlp") for t in tensors), trained
    assert not any("layers.1.self_attn.q_proj" in n for n in trained)  # nothing of the replaced attention is left
    merged = merge(healed)
    merged.save_pretrained(tmp_path / "healed")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "healed", trust_remote_code=True)
    ids = torch.randint(3, 100, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, merged(ids).logits)
    assert [r["block"] for r in reloaded.config.ghost_subblocks] == ["attention", "mlp"]


def test_each_damage_pass_starts_at_its_candidate_and_equals_a_whole_forward() -> None:
    from ghosted_hf.options import PruneOptions
    from ghosted_hf.statistics import Calibrator, FullModelPass, next_token_loss
    from ghosted_hf.text.tokens import tokenize_texts

    dense = build("llama")
    depth = dense.config.num_hidden_layers
    data = tokenize_texts(char_tokenizer(), texts(), 64, 8, 4)
    calibrator = Calibrator(FullModelPass(dense), data)
    candidates = sb.all_subblocks(depth, whole_layers=True)
    fits = sb.candidate_fits(calibrator, candidates, PruneOptions().ridge)
    calls = []
    handle = decoder_layers(dense)[0].register_forward_hook(lambda *args: calls.append(1))
    damage = sb.damages(calibrator, fits)
    handle.remove()
    # layer 0 runs in the dense model's loss pass, while its inputs are stored, and in the passes of its own sub-blocks
    assert len(calls) == 4 * len(data.batches)
    dense_loss = sb.mean_loss(calibrator.collect(next_token_loss(depth), "dense"), depth)
    for ref, fit in fits.items():  # each as a whole forward of the model with the candidate in place
        whole = sb.mean_loss(calibrator.collect(next_token_loss(depth), ref.name, sb.patch_of([fit])), depth)
        assert abs(whole - dense_loss - damage[ref]) < 1e-5, ref


def test_damages_beside_picked_ones_start_at_the_candidate_and_equal_a_whole_forward() -> None:
    from ghosted_hf.options import PruneOptions
    from ghosted_hf.statistics import Calibrator, FullModelPass, next_token_loss
    from ghosted_hf.text.tokens import tokenize_texts

    dense = build("llama")
    depth = dense.config.num_hidden_layers
    data = tokenize_texts(char_tokenizer(), texts(), 64, 8, 4)
    calibrator = Calibrator(FullModelPass(dense), data)
    fits = sb.candidate_fits(calibrator, sb.all_subblocks(depth, whole_layers=True), PruneOptions().ridge)
    picked = [fits[sb.SubBlockRef(2, sb.LAYER)], fits[sb.SubBlockRef(4, "mlp")]]
    left = {ref: fit for ref, fit in fits.items() if sb.compatible(ref, [f.ref for f in picked])}
    assert sb.SubBlockRef(2, "mlp") not in left and sb.SubBlockRef(4, "mlp") not in left
    calls = []
    handle = decoder_layers(dense)[1].register_forward_hook(lambda *args: calls.append(1))
    damage = sb.damages(calibrator, left, picked)
    handle.remove()
    # layer 1 runs in the loss pass with the picks, while their inputs are stored, in the passes of its own
    # sub-blocks (its whole layer joins the removed layer 2: not run), of layer 0's three candidates, and of layer 3's
    # (the input the picked boundary's operator rewrites is not resumed from: they start at layer 1); no later one
    assert len(calls) == (2 + 2 + 3 + 3) * len(data.batches)
    base = sb.mean_loss(calibrator.collect(next_token_loss(depth), "picked", sb.patch_of(picked)), depth)
    for ref, fit in left.items():  # each as a whole forward of the model with the picks and the candidate in place
        whole = sb.mean_loss(calibrator.collect(next_token_loss(depth), ref.name, sb.patch_of([*picked, fit])), depth)
        assert abs(whole - base - damage[ref]) < 1e-5, ref


def test_touching_whole_layers_fitted_apart_make_one_boundary_with_their_product() -> None:
    first, second = torch.randn(HIDDEN, HIDDEN, dtype=torch.float64), torch.randn(HIDDEN, HIDDEN, dtype=torch.float64)
    patch = sb.patch_of([sb.SubBlockFit(sb.SubBlockRef(3, sb.LAYER), second),
                         sb.SubBlockFit(sb.SubBlockRef(2, sb.LAYER), first)])
    assert patch.removed == (2, 3) and list(patch.operators) == [2]
    torch.testing.assert_close(patch.operators[2], (first @ second).float())


def test_a_joint_choice_measures_each_round_beside_the_picks_before_it(monkeypatch) -> None:
    dense = build("llama")
    total, measured = decoder_parameters(dense), []
    measure = sb.damages

    def spy(calibrator, fits, picked=()):
        measured.append((sorted(fits), [f.ref for f in picked], measure(calibrator, fits, picked)))
        return measured[-1][2]

    monkeypatch.setattr(sb, "damages", spy)
    model = ghost_prune(copy.deepcopy(dense), char_tokenizer(), texts(), unit="subblock", remove="30%",
                        joint_rounds=2, **CALIBRATION)
    (everything, none, alone), (left, picked, beside) = measured
    assert none == [] and len(everything) == 2 * dense.config.num_hidden_layers
    saved = {ref: sb.subblock_parameters(dense, ref) - HIDDEN * HIDDEN for ref in everything}
    budget = round(0.3 * total)
    assert picked == sb.choose_to_budget(alone, saved, -(-budget // 2))  # the first half on damages alone
    assert left == sorted(set(everything) - set(picked))
    step = budget - sum(saved[ref] for ref in picked)  # the rest on damages beside the first round's picks
    expected = sorted([*picked, *sb.choose_to_budget(beside, saved, step, chosen=picked)])
    selection = model.config.ghost_provenance["selection"]
    assert selection["subblocks"] == [ref.name for ref in expected]
    assert selection["scores"] == {ref.name: round(v, 6) for ref, v in sorted({**alone, **beside}.items())}


def test_each_sequential_fit_starts_where_the_one_before_it_was_read() -> None:
    from ghosted_hf.statistics import Calibrator, FullModelPass
    from ghosted_hf.text.tokens import tokenize_texts

    dense = build("llama")
    data = tokenize_texts(char_tokenizer(), texts(), 64, 8, 4)
    calibrator = Calibrator(FullModelPass(dense), data)
    refs = [sb.parse_subblock(name) for name in ("1.mlp", "3.attention", "4.mlp")]
    calls = []
    handle = decoder_layers(dense)[0].register_forward_hook(lambda *args: calls.append(1))
    fits = sb.fit_sequentially(calibrator, refs, 1e-6)
    handle.remove()
    # layer 0 runs in the first fit's pass and in each sub-block's two-token probe of its output count only
    assert len(calls) == len(data.batches) + len(refs) and len(fits) == len(refs)


def best_of_rank(a: torch.Tensor, h: torch.Tensor, rank: int) -> torch.Tensor:
    """The least-squares map of rank `rank` from h: the full map `a` projected on the leading directions of h @ a."""
    _, _, vt = torch.linalg.svd(h @ a, full_matrices=False)
    return a @ vt[:rank].T @ vt[:rank]


def test_rank_r_maps_are_the_best_of_their_rank_and_stored_as_two_factors(tmp_path) -> None:
    from ghosted_hf.text.tokens import tokenize_texts

    dense = build("llama")
    batches = tokenize_texts(char_tokenizer(), texts(), 64, 8, 4).batches
    model = ghost_prune(copy.deepcopy(dense), char_tokenizer(), texts(), unit="subblock", criterion="manual",
                        subblocks=["1.attention", "4.mlp"], map_rank="4", **CALIBRATION)
    assert [r["rank"] for r in model.config.ghost_subblocks] == [4, 4]
    shapes = {k: tuple(v.shape) for k, v in model.ghost_operators().items()}
    assert shapes == {"model.layers.1.self_attn.ghost.down": (HIDDEN, 4), "model.layers.1.self_attn.ghost.up": (4, HIDDEN),
                      "model.layers.4.mlp.ghost.down": (HIDDEN, 4), "model.layers.4.mlp.ghost.up": (4, HIDDEN)}
    # the first map is fitted on the dense model: the best map of rank 4 there
    h, y = captured(dense, "1.attention", batches)
    down, up = (model.get_parameter(f"model.layers.1.self_attn.ghost.{part}").double() for part in ("down", "up"))
    torch.testing.assert_close(down @ up, best_of_rank(torch.linalg.lstsq(h, y).solution, h, 4), atol=2e-3, rtol=2e-3)
    assert 0 < model.config.ghost_subblocks[0]["fit"]["energy_kept"] < 1
    from ghosted_hf.pipelines.gguf import subblock_maps  # llama.cpp's linear attention: the map multiplied out
    torch.testing.assert_close(subblock_maps(model).attention[1], (down @ up).float())

    model.save_pretrained(tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["ghost_format_version"] == "1.4"
    assert all(len(r["down_sha256"]) == len(r["up_sha256"]) == 64 and "sha256" not in r for r in config["ghost_subblocks"])
    ids = torch.randint(3, 100, (2, 7))
    assert_loads_with_same_logits(tmp_path / "model", model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                                  tmp_path)
    check_cache_and_reload(model, tmp_path / "again", ["1.attention", "4.mlp"], version="1.4")

    tensors = load_file(tmp_path / "model" / "model.safetensors")
    tensors["model.layers.4.mlp.ghost.up"][0, 0] += 1
    save_file(tensors, tmp_path / "model" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="mlp.ghost.up does not match the sha256"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "model", trust_remote_code=True)
    del tensors["model.layers.4.mlp.ghost.up"]
    save_file(tensors, tmp_path / "model" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="operator tensors missing.*layers.4.mlp.ghost.up"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "model", trust_remote_code=True)


def test_the_choice_prices_each_map_at_its_rank() -> None:
    dense = build("llama")
    total = decoder_parameters(dense)
    model = ghost_prune(copy.deepcopy(dense), char_tokenizer(), texts(), unit="subblock", remove="30%", map_rank="4",
                        **CALIBRATION)
    selection = model.config.ghost_provenance["selection"]
    damage = {sb.parse_subblock(k): v for k, v in selection["scores"].items()}
    saved = {ref: sb.subblock_parameters(dense, ref) - 2 * HIDDEN * 4 for ref in damage}  # net of a rank-4 map
    assert selection["subblocks"] == [r.name for r in sb.choose_to_budget(damage, saved, round(0.3 * total))]
    assert {r["rank"] for r in model.config.ghost_subblocks} == {4}
    parameters = model.config.ghost_provenance["parameters"]
    assert parameters["operators"] == len(selection["subblocks"]) * 2 * HIDDEN * 4
    assert parameters["dense"] - parameters["pruned"] - parameters["operators"] >= 0.3 * total


class Sums(dict):
    tokens = 4096


def test_an_auto_rank_keeps_what_the_full_map_explains_in_the_fewest_directions() -> None:
    generator = torch.Generator().manual_seed(0)
    h = torch.randn(4096, HIDDEN, generator=generator, dtype=torch.float64)
    low = torch.randn(HIDDEN, 3, generator=generator, dtype=torch.float64) @ torch.randn(3, HIDDEN, generator=generator,
                                                                                            dtype=torch.float64)
    ref = sb.SubBlockRef(2, "mlp")
    full = torch.randn(HIDDEN, HIDDEN, generator=generator, dtype=torch.float64)
    for a, expected in ((low, 3), (full, None)):  # a rank-3 map; one that is not low-rank stays full
        y = h @ a + 1e-3 * torch.randn(4096, HIDDEN, generator=generator, dtype=torch.float64)
        gram, cross, energy = (statistic(2) for statistic in sb.SUBBLOCK_SUMS["mlp"])
        stats = Sums({gram: h.T @ h, cross: h.T @ y, energy: (y * y).sum()})
        fit = sb.fit_candidate(stats, ref, 1e-9, rank="auto")
        assert fit.rank == expected
        if expected:
            assert fit.parameters == 2 * HIDDEN * 3 and fit.figures["energy_kept"] >= sb.AUTO_RANK_ENERGY
            torch.testing.assert_close(fit.map[0] @ fit.map[1], low, atol=1e-3, rtol=1e-3)
        assert sb.fit_candidate(stats, ref, 1e-9, rank=HIDDEN // 2).rank is None  # no smaller than the full map


def cache_values_per_token(model) -> int:
    """Values the model's cache holds per token (keys and values of every layer that keeps them), measured."""
    ids = torch.randint(3, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    return sum(t.numel() for layer in cache.layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
               if t is not None) // 8


def test_kv_per_token_is_what_each_layer_caches() -> None:
    from ghosted_hf.architectures import kv_per_token

    dense = build("llama")
    per_layer = kv_per_token(dense.config)
    heads, width = dense.config.num_key_value_heads, dense.config.hidden_size // dense.config.num_attention_heads
    assert per_layer == [2 * heads * width] * dense.config.num_hidden_layers
    assert sum(per_layer) == cache_values_per_token(dense)
    hybrid = tiny_family("qwen3_next").config  # linear-attention layers keep a fixed state, no per-token cache
    kinds = hybrid.layer_types
    assert [value > 0 for value in kv_per_token(hybrid)] == [kind == "full_attention" for kind in kinds]
    assert "linear_attention" in kinds


@pytest.mark.parametrize("unit", ["layer", "subblock", "mixed"])
def test_a_kv_budget_removes_that_share_of_the_cache(unit) -> None:
    from ghosted_hf.architectures import kv_per_token

    dense = build("llama")
    per_layer = kv_per_token(dense.config)
    model = ghost_prune(copy.deepcopy(dense), char_tokenizer(), texts(), unit=unit, remove_kv="50%", **CALIBRATION)
    assert cache_values_per_token(model) <= 0.5 * sum(per_layer)
    if unit == "layer":
        assert len(model.config.removed_layers) == 3
        return
    selection = model.config.ghost_provenance["selection"]
    damage = {sb.parse_subblock(k, sb.CANDIDATE_KINDS): v for k, v in selection["scores"].items()}
    assert {r.block for r in damage} == ({"attention", sb.LAYER} if unit == "mixed" else {"attention"})  # what frees cache
    chosen = sb.choose_to_budget(damage, {ref: per_layer[ref.layer] for ref in damage}, round(0.5 * sum(per_layer)))
    assert selection["subblocks"] == [r.name for r in chosen if r.block != sb.LAYER]
    assert model.config.removed_layers == [r.layer for r in chosen if r.block == sb.LAYER]


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(remove_kv="50%", remove="25%"), "one budget: remove and remove_kv"),
    (dict(remove_kv="150%"), "remove_kv is a share of the KV cache"),
    (dict(remove_kv="50%", criterion="manual", layers=[1]), "criterion 'manual'"),
])
def test_bad_kv_budgets_are_refused_by_name(overrides, message) -> None:
    with pytest.raises(GhostedError, match=message):
        ghost_prune(build("llama"), char_tokenizer(), texts(), **CALIBRATION, **overrides)
