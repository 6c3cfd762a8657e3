"""Statistics shards for machines that share no network: collect I/N, merge, prune from the merged file."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from tiny import build, char_tokenizer, texts

from ghosted_hf.errors import GhostedError
from ghosted_hf.pipelines.prune import calibrate, ghost_prune
from ghosted_hf.statistics import CalibrationStatistics, ShardSpec

OPTIONS = dict(num_layers=2, seq_len=32, num_sequences=12, batch_size=2)  # 6 batches, 2 per shard of 3


def shards(tmp_path: Path, model=None, count: int = 3, **overrides) -> list[Path]:
    model = model if model is not None else build("llama")
    paths = []
    for i in range(count):
        path = tmp_path / f"stats-{i}-{len(list(tmp_path.iterdir()))}.safetensors"
        calibrate(model, char_tokenizer(), texts(), shard=ShardSpec(i, count), **{**OPTIONS, **overrides}).save(path)
        paths.append(path)
    return paths


def load(paths: list[Path]) -> list[CalibrationStatistics]:
    return [CalibrationStatistics.load(p) for p in paths]


def test_merged_shards_equal_the_unsharded_statistics(tmp_path: Path) -> None:
    model = build("llama")
    whole = calibrate(model, char_tokenizer(), texts(), **OPTIONS)
    paths = shards(tmp_path, model)
    merged = CalibrationStatistics.merge(load(paths))
    streamed = CalibrationStatistics.merge(paths)
    assert streamed.tokens == merged.tokens and streamed.origin == merged.origin
    assert all(torch.equal(streamed.tensors[k], merged.tensors[k]) for k in merged.tensors)
    assert merged.tokens == whole.tokens and set(merged.tensors) == set(whole.tensors)
    for key, expected in whole.tensors.items():
        torch.testing.assert_close(merged.tensors[key], expected, rtol=1e-10, atol=1e-10 * float(expected.abs().max()))
    assert merged.origin["model"] == whole.origin["model"] and merged.origin["data"] == whole.origin["data"]
    assert whole.origin["shard"] == "0/1" and "shard" not in merged.origin

    # prune fits from the merged file without another pass, and gets the unsharded result
    merged.save(tmp_path / "merged.safetensors")
    from_file = ghost_prune(build("llama"), statistics=tmp_path / "merged.safetensors", **OPTIONS)
    from_text = ghost_prune(build("llama"), char_tokenizer(), texts(), **OPTIONS)
    assert from_file.config.removed_layers == from_text.config.removed_layers
    for name, operator in from_text.ghost_operators().items():
        assert float((from_file.ghost_operators()[name] - operator).abs().max()) <= 1e-6
    assert from_file.config.ghost_provenance["cost"]["passes"] == []


def test_merge_refuses_duplicated_missing_and_mismatched_shards(tmp_path: Path) -> None:
    good = load(shards(tmp_path))
    with pytest.raises(GhostedError, match=r"Shard 1/3 is given twice"):
        CalibrationStatistics.merge([good[0], good[1], good[1]])
    with pytest.raises(GhostedError, match=r"Shard\(s\) 2/3 missing"):
        CalibrationStatistics.merge(good[:2])
    other_model = load(shards(tmp_path, build("llama", seed=5)))
    with pytest.raises(GhostedError, match="different model"):
        CalibrationStatistics.merge([good[0], good[1], other_model[2]])
    other_plan = load(shards(tmp_path, num_layers=3))
    with pytest.raises(GhostedError, match="different statistics plan"):
        CalibrationStatistics.merge([good[0], good[1], other_plan[2]])
    other_data = load(shards(tmp_path, num_sequences=10))
    with pytest.raises(GhostedError, match="different calibration data"):
        CalibrationStatistics.merge([good[0], good[1], other_data[2]])
    other_count = load(shards(tmp_path, count=2))
    with pytest.raises(GhostedError, match="different number of shards"):
        CalibrationStatistics.merge([good[0], good[1], other_count[1]])
    whole = calibrate(build("llama"), char_tokenizer(), texts(), **OPTIONS)
    whole.origin.pop("shard")
    with pytest.raises(GhostedError, match="not a statistics shard"):
        CalibrationStatistics.merge([good[0], whole])
    with pytest.raises(GhostedError, match="does not exist"):
        ShardSpec.parse("3/3")
    with pytest.raises(GhostedError, match="not of the form I/N"):
        ShardSpec.parse("first")


def test_prune_refuses_one_shard_and_another_models_statistics(tmp_path: Path) -> None:
    paths = shards(tmp_path)
    with pytest.raises(GhostedError, match="shard 0/3 only: merge all shards first"):
        ghost_prune(build("llama"), statistics=paths[0], **OPTIONS)
    CalibrationStatistics.merge(load(paths)).save(tmp_path / "merged.safetensors")
    with pytest.raises(GhostedError, match="other weights"):
        ghost_prune(build("llama", seed=3), statistics=tmp_path / "merged.safetensors", **OPTIONS)
    with pytest.raises(GhostedError, match="another config"):
        ghost_prune(build("llama", intermediate_size=48), statistics=tmp_path / "merged.safetensors", **OPTIONS)


def ghosted(*args, cwd: Path) -> subprocess.CompletedProcess:
    """`ghosted ARGS` run by `main` (what the console script calls) in this process, its output captured: the same
    exit status and lines as a subprocess, without importing torch and transformers once per command
    (tests/test_cli.py runs the command in subprocesses)."""
    import contextlib
    import io

    from ghosted_hf.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), contextlib.chdir(cwd):
        status = main([str(a) for a in args])
    return subprocess.CompletedProcess(list(args), status, out.getvalue(), err.getvalue())


@pytest.mark.slow
def test_stats_collect_merge_and_prune_on_the_command_line(tmp_path: Path) -> None:
    build("llama").save_pretrained(tmp_path / "dense")
    char_tokenizer().save_pretrained(tmp_path / "dense")
    (tmp_path / "cal.txt").write_text("\n\n".join(texts()))
    flags = ["--num-layers", "2", "--seq-len", "32", "--num-sequences", "12", "--batch-size", "2"]
    for i in range(3):
        done = ghosted("stats", "collect", tmp_path / "dense", "--calibration", tmp_path / "cal.txt", "--shard",
                       f"{i}/3", "--output", tmp_path / f"stats-{i}.safetensors", *flags, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert f"Wrote shard {i}/3" in done.stdout
    bad = ghosted("stats", "merge", tmp_path / "stats-0.safetensors", tmp_path / "stats-2.safetensors", "--output",
                  tmp_path / "x.safetensors", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.startswith("ghosted stats merge: error: Shard(s) 1/3 missing")
    assert not (tmp_path / "x.safetensors").exists()
    done = ghosted("stats", "merge", *(tmp_path / f"stats-{i}.safetensors" for i in range(3)), "--output",
                   tmp_path / "stats.safetensors", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    pruned = ghosted("prune", tmp_path / "dense", "--statistics", tmp_path / "stats.safetensors", "--output",
                     tmp_path / "out", *flags, cwd=tmp_path)
    assert pruned.returncode == 0, pruned.stderr
    assert (tmp_path / "out" / "model.safetensors").is_file()
    again = ghosted("stats", "merge", tmp_path / "stats-0.safetensors", "--output", tmp_path / "stats.safetensors",
                    cwd=tmp_path)
    assert again.returncode == 2 and "already exists" in again.stderr
    bad = ghosted("stats", "collect", tmp_path / "dense", "--shard", "5/3", "--output", tmp_path / "s.safetensors",
                  cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip() == ("ghosted stats collect: error: Shard 5/3 does not exist: use "
                                                          "I/N with 0 <= I < N (e.g. 0/3, 1/3, 2/3).")


def test_a_shard_with_altered_values_is_refused(tmp_path: Path) -> None:
    """A few elements of one shard's tensor multiplied by 1.5 (the file rewritten with its old metadata):
    merge and prune refuse it instead of summing it."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    paths = shards(tmp_path)
    with safe_open(str(paths[1]), framework="pt") as handle:
        metadata = handle.metadata()
    tensors = load_file(paths[1])
    key = sorted(k for k in tensors if k.startswith("cross."))[0]
    tensors[key][0, :3] *= 1.5
    save_file(tensors, str(paths[1]), metadata=metadata)
    with pytest.raises(GhostedError, match=rf"tensor {key} does not match the sha256 recorded for it"):
        CalibrationStatistics.merge(paths)
    with pytest.raises(GhostedError, match=rf"{paths[1].name}: tensor {key} does not match"):
        CalibrationStatistics.load(paths[1])


