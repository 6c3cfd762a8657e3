"""Layer-by-layer calibration: the same statistics as the full-model pass, one decoder layer in memory."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from tiny import LAYERS, PAD, build, char_tokenizer, sequences, texts

from ghosted_hf.errors import GhostedError
from ghosted_hf.pipelines.prune import ghost_prune
from ghosted_hf.statistics import (ABS, ROTATED_ABS, StatisticsPlan, collect_statistics, least_squares, mlp_terms,
                                   next_token_loss, similarity, subblock_terms)
from ghosted_hf.statistics.layerwise import LayerwisePass, parse_memory
from ghosted_hf.text.tokens import batch_sequences

PLAN = (least_squares(0, 3) | least_squares(2, 6) | least_squares(1, 5) | similarity(1, 2) | similarity(2, 6)
        | StatisticsPlan.of(ABS(2), ABS(6), ROTATED_ABS(2)) | mlp_terms(2, 4) | subblock_terms("attention", 1)
        | subblock_terms("mlp", 3) | next_token_loss(LAYERS))


def resident_parameters() -> int:
    """Every parameter element alive in this process (off the meta device), after a collection."""
    gc.collect()
    return sum(o.numel() for o in gc.get_objects() if type(o) is torch.nn.Parameter and o.device.type != "meta")


def close(got, expected) -> None:
    for key, value in expected.tensors.items():
        torch.testing.assert_close(got.tensors[key], value, rtol=1e-10, atol=1e-10 * float(value.abs().max()),
                                   msg=key)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("offload", [False, True])
def test_layerwise_statistics_equal_the_full_model_pass(arch: str, offload: bool, tmp_path: Path) -> None:
    model = build(arch)
    model.save_pretrained(tmp_path / "model")
    batches = batch_sequences(sequences(), 4, PAD)  # padded batches: masks matter
    full = collect_statistics(model, batches, PLAN, progress=False)
    layer_params = sum(p.numel() for p in model.model.layers[0].parameters())
    del model
    gc.collect()

    lazy = LayerwisePass(tmp_path / "model", offload_folder=tmp_path if offload else None)
    resident = []
    lazy.observer = lambda i: resident.append(resident_parameters())
    stats = collect_statistics(lazy, batches, PLAN, progress=False)
    assert stats.tokens == full.tokens and set(stats.tensors) == set(full.tensors)
    close(stats, full)
    assert len(resident) == LAYERS  # deepest index 6 == depth: all layers run, each alone
    assert resident == [layer_params] * LAYERS, (resident, layer_params)


def test_pass_stops_after_the_deepest_layer_needed(tmp_path: Path) -> None:
    build("llama").save_pretrained(tmp_path / "model")
    lazy = LayerwisePass(tmp_path / "model")
    seen = []
    lazy.observer = seen.append
    collect_statistics(lazy, batch_sequences(sequences(), 4, PAD), least_squares(1, 3), progress=False)
    assert seen == [0, 1, 2]


@pytest.mark.parametrize("fitting, operator", [("sequential", "ghost"), ("independent", "ghost"),
                                               ("sequential", "normed")])
def test_ghost_prune_layerwise_equals_in_memory(fitting: str, operator: str, tmp_path: Path) -> None:
    """Sequential refits stream the patched model layer by layer: normed terms included (operators and the normed
    tensors both compared)."""
    build("llama").save_pretrained(tmp_path / "model")
    options = dict(criterion="manual", layers=[1, 2, 4], fitting=fitting, seq_len=32, num_sequences=10, batch_size=3,
                   operator=operator)
    expected = ghost_prune(build("llama"), char_tokenizer(), texts(), **options)
    got = ghost_prune(LayerwisePass(tmp_path / "model"), char_tokenizer(), texts(), **options)
    assert got.config.removed_layers == expected.config.removed_layers
    for name, operator in expected.ghost_operators().items():
        assert float((got.ghost_operators()[name] - operator).abs().max()) <= 1e-6, name
    passes = got.config.ghost_provenance["cost"]["passes"]
    assert any(p["sequential"] for p in passes) == (fitting == "sequential")


@pytest.mark.slow
def test_subblocks_and_whole_layers_layer_by_layer_equal_in_memory(tmp_path: Path) -> None:
    """unit 'mixed' at a budget: each candidate's sums, each damage (a loss off the streamed model's own head) and
    each sequential fit (sub-blocks replaced by their served module as the layer runs) streamed layer by layer give
    the in-memory choice and maps, with one decoder layer in memory at a time."""
    from test_distributed import outcome

    model = build("llama")
    model.save_pretrained(tmp_path / "model")
    layer_params = sum(p.numel() for p in model.model.layers[0].parameters())
    options = dict(unit="mixed", remove="30%", seq_len=32, num_sequences=6, batch_size=3)
    (expected_choice, expected_maps, _) = outcome(ghost_prune(model, char_tokenizer(), texts(), **options))
    del model
    gc.collect()
    lazy = LayerwisePass(tmp_path / "model")
    resident = []
    lazy.observer = lambda i: len(resident) < 2 * LAYERS and resident.append(resident_parameters())  # (a sample: slow)
    choice, maps, _ = outcome(ghost_prune(lazy, char_tokenizer(), texts(), **options))
    assert choice == expected_choice and expected_choice[1] and set(maps) == set(expected_maps)
    for key, value in expected_maps.items():
        assert float((maps[key] - value).abs().max()) <= 1e-6, key
    assert set(resident) == {layer_params}, set(resident)


def test_a_parameter_budget_is_counted_layer_by_layer(tmp_path: Path) -> None:
    build("llama").save_pretrained(tmp_path / "model")
    options = dict(remove="30%", seq_len=32, num_sequences=10, batch_size=3)
    expected = ghost_prune(build("llama"), char_tokenizer(), texts(), **options).config.removed_layers
    assert len(expected) == 2
    assert ghost_prune(LayerwisePass(tmp_path / "model"), char_tokenizer(), texts(), **options).config.removed_layers \
        == expected


def test_max_memory_sizes() -> None:
    assert parse_memory("8GiB") == 8 * 2**30 and parse_memory("500MB") == 500 * 10**6 and parse_memory("1024") == 1024
    with pytest.raises(GhostedError, match="not a size"):
        parse_memory("lots")
    for text in ("inf", "nan", "-1GB", "0"):
        with pytest.raises(GhostedError, match=f"max_memory must be a positive, finite size, got '{text}'"):
            parse_memory(text)


@pytest.mark.slow
def test_prune_chooses_layerwise_when_the_model_exceeds_max_memory(tmp_path: Path) -> None:
    import subprocess
    import sys

    build("llama").save_pretrained(tmp_path / "dense")
    char_tokenizer().save_pretrained(tmp_path / "dense")
    (tmp_path / "cal.txt").write_text("\n\n".join(texts()))
    flags = ["prune", tmp_path / "dense", "--calibration", tmp_path / "cal.txt", "--num-layers", "2", "--seq-len", "32",
             "--num-sequences", "10"]
    runs = {}
    for name, extra in (("full", []), ("auto", ["--max-memory", "20KB"]), ("forced", ["--layerwise"])):
        done = subprocess.run([sys.executable, "-m", "ghosted_hf.cli", *map(str, flags), *extra, "--output",
                               tmp_path / name], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        runs[name] = done
    assert "calibrating layer by layer" in runs["auto"].stderr and "layer by layer" not in runs["full"].stderr
    from safetensors.torch import load_file

    full = load_file(tmp_path / "full" / "model.safetensors")
    for name in ("auto", "forced"):
        other = load_file(tmp_path / name / "model.safetensors")
        assert all(float((other[k] - full[k]).abs().max()) <= 1e-6 for k in full), name


def test_layerwise_and_in_memory_shards_merge(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from ghosted_hf.pipelines.prune import calibrate
    from ghosted_hf.statistics import CalibrationStatistics, ShardSpec

    build("qwen2").save_pretrained(tmp_path / "model")
    options = dict(num_layers=2, seq_len=32, num_sequences=12, batch_size=3)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32).eval()
    whole = calibrate(loaded, char_tokenizer(), texts(), **options)
    first = calibrate(LayerwisePass(tmp_path / "model"), char_tokenizer(), texts(), shard=ShardSpec(0, 2), **options)
    second = calibrate(loaded, char_tokenizer(), texts(), shard=ShardSpec(1, 2), **options)
    merged = CalibrationStatistics.merge([first, second])
    assert merged.tokens == whole.tokens
    close(merged, whole)


def test_layerwise_build_never_reads_the_removed_layers(tmp_path: Path) -> None:
    dense = build("qwen2")
    dense.save_pretrained(tmp_path / "model")
    options = dict(criterion="manual", layers=[2, 3], seq_len=32, num_sequences=10, batch_size=3)
    expected = ghost_prune(dense, char_tokenizer(), texts(), **options)
    lazy = LayerwisePass(tmp_path / "model")
    read: list[str] = []  # tensors read by the build (after the statistics pass)
    tensor, model_for_build = lazy._tensor, lazy.model_for_build
    lazy.model_for_build = lambda removed: setattr(lazy, "_tensor", lambda name: read.append(name) or tensor(name)) \
        or model_for_build(removed)
    got = ghost_prune(lazy, char_tokenizer(), texts(), **options)
    assert "model.layers.1.mlp.up_proj.weight" in read and "model.layers.4.mlp.up_proj.weight" in read
    assert not [n for n in read if n.startswith(("model.layers.2.", "model.layers.3."))]
    want = expected.state_dict()
    assert set(got.state_dict()) == set(want)
    for name, value in got.state_dict().items():
        assert float((value - want[name]).abs().max()) <= 1e-6, name
    assert got.generation_config.to_dict() == expected.generation_config.to_dict()


@pytest.mark.parametrize("damage", ["shape", "missing", "truncated"])
def test_damaged_weights_are_one_clear_error_layer_by_layer(damage: str, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    build("llama").save_pretrained(tmp_path / "model")
    path = tmp_path / "model" / "model.safetensors"
    tensors = load_file(path)
    if damage == "shape":
        tensors["model.layers.2.mlp.up_proj.weight"] = torch.zeros(63, 32)
        save_file(tensors, path, metadata={"format": "pt"})
        message = r"The weights of model.layers.2 in .* do not fit its config: .*size mismatch for mlp.up_proj.weight"
    elif damage == "missing":
        del tensors["model.layers.2.mlp.up_proj.weight"]
        save_file(tensors, path, metadata={"format": "pt"})
        message = r"The weights of model.layers.2 in .* do not fit its config: .*Missing key"
    else:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        message = r"model.safetensors is damaged or truncated"
    with pytest.raises(GhostedError, match=message):
        lazy = LayerwisePass(tmp_path / "model")
        collect_statistics(lazy, batch_sequences(sequences(), 4, PAD), least_squares(1, 4), progress=False)
