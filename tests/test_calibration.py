"""Streaming statistics on tiny models: exactness, padding, truncation, the patched stream, errors, offload,
files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny import LAYERS, PAD, build, sequences
from transformers import AutoModelForCausalLM

from ghosted_hf.errors import GhostedError
from ghosted_hf.statistics import (ABS, ANGULAR, COSINE, CROSS, ENERGY, GRAM, MLP_GRAM, MLP_SOURCE, MLP_TARGET,
                                   ROTATED_ABS, CalibrationStatistics, Patch, StatisticsPlan, collect_statistics,
                                   least_squares, mlp_terms, next_token_loss, normed_terms, similarity,
                                   subblock_terms)
from ghosted_hf.statistics.declarations import STATISTICS, parse_key
from ghosted_hf.text.tokens import batch_sequences

PLAN = (least_squares(0, 3) | least_squares(2, 6) | similarity(1, 2) | similarity(2, 6)
        | StatisticsPlan.of(ABS(2), ABS(6), ROTATED_ABS(2)) | mlp_terms(2, 4) | normed_terms(2, 6)
        | subblock_terms("attention", 1) | subblock_terms("mlp", 3) | next_token_loss(LAYERS))


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
    blocks: dict[str, list[torch.Tensor]] = {"attention_in": [], "attention_out": [], "mlp_in": [], "mlp_out": []}
    hooks += [model.model.layers[1].self_attn.register_forward_pre_hook(
                  lambda m, a, k: blocks["attention_in"].append(k["hidden_states"][0]), with_kwargs=True),
              model.model.layers[1].self_attn.register_forward_hook(lambda m, a, o: blocks["attention_out"].append(o[0][0])),
              model.model.layers[3].mlp.register_forward_pre_hook(lambda m, a: blocks["mlp_in"].append(a[0][0])),
              model.model.layers[3].mlp.register_forward_hook(lambda m, a, o: blocks["mlp_out"].append(o[0]))]
    loss = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for seq in seqs:
            ids = torch.tensor([seq])
            loss += torch.nn.functional.cross_entropy(model(ids).logits[0, :-1], ids[0, 1:], reduction="none").double().sum()
    for h in hooks:
        h.remove()
    x = {i: torch.cat(v).double() for i, v in inputs.items()}
    b = {k: torch.cat(v).double() for k, v in blocks.items()}
    m = torch.cat(mlp_out).double()
    cos = lambda a, b: torch.nn.functional.cosine_similarity(a, b, dim=1)
    n = x[2] / (x[2].square().mean(1, keepdim=True) + 1e-6).sqrt()  # n(x) = x / rms(x)
    return {
        "ngram.2": n.T @ n, "nsource.2": n.T @ x[2], "ncross.2.6": n.T @ x[6],
        "gram.0": x[0].T @ x[0], "gram.2": x[2].T @ x[2], "cross.0.3": x[0].T @ x[3], "cross.2.6": x[2].T @ x[6],
        "energy.2.6": x[6].square().sum().reshape(1), "cos.1.2": cos(x[1], x[2]).sum().reshape(1),
        "abs.6": x[6].abs().sum(0), "mlp_gram.2": m.T @ m, "mlp_source.2": m.T @ x[2], "mlp_target.2.4": m.T @ x[4],
        "attn_in.1": b["attention_in"].T @ b["attention_in"], "attn_out.1": b["attention_out"].square().sum().reshape(1),
        "attn_in_out.1": b["attention_in"].T @ b["attention_out"], "mlp_in_out.3": b["mlp_in"].T @ b["mlp_out"],
        "mlp_in.3": b["mlp_in"].T @ b["mlp_in"], "mlp_out.3": b["mlp_out"].square().sum().reshape(1),
        f"loss.{LAYERS}": loss.reshape(1),
        f"labels.{LAYERS}": torch.tensor([sum(len(seq) - 1 for seq in seqs)], dtype=torch.float64),
    }


def test_streaming_equals_in_memory_and_padding_is_excluded() -> None:
    model = build("llama")
    seqs = sequences()
    reference = in_memory(model, seqs)
    # One sequence per batch: the same float32 activations, so only float64 summation order differs.
    # Four per batch (right-padded): float32 kernels on other shapes differ in the last bits.
    for batch_size, tolerance in ((1, 1e-12), (4, 1e-5)):
        stats = collect_statistics(model, batch_sequences(seqs, batch_size, PAD), PLAN, progress=False,
                                   partial="float64")
        assert stats.tokens == sum(map(len, seqs))
        for key, expected in reference.items():
            # (the loss's logits are made a few positions at a time: float32 products of other shapes)
            bound = max(tolerance, 1e-7) if key.startswith("loss") else tolerance
            assert relative_error(stats.tensors[key], expected) < bound, (batch_size, key)
        assert stats[COSINE(1, 2)] is stats.tensors["cos.1.2"]
    # Each chunk's products formed in float32 (the default), added to float64 totals: float32 rounding of sums of
    # <= 256 rows.
    stats = collect_statistics(model, batch_sequences(seqs, 4, PAD), PLAN, progress=False)
    assert stats.origin["partial_sums"] == "float32" and all(t.dtype == torch.float64 for t in stats.tensors.values())
    worst = max((relative_error(stats.tensors[key], expected), key) for key, expected in reference.items())
    assert 1e-9 < worst[0] < 1e-5, worst
    reference_sums = collect_statistics(model, batch_sequences(seqs, 4, PAD), PLAN, progress=False, partial="float64")
    assert stats.with_tensors(reference_sums).origin["partial_sums"] == "float32 and float64"  # a merge says both
    with pytest.raises(GhostedError, match="Partial sums are formed in float64 or float32, got 'bfloat16'"):
        collect_statistics(model, batch_sequences(seqs, 4, PAD), PLAN, progress=False, partial="bfloat16")


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
    plan = least_squares(1, 3)
    collect_statistics(model, batch_sequences(sequences(), 2, PAD), plan, progress=False)
    assert set(calls) == {0, 1, 2}  # layer 3 is never run: its input is the deepest statistic
    assert plan.deepest() == 3


def test_non_finite_activations_name_the_layer() -> None:
    model = build("llama")
    with torch.no_grad():
        model.model.layers[2].mlp.down_proj.weight[0, 0] = float("inf")
    plan = StatisticsPlan.of(GRAM(1), GRAM(4))
    with pytest.raises(FloatingPointError, match="the input of layer 3"):
        collect_statistics(model, batch_sequences(sequences(), 2, PAD), plan, progress=False)


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


def test_statistics_refuse_indices_that_do_not_exist() -> None:
    with pytest.raises(GhostedError, match="MLP terms need a layer before the source"):
        MLP_GRAM(0)
    with pytest.raises(GhostedError, match="takes 2 non-negative layer index"):
        CROSS(3)
    with pytest.raises(GhostedError, match="'rotation.2' is not a statistic ghosted_hf writes"):
        parse_key("rotation.2")


def test_every_declared_statistic_round_trips_through_its_key() -> None:
    for statistic in STATISTICS.values():
        entry = statistic(*range(1, statistic.arity + 1))
        assert parse_key(entry.key) == entry and entry.key.startswith(statistic.name + ".")
    assert {e.statistic for e in PLAN} == set(STATISTICS.values())  # PLAN exercises every declaration


def test_plans_combine_and_know_what_is_missing() -> None:
    a = least_squares(1, 3)
    b = StatisticsPlan.of(GRAM(2), ABS(1), ABS(3))
    union = a | b
    assert union == StatisticsPlan.of(GRAM(1), CROSS(1, 3), ENERGY(1, 3), GRAM(2), ABS(1), ABS(3))
    assert StatisticsPlan.union([a, b]) == union and not StatisticsPlan()
    stats = collect_statistics(build("llama"), batch_sequences(sequences(), 2, PAD), a, progress=False)
    assert set(stats.tensors) == {"gram.1", "cross.1.3", "energy.1.3"}
    assert union.missing_from(stats.tensors) == b
    assert not a.missing_from(stats.tensors)
    at_source, rest = union.split_at(1)
    assert at_source == StatisticsPlan.of(GRAM(1), CROSS(1, 3), ENERGY(1, 3), ABS(1))
    assert rest == StatisticsPlan.of(GRAM(2), ABS(3))
    assert StatisticsPlan.from_json(union.to_json()) == union
    assert similarity(2, 5) == StatisticsPlan.of(COSINE(2, 5), ANGULAR(2, 5))
    assert mlp_terms(2, 5) == StatisticsPlan.of(MLP_GRAM(2), MLP_SOURCE(2), MLP_TARGET(2, 5))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_patched_stream_equals_the_built_pruned_model(arch: str) -> None:
    """The patched stream (the dense model run with layers left out, operator pre-hooks and MLP transforms) gives
    the statistics of the model that surgery builds, pruned numbering mapped back to dense numbering; qwen2's
    mixed layer types must follow the kept layers."""
    from ghosted_hf.model.folding import fold_into_mlp_writers
    from ghosted_hf.model.surgery import prune_layers

    model = build(arch)
    generator = torch.Generator().manual_seed(3)
    w = torch.eye(32) + 0.05 * torch.randn(32, 32, generator=generator)
    t = torch.eye(32) + 0.05 * torch.randn(32, 32, generator=generator)
    a = 0.05 * torch.randn(32, 32, generator=generator)  # a normed term
    patch = Patch((1, 2), operators={1: w}, transforms={0: t}, normed={1: a})
    batches = batch_sequences(sequences(), 3, PAD)
    # Sources at dense layer 4 (pruned 2) and MLP output of dense layer 3 (pruned 1); targets from the dense model.
    plan = least_squares(4, 6) | mlp_terms(4, 6)
    got = collect_statistics(model, batches, plan, patch=patch, progress=False)
    assert model.config.num_hidden_layers == LAYERS and len(model.model.layers) == LAYERS  # restored
    pruned = prune_layers(model, [1, 2], {1: w}, normed={1: a})
    fold_into_mlp_writers(pruned, 0, t.double())
    sources = collect_statistics(pruned, batches, least_squares(2, 2) | StatisticsPlan.of(MLP_GRAM(2), MLP_SOURCE(2)),
                                 progress=False)
    dense = collect_statistics(model, batches, StatisticsPlan.of(ENERGY(6, 6)), progress=False)
    assert relative_error(got[GRAM(4)], sources[GRAM(2)]) < 1e-5
    assert relative_error(got[MLP_GRAM(4)], sources[MLP_GRAM(2)]) < 1e-5
    assert relative_error(got[MLP_SOURCE(4)], sources[MLP_SOURCE(2)]) < 1e-5
    assert torch.equal(got[ENERGY(4, 6)], dense[ENERGY(6, 6)])  # the target side is the dense model's
    unpatched = collect_statistics(model, batches, plan, progress=False)
    assert relative_error(got[GRAM(4)], unpatched[GRAM(4)]) > 1e-2  # the patch changed the source


def test_statistics_files_refuse_damage(tmp_path: Path) -> None:
    stats = collect_statistics(build("llama"), batch_sequences(sequences(), 2, PAD), least_squares(1, 3),
                               progress=False)
    path = tmp_path / "stats.safetensors"
    stats.save(path)
    raw = bytearray(path.read_bytes())
    raw[-8] ^= 0xFF  # one byte of the last tensor's data
    (tmp_path / "flipped.safetensors").write_bytes(bytes(raw))
    with pytest.raises(GhostedError, match="does not match the sha256 recorded for it"):
        CalibrationStatistics.load(tmp_path / "flipped.safetensors")
    (tmp_path / "text.safetensors").write_text("not a tensor file")
    with pytest.raises(GhostedError, match="is not a readable safetensors file"):
        CalibrationStatistics.load(tmp_path / "text.safetensors")
    from safetensors.torch import save_file

    save_file({"gram.1": torch.zeros(32, 32, dtype=torch.float64)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(GhostedError, match="is not a ghosted_hf statistics file"):
        CalibrationStatistics.load(tmp_path / "other.safetensors")


def rewritten(path: Path, out: Path, metadata: dict | None = None, tensors: dict | None = None,
              rehash: bool = False) -> Path:
    """`path` written again with changed metadata or tensors (the integrity hash recomputed only with `rehash`)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from ghosted_hf.statistics.store import metadata_sha256

    with safe_open(str(path), framework="pt") as handle:
        meta = dict(handle.metadata())
    meta.update(metadata or {})
    meta = {k: v for k, v in meta.items() if v is not None}
    if rehash:
        meta["integrity"] = metadata_sha256(meta)
    save_file({**load_file(str(path)), **(tensors or {})}, str(out), metadata=meta)
    return out


