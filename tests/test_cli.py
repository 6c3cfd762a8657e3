"""The `ghosted` command line, run in subprocesses as a user would."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import build, char_tokenizer, texts

from ghosted_hf.cli import build_parser
from ghosted_hf.options import PruneOptions


def ghosted(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ghosted_hf.cli", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_prune_dry_run_then_prune_then_inspect(dense_folder: Path, tmp_path: Path) -> None:
    common = ["prune", dense_folder, "--calibration", tmp_path / "cal.txt", "--num-layers", "2", "--seq-len", "48",
              "--num-sequences", "16", "--criterion", "streamline"]
    dry = ghosted(*common, "--output", tmp_path / "out", "--dry-run", cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert "--dry-run: nothing written" in dry.stdout and "relative_residual=" in dry.stdout
    assert "selection       : streamline (higher is better)" in dry.stdout and "fewer)" in dry.stdout
    assert not (tmp_path / "out").exists()

    done = ghosted(*common, "--output", tmp_path / "out", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    files = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"config.json", "model.safetensors", "modeling_ghosted.py", "configuration_ghosted.py", "tokenizer.json"} <= files
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["ghost_provenance"]["options"]["criterion"] == "streamline"

    shown = ghosted("inspect", tmp_path / "out", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert f"removed {config['removed_layers']}" in shown.stdout and ".ghost.operator [32, 32]" in shown.stdout


def test_inspect_shows_how_a_stock_checkpoint_was_made(dense_folder: Path, tmp_path: Path, capsys) -> None:
    from ghosted_hf.cli import main

    assert main(["prune", str(dense_folder), "--calibration", str(tmp_path / "cal.txt"), "--num-layers", "2",
                 "--seq-len", "48", "--num-sequences", "16", "--operator", "folded", "--output",
                 str(tmp_path / "stock")]) == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "stock")]) == 0
    shown = capsys.readouterr().out
    assert "folded into the weights (a stock checkpoint" in shown and "relative_residual=" in shown
    assert "operator tensors" not in shown and "(llama)" in shown


@pytest.mark.slow
def test_cli_errors_are_clear(dense_folder: Path, tmp_path: Path) -> None:
    bad = ghosted("prune", dense_folder, "--calibration", tmp_path / "cal.txt", "--num-layers", "6", "--dry-run", cwd=tmp_path)
    assert bad.returncode == 2 and "num_layers must be between 1 and 5" in bad.stderr
    bad = ghosted("prune", dense_folder, "--operator", "magic", "--dry-run", cwd=tmp_path)
    assert bad.returncode == 2 and "invalid choice: 'magic'" in bad.stderr
    bad = ghosted("inspect", dense_folder, cwd=tmp_path)
    assert bad.returncode != 0 and "holds a 'llama' model that ghosted_hf did not make" in bad.stderr


def test_cli_flags_are_generated_from_the_options() -> None:
    prune = build_parser()._subparsers._group_actions[0].choices["prune"]
    dests = {action.dest for action in prune._actions}
    assert {f.name for f in dataclasses.fields(PruneOptions)} <= dests
    args = build_parser().parse_args(["prune", "m", "--criterion", "manual", "--layers", "3", "4", "--ridge", "0.01"])
    assert (args.layers, args.ridge, args.num_layers) == ([3, 4], 0.01, PruneOptions().num_layers)


EVIL = """
import os
open(os.environ["EVIL_MARKER"], "w").write("ran")
from transformers import LlamaForCausalLM


class EvilForCausalLM(LlamaForCausalLM):
    pass