def test_statistics_must_name_their_model_and_fit_its_depth(tmp_path: Path) -> None:
    stats = calibrate(build("llama", num_hidden_layers=8), char_tokenizer(), texts(), **OPTIONS)
    with pytest.raises(GhostedError, match="collected on a model of 8 layers of width 32, not this one \\(6 x 32\\)"):
        ghost_prune(build("llama"), statistics=stats, **OPTIONS)
    anonymous = calibrate(build("llama"), char_tokenizer(), texts(), **OPTIONS)
    anonymous.origin.pop("model")
    anonymous.save(tmp_path / "anonymous.safetensors")
    with pytest.raises(GhostedError, match="do not record the model they were collected on"):
        ghost_prune(build("llama"), statistics=tmp_path / "anonymous.safetensors", **OPTIONS)


def test_subblock_units_prune_from_shards_as_from_text(tmp_path: Path) -> None:
    """The candidates' dense sums come from merged `stats collect` shards; the damage and the later sequential fits are
    passes on the calibration text: the same choice and maps as from the text alone."""
    mixed = dict(unit="mixed", remove="30%", seq_len=32, num_sequences=12, batch_size=2)
    merged = CalibrationStatistics.merge(load(shards(tmp_path, **mixed)))
    merged.save(tmp_path / "merged.safetensors")
    with pytest.raises(GhostedError, match="pass a tokenizer and calibration text"):
        ghost_prune(build("llama"), statistics=tmp_path / "merged.safetensors", **mixed)
    from_file = ghost_prune(build("llama"), char_tokenizer(), texts(), statistics=tmp_path / "merged.safetensors", **mixed)
    from_text = ghost_prune(build("llama"), char_tokenizer(), texts(), **mixed)
    assert (from_file.config.removed_layers, from_file.config.ghost_provenance["selection"]) == (
        from_text.config.removed_layers, from_text.config.ghost_provenance["selection"])
    assert [r["original_layer"] for r in from_file.config.ghost_subblocks] == [
        r["original_layer"] for r in from_text.config.ghost_subblocks]
    expected = from_text.state_dict()
    for name, tensor in from_file.state_dict().items():
        assert float((tensor - expected[name]).abs().max()) <= 1e-6, name
    purposes = lambda model: [p["purpose"] for p in model.config.ghost_provenance["cost"]["passes"]]  # noqa: E731
    assert "statistics of every candidate" in purposes(from_text)
    assert "statistics of every candidate" not in purposes(from_file)
    # Statistics of one text and passes on another would be mixed in one fit: refused.
    with pytest.raises(GhostedError, match="collected on other calibration tokens"):
        ghost_prune(build("llama"), char_tokenizer(), texts(seed=1), statistics=tmp_path / "merged.safetensors",
                    **mixed)