@pytest.mark.parametrize("change", [{"tokens": "0"}, {"tokens": "-5"}, {"rotation_kind": "sideways"},
                                    {"origin": "{}"}, {"origin": None}, {"depth": "1"}, {"hidden_size": "31"}])
def test_statistics_metadata_is_under_the_integrity_hash_and_range_checked(change: dict, tmp_path: Path) -> None:
    """A relabelled shard, a removed model hash, a zero token count: the integrity hash refuses any edit, and a
    file whose hash was forged to match is still refused field by field."""
    stats = collect_statistics(build("llama"), batch_sequences(sequences(), 2, PAD), least_squares(1, 3),
                               progress=False)
    stats.origin = {"model": {"config_sha256": "c", "weights_sha256": {"tensors": "w"}}, "shard": "1/2"}
    path = tmp_path / "stats.safetensors"
    stats.save(path)
    assert CalibrationStatistics.load(path).origin == stats.origin
    with pytest.raises(GhostedError, match="does not match its integrity hash: a field was changed"):
        CalibrationStatistics.load_header(rewritten(path, tmp_path / "edited.safetensors", change))
    forged = rewritten(path, tmp_path / "forged.safetensors", change, rehash=True)
    if change.get("origin") is not None:  # a consistent file of whole statistics without a model: valid on its own
        assert CalibrationStatistics.load_header(forged).origin == {}
        return
    with pytest.raises(GhostedError, match=r"stats.safetensors|forged.safetensors") as raised:
        CalibrationStatistics.load(forged)
    assert "\n" not in str(raised.value)


