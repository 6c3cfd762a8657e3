"""Saves are all or nothing, a re-save leaves no stale file behind, and calibration ignores train mode."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tiny import batch, build, char_tokenizer, random_operator, texts
from transformers import AutoModelForCausalLM

from ghosted_hf import ghost_prune, prune_layers, save_with_card
from ghosted_hf.io.files import REMOTE_FILES


def ghosted(seed: int = 1):
    return prune_layers(build("llama"), [1, 4], {1: random_operator(seed), 4: random_operator(seed + 1)})


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch()).logits


@pytest.mark.slow
def test_save_killed_while_writing_the_weights_keeps_the_previous_folder(tmp_path: Path) -> None:
    old = ghosted(seed=1)
    folder = save_with_card(old, tmp_path / "model", char_tokenizer())
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    script = tmp_path / "killed_save.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import transformers.modeling_utils as modeling_utils
        from safetensors.torch import save as to_bytes
        from ghosted_hf import prune_layers, save_with_card
        from tiny import build, char_tokenizer, random_operator

        def dies_half_way(tensors, filename, metadata=None):
            data = to_bytes(tensors, metadata=metadata)
            with open(filename, "wb") as handle:
                handle.write(data[: len(data) // 2])
                handle.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # no cleanup of any kind runs

        modeling_utils.safe_save_file = dies_half_way
        new = prune_layers(build("llama", seed=5), [1, 4], {{1: random_operator(7), 4: random_operator(8)}})
        save_with_card(new, {str(folder)!r}, char_tokenizer())
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == -9, done.stderr
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(folder)), logits(old))
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith(".model.saving-")]
    assert len(left) == 1, sorted(p.name for p in tmp_path.iterdir())  # what the kill left
    save_with_card(old, folder, char_tokenizer())  # the next save to the same folder removes it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["killed_save.py", "model"]


def test_sharded_resave_over_an_unsharded_save_loads_the_new_weights(tmp_path: Path) -> None:
    old, new = ghosted(seed=1), prune_layers(build("llama", seed=3), [1, 4], {1: random_operator(5)})
    old.save_pretrained(tmp_path / "model")
    char_tokenizer().save_pretrained(tmp_path / "model")
    new.save_pretrained(tmp_path / "model", max_shard_size="20KB")
    names = {p.name for p in (tmp_path / "model").iterdir()}
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names
    assert "tokenizer.json" in names  # what a model save never writes is kept
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "model")), logits(new))
    assert not list(tmp_path.glob(".model.*"))  # no staging or backup folder is left behind


def test_save_with_card_leaves_nothing_of_an_earlier_save(tmp_path: Path) -> None:
    folder = save_with_card(ghosted(), tmp_path / "model", char_tokenizer())
    (folder / "old-notes.txt").write_text("from an earlier save")
    (folder / "selection_scores.png").write_bytes(b"old plot")
    save_with_card(ghosted(seed=9), folder)  # no tokenizer this time, and a model with no selection scores
    names = {p.name for p in folder.iterdir()}
    assert names == {"README.md", "config.json", "generation_config.json", "model.safetensors", *REMOTE_FILES}


def test_train_mode_calibration_gives_the_eval_mode_operators() -> None:
    options = dict(num_layers=2, seq_len=48, num_sequences=24)
    expected = ghost_prune(build("llama", attention_dropout=0.5), char_tokenizer(), texts(), **options)
    training = build("llama", attention_dropout=0.5).train()
    got = ghost_prune(training, char_tokenizer(), texts(), **options)
    assert got.config.removed_layers == expected.config.removed_layers
    for name, operator in expected.ghost_operators().items():
        assert torch.equal(got.get_parameter(name), operator), name
    assert training.training  # the caller's model gets its mode back


@pytest.mark.parametrize("name", ["../outside.safetensors", "/etc/passwd", "sub/model.safetensors", "config.json"])
def test_an_index_cannot_point_outside_its_folder(name: str, tmp_path: Path) -> None:
    import json

    from ghosted_hf.errors import GhostedError
    from ghosted_hf.io.files import verify_folder
    from ghosted_hf.model.loading import load_model
    from ghosted_hf.statistics import LayerwisePass

    ghosted(seed=1).save_pretrained(tmp_path / "model")
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": name}}
    (tmp_path / "model" / "model.safetensors.index.json").write_text(json.dumps(index))
    for read in (verify_folder, LayerwisePass, load_model):  # inspect and push, layer-wise calibration, every load
        with pytest.raises(GhostedError, match="names files that are not plain safetensors files of"):
            read(tmp_path / "model")


def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def plant(parent: Path, stem: str) -> dict[str, Path]:
    """Scratch folders named as a killed process of this host, a running one, and another host's process left them."""
    import os
    import socket

    host = socket.gethostname()
    owners = {"killed": f"{host}~{dead_pid()}", "running": f"{host}~{os.getpid()}", "elsewhere": f"other-host~{dead_pid()}"}
    planted = {}
    for what, owner in owners.items():
        planted[what] = parent / f"{stem}{owner}-abc123"
        planted[what].mkdir(parents=True)
        (planted[what] / "model.safetensors").write_bytes(b"x" * 100)
    return planted