"""


def test_eval_runs_custom_code_only_when_trusted(tmp_path: Path, monkeypatch) -> None:
    """A plain folder whose config points at its own Python code: `ghosted eval` loads the stock class
    unless --trust-remote-code is given."""
    from ghosted_hf.cli import main

    folder = tmp_path / "custom"
    build("llama").save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_evil.py").write_text(EVIL)
    (tmp_path / "text.txt").write_text("\n\n".join(texts(4)))
    marker = tmp_path / "marker"
    monkeypatch.setenv("EVIL_MARKER", str(marker))
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    common = ["eval", str(folder), "--text", str(tmp_path / "text.txt"), "--windows", "1", "--seq-len", "32"]
    assert main(common) == 0 and not marker.exists()
    assert main([*common, "--trust-remote-code"]) == 0 and marker.read_text() == "ran"


@pytest.mark.slow
def test_eval_a_hub_id_at_a_revision_offline(tmp_path: Path) -> None:
    from fake_hub import build_hub_cache
    from tiny import random_operator

    from ghosted_hf import prune_layers

    folder = tmp_path / "ghosted"
    prune_layers(build("llama"), [2], {2: random_operator(1)}).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    commit = "89abcdef0123456789abcdef0123456789abcdef"
    build_hub_cache(tmp_path / "cache", "tester/tiny-ghost", folder, commit=commit)
    (tmp_path / "text.txt").write_text("\n\n".join(texts(4)))
    done = subprocess.run([sys.executable, "-m", "ghosted_hf.cli", "eval", "tester/tiny-ghost", "--revision", commit,
                           "--text", tmp_path / "text.txt", "--windows", "1", "--seq-len", "32"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["perplexity_tokens"] == 32


def test_heal_trains_on_the_text_by_default_and_distills_from_the_base_on_request(dense_folder: Path,
                                                                                   tmp_path: Path) -> None:
    from ghosted_hf.cli import main

    cal = tmp_path / "cal.txt"
    assert main(["prune", str(dense_folder), "--calibration", str(cal), "--num-layers", "2", "--seq-len", "48",
                 "--num-sequences", "16", "--output", str(tmp_path / "out")]) == 0
    records = {}
    for name, extra in (("default", []), ("base", ["--teacher", "base"])):
        assert main(["heal", str(tmp_path / "out"), "--output", str(tmp_path / name), "--data", str(cal), "--max-steps", "2",
                     "--seq-len", "32", *extra]) == 0
        records[name] = json.loads((tmp_path / name / "config.json").read_text())["ghost_provenance"]["healing"]
    assert records["default"]["loss"] == "next-token cross-entropy" and records["default"]["teacher"] is None
    assert records["default"]["steps"] == 2 and records["default"]["rank"] == 8
    assert records["base"]["loss"] == "KL to the teacher's logits"
    assert Path(records["base"]["teacher"]).resolve() == dense_folder.resolve()


def test_a_bug_is_a_traceback_with_a_hint_not_an_input_error(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Only bad input (a GhostedError, or a file the OS refuses) is one line with exit status 2; anything else
    is a bug in ghosted_hf and says so, with its traceback."""
    from ghosted_hf import cli

    def broken(args):
        raise ValueError("an internal invariant failed")  # a ValueError that is not a GhostedError

    monkeypatch.setattr(cli, "cmd_inspect", broken)
    assert cli.main(["inspect", "anywhere"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "an internal invariant failed" in err
    assert "internal error (a bug in ghosted_hf, not a problem with your input)" in err and "report" in err


def test_inspect_refuses_what_from_pretrained_refuses(tmp_path: Path, capsys) -> None:
    """`inspect` exits 2 with one line on a folder whose config contradicts itself or its weights."""
    from tiny import random_operator

    from ghosted_hf import prune_layers, save_with_card
    from ghosted_hf.cli import main

    save_with_card(prune_layers(build("llama"), [2, 3], {2: random_operator(1)}), tmp_path / "ok", char_tokenizer())
    assert main(["inspect", str(tmp_path / "ok")]) == 0
    capsys.readouterr()
    for name, edit, message in [
        ("version", lambda c: c.update(ghost_format_version="2.0"), "Ghosted format 2.0, newer than this code reads"),
        ("depth", lambda c: (c["text_config"].update(num_hidden_layers=3), c.update(original_num_hidden_layers=5)),
         "config.json claims 3 decoder layers, but the weight files hold 4"),
        ("boundaries", lambda c: c.update(removed_layers=[1, 2], ghost_boundaries=[]), "do not match removed_layers")]:
        folder = tmp_path / name
        shutil.copytree(tmp_path / "ok", folder)
        config = json.loads((folder / "config.json").read_text())
        edit(config)
        (folder / "config.json").write_text(json.dumps(config))
        assert main(["inspect", str(folder)]) == 2, name
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, (name, err)


@pytest.mark.parametrize("command", [["heal", "some-folder", "--output", "out"],
                                     ["export-stock", "some-folder", "--output", "out"],
                                     ["eval", "some-folder"]])
def test_dtype_is_honoured_by_every_command_that_loads(command: list[str], monkeypatch, tmp_path: Path) -> None:
    from ghosted_hf import cli
    from ghosted_hf.errors import GhostedError

    seen = []

    def load_model(ref, **kwargs):
        seen.append(kwargs.get("dtype"))
        raise GhostedError("stop here")

    for module in list(sys.modules.values()):  # every command module that loads a model
        if getattr(module, "__name__", "").startswith("ghosted_hf.cli") and hasattr(module, "load_model"):
            monkeypatch.setattr(module, "load_model", load_model)
    monkeypatch.chdir(tmp_path)
    assert cli.main([*command, "--dtype", "bfloat16"]) == 2
    assert seen == ["bfloat16"]


@pytest.mark.slow
def test_heal_bad_input_is_one_line_naming_the_value(dense_folder: Path, tmp_path: Path, capsys) -> None:
    from ghosted_hf.cli import main

    cal = tmp_path / "cal.txt"
    assert main(["prune", str(dense_folder), "--calibration", str(cal), "--num-layers", "2", "--seq-len", "48",
                 "--num-sequences", "16", "--output", str(tmp_path / "pruned")]) == 0
    (tmp_path / "rows.jsonl").write_text('{"body": "some text"}\n')
    (tmp_path / "empty.txt").write_text("\n\n")
    pruned = str(tmp_path / "pruned")
    cases = {
        "same folder": (["--output", pruned], f"is the input {pruned}"),
        "missing column": (["--data", str(tmp_path / "rows.jsonl")], "no 'text' column (columns: ['body'])"),
        "empty data": (["--data", str(tmp_path / "empty.txt")], "The training data (empty.txt) holds no text."),
        "zero budget": (["--max-steps", "0"], "max_steps must be positive (or -1: 150 unless tokens or minutes), got 0"),
        "nan budget": (["--minutes", "nan"], "minutes must be a finite number, got nan"),
        "other vocabulary": (["--teacher", str(tmp_path / "other")], "The teacher has a vocabulary of 200 tokens"),
        "dense model": (["--output", str(tmp_path / "o2")], "records no pruning"),
    }
    from tiny import build, char_tokenizer

    build("llama", vocab_size=200).save_pretrained(tmp_path / "other")
    char_tokenizer().save_pretrained(tmp_path / "other")
    capsys.readouterr()
    for name, (flags, message) in cases.items():
        folder = str(dense_folder) if name == "dense model" else pruned
        output = [] if "--output" in flags else ["--output", str(tmp_path / "out")]
        assert main(["heal", folder, "--seq-len", "32", *output, *flags]) == 2, name
        err = capsys.readouterr().err  # the loading bars, then the one line
        assert message in err.strip().splitlines()[-1] and "Traceback" not in err, (name, err)
        assert not (tmp_path / "out").exists(), name


def test_the_demo_removes_what_each_packaged_model_declares(dense_folder: Path, fake_demo) -> None:
    """`ghosted demo --model gemma3-270m` removes Gemma 3's 4 of 18 layers (the README's numbers), the default model
    its 8 of 30; --num-layers wins, and a folder gets the options' default."""
    from ghosted_hf.cli import main

    for argv in (["--model", "gemma3-270m"], [], ["--model", "gemma3-270m", "--num-layers", "6"],
                 ["--model", str(dense_folder)]):
        assert main(["demo", *argv]) == 0
    assert fake_demo == [("gemma3-270m", 4), (None, 8), ("gemma3-270m", 6), (str(dense_folder), PruneOptions().num_layers)]


def test_the_demo_measures_three_models_in_the_memory_of_two(dense_folder: Path, tmp_path: Path) -> None:
    """The demo's plainly pruned model holds the dense model's own tensors, and scoring it leaves the dense model
    whole: each row's perplexity is that of a model loaded on its own."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ghosted_hf import assets
    from ghosted_hf.evaluate import perplexity
    from ghosted_hf.model.folding import to_stock_model
    from ghosted_hf.model.surgery import prune_layers
    from ghosted_hf.pipelines.demo import run_demo, sharing_copy
    from ghosted_hf.text.tokens import tokenize_texts

    dense = AutoModelForCausalLM.from_pretrained(dense_folder)
    copied = sharing_copy(dense)
    assert copied is not dense and copied.model.layers is not dense.model.layers
    assert all(a is b for a, b in zip(copied.parameters(), dense.parameters()))

    rows = run_demo(tmp_path / "out", PruneOptions(num_layers=1, num_sequences=4, seq_len=64), model=str(dense_folder),
                    eval_windows=2, eval_seq_len=64)
    tokenizer = AutoTokenizer.from_pretrained(dense_folder)
    held_out = tokenize_texts(tokenizer, assets.wikipedia_split("evaluation"), 64, 2, batch_size=4).batches
    removed = json.loads((tmp_path / "out" / "config.json").read_text())["removed_layers"]
    alone = [AutoModelForCausalLM.from_pretrained(dense_folder),
             to_stock_model(prune_layers(AutoModelForCausalLM.from_pretrained(dense_folder), removed))]
    assert [row.name for row in rows] == ["dense", "plainly pruned", "ghosted"]
    for row, model in zip(rows, alone):
        assert row.perplexity == pytest.approx(perplexity(model.eval(), held_out, progress=False), rel=1e-6)
    assert rows[1].parameters < rows[0].parameters