def test_a_statistics_gram_that_is_no_gram_matrix_is_refused(tmp_path: Path) -> None:
    stats = collect_statistics(build("llama"), batch_sequences(sequences(), 2, PAD), least_squares(1, 3),
                               progress=False)
    path = tmp_path / "stats.safetensors"
    stats.save(path)
    gram = stats.gram(1).clone()
    for name, damaged in {"asymmetric": gram + torch.triu(torch.ones_like(gram)),
                          "negative diagonal": gram - 2 * torch.diag(torch.diagonal(gram)),
                          "beyond Cauchy-Schwarz": gram + 10 * gram.abs().max() * (1 - torch.eye(len(gram)))}.items():
        from ghosted_hf.utils.hashing import tensor_sha256

        hashes = json.loads(__import__("safetensors").safe_open(str(path), "pt").metadata()["sha256"])
        out = rewritten(path, tmp_path / "bad.safetensors", {"sha256": json.dumps({**hashes, "gram.1": tensor_sha256(
            damaged)}, sort_keys=True)}, {"gram.1": damaged}, rehash=True)
        with pytest.raises(GhostedError, match="gram.1 is not a Gram matrix"):
            CalibrationStatistics.load(out)
        assert name


def test_the_same_weights_saved_again_are_the_same_model(tmp_path: Path) -> None:
    """Weights are identified by their tensors: a re-save (other shards, other header order) is the same model,
    one changed value is another."""
    from ghosted_hf.statistics import model_fingerprint

    model = build("llama")
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    one, sharded = model_fingerprint(model, tmp_path / "one"), model_fingerprint(model, tmp_path / "sharded")
    assert one == sharded
    with torch.no_grad():
        model.model.norm.weight[0] += 1
    model.save_pretrained(tmp_path / "changed")
    assert model_fingerprint(model, tmp_path / "changed")["weights_sha256"] != one["weights_sha256"]


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

    from ghosted_hf.statistics import passes

    model = build("llama")
    captured: list[weakref.ref] = []
    capture = passes.capture_hidden_states

    def recording(*args, **kwargs):
        got = capture(*args, **kwargs)
        captured.extend(weakref.ref(t) for t in got.values())
        return got

    alive_at_start: list[int] = []
    model.model.layers[0].register_forward_pre_hook(
        lambda m, a: alive_at_start.append(sum(ref() is not None for ref in captured)))
    monkeypatch.setattr(passes, "capture_hidden_states", recording)
    collect_statistics(model, batch_sequences(sequences(), 2, PAD), PLAN, progress=False)
    assert len(alive_at_start) >= 3 and captured
    assert alive_at_start == [0] * len(alive_at_start)