def test_a_write_removes_what_killed_writes_to_its_target_left_and_nothing_else(tmp_path: Path, caplog) -> None:
    """Every scratch path carries its host and process: the next write to the same target removes the leftovers
    of processes that are gone (and says so), never those of a running process or of another machine."""
    from ghosted_hf.pipelines.healing import heal

    model = ghosted()
    writers = {  # stem of the scratch path -> a write that makes one
        ".model.saving-": lambda: save_with_card(model, tmp_path / "model", char_tokenizer()),
        ".plain.saving-": lambda: model.save_pretrained(tmp_path / "plain"),
        "ghosted-heal-": lambda: heal(model, char_tokenizer(), texts(), max_steps=1, seq_len=16, per_device_train_batch_size=1,
                                      eval_sequences=0, progress=False),
    }
    for stem, write in writers.items():
        planted = plant(tmp_path, stem)
        with caplog.at_level("WARNING"):
            write()
        assert not planted["killed"].exists(), stem
        assert planted["running"].exists() and planted["elsewhere"].exists(), stem
        assert f"Removed {planted['killed']}, left by a killed process." in caplog.text, stem
    assert not [p for p in tmp_path.iterdir() if "ghosted-heal-" in p.name and "other-host" not in p.name
                and str(__import__("os").getpid()) not in p.name]  # heal's own scratch folder is gone too


@pytest.fixture(autouse=True)
def _scratch_in_tmp(tmp_path: Path, monkeypatch) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # heal's scratch folder goes under the test's folder


def test_a_save_killed_between_its_renames_is_restored_by_the_next(tmp_path: Path) -> None:
    """The previous folder is renamed aside before the new one moves in: a kill between the two renames leaves it
    aside, and the next write to that target moves it back before anything else."""
    from ghosted_hf.io.files import staged_folder

    save_with_card(ghosted(seed=1), tmp_path / "model", char_tokenizer())
    before = {p.name: p.read_bytes() for p in (tmp_path / "model").iterdir()}
    aside = plant(tmp_path, ".model.previous-")["killed"]
    for item in aside.iterdir():
        item.unlink()
    (tmp_path / "model").rename(aside / "x")
    (aside / "x").rename(tmp_path / "moved")
    aside.rmdir()
    (tmp_path / "moved").rename(aside)  # the killed save's state: the model aside, no folder at the target
    with pytest.raises(RuntimeError), staged_folder(tmp_path / "model"):
        raise RuntimeError("this save fails too")
    assert {p.name: p.read_bytes() for p in (tmp_path / "model").iterdir()} == before


def test_saved_folders_are_readable_as_any_folder_the_user_makes_and_links_stay_links(tmp_path: Path) -> None:
    """A saved model gets the caller's umask permissions (a serving container reads it), and a save through a
    symlinked folder writes where the link points and leaves no folder aside."""
    import os
    import stat

    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    for umask, folder_mode, file_mode in ((0o022, 0o755, 0o644), (0o077, 0o700, 0o600)):
        old = os.umask(umask)
        try:
            for folder in (save_with_card(ghosted(), tmp_path / "model", char_tokenizer()),
                           save_with_card(ghosted(), tmp_path / "link", char_tokenizer())):
                assert stat.S_IMODE(folder.stat().st_mode) == folder_mode, (oct(umask), folder)
                assert stat.S_IMODE((folder / "model.safetensors").stat().st_mode) == file_mode, (oct(umask), folder)
                assert stat.S_IMODE((folder / "config.json").stat().st_mode) == file_mode, (oct(umask), folder)
        finally:
            os.umask(old)
    assert (tmp_path / "link").is_symlink() and (tmp_path / "real" / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "model", "real"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_remote_codes_operator_hash_is_the_packages_tensor_hash(dtype: str) -> None:
    """The remote files keep their own copy of the tensor hash (they import nothing of ghosted_hf): both must give
    the digest every checkpoint records."""
    from ghosted_hf.remote.format_ghosted import operator_sha256
    from ghosted_hf.utils.hashing import tensor_sha256

    operator = torch.randn(16, 16, generator=torch.Generator().manual_seed(0))
    assert operator_sha256(operator, dtype) == tensor_sha256(operator.to(getattr(torch, dtype)))
    assert operator_sha256(operator, dtype) != operator_sha256(operator * 1.001, dtype)
