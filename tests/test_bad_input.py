"""Every bad input gets one GhostedError that names the value and the fix; `ghosted` prints it as one
line with exit status 2."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny import COMMON, HIDDEN, build, char_tokenizer, random_operator, texts
from transformers import LlamaConfig, LlamaForCausalLM

from ghosted_hf import GhostedError, ghost_prune, prune_layers
from ghosted_hf.cli import main
from ghosted_hf.errors import NonFiniteError
from ghosted_hf.options import PruneOptions

FAST = dict(seq_len=48, num_sequences=24, num_layers=2)


def prune(**options):
    return ghost_prune(build("llama"), char_tokenizer(), texts(), **{**FAST, **options})


def test_numpy_and_torch_integer_layer_indices_are_accepted() -> None:
    reference = prune_layers(build("llama"), [2, 3])
    for layers in ([np.int64(2), np.int32(3)], [torch.tensor(2), torch.tensor(3)], np.array([2, 3])):
        assert prune_layers(build("llama"), layers).config.removed_layers == [2, 3]
        assert prune(criterion="manual", layers=list(layers), num_layers=8).config.removed_layers == [2, 3]
    assert reference.config.removed_layers == [2, 3]
    assert prune_layers(build("llama"), [2], {np.int64(2): random_operator(1)}).config.ghost_boundaries[0]["operator"] == "custom"


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: prune_layers(build("llama"), [2], [random_operator(1)]),
         r"operators must map the first removed layer of each boundary to its tensor \(a dict such as \{2: W\}\), got a list"),
        (lambda: prune_layers(build("llama"), [2], {2: torch.empty(HIDDEN, HIDDEN, device="meta")}),
         r"Operator for the boundary after removed layers \[2\] is on the meta device"),
        (lambda: prune_layers(build("llama"), [2], {2: torch.full((HIDDEN, HIDDEN), 1e300, dtype=torch.float64)}),
         r"Operator for the boundary after removed layers \[2\] overflows torch.float32"),
        (lambda: prune_layers(build("llama"), [2.0]), r"Layer indices must be integers, got 2.0 \(float\)"),
        (lambda: prune_layers(build("llama"), "23"), r"Layer indices must be a list of integers, got '23'"),
        (lambda: prune(num_layers=2.0), r"num_layers must be an integer, got 2.0 \(float\)"),
        (lambda: prune(num_layers="2"), r"num_layers must be an integer, got '2' \(str\)"),
        (lambda: prune(ridge="1e-6"), r"ridge must be a number, got '1e-6' \(str\)"),
        (lambda: prune(ridge=math.nan), r"ridge must be a finite number, got nan"),
        (lambda: prune(ridge=math.inf), r"ridge must be a finite number, got inf"),
        (lambda: prune(ridge=-1.0), r"ridge must be at least 0 and below 1 .*, got -1.0"),
        (lambda: ghost_prune(build("llama"), char_tokenizer(), " ".join(texts(4)), **FAST),
         r"one string of \d+ characters that is not a file path: pass a list of strings"),
        (lambda: ghost_prune(build("llama"), char_tokenizer(), {"text": texts()}, **FAST),
         r"got a dict \(for a dict of columns, use datasets.Dataset.from_dict\)"),
        (lambda: ghost_prune(build("llama"), char_tokenizer(), [1, 2, 3], **FAST), r"Calibration text: every document must be a string, got a int: 1"),
        (lambda: ghost_prune(build("llama", vocab_size=64), char_tokenizer(), texts(), **FAST),
         r"The tokenizer produced token id \d+, but the model's embedding has 64 rows"),
    ],
)
def test_bad_python_input(call, message) -> None:
    with pytest.raises(GhostedError, match=message):
        call()


def test_meta_device_model_is_refused_before_calibration() -> None:
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**COMMON))
    with pytest.raises(GhostedError, match=r"weights are on the meta device \(e.g. model.embed_tokens.weight\)"):
        ghost_prune(model, char_tokenizer(), texts(), **FAST)


def test_calibration_files(tmp_path: Path) -> None:
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait\n\n".encode("latin-1") * 50)
    with pytest.raises(GhostedError, match=r"latin1.txt is not UTF-8 text \(invalid continuation byte at byte 3\)"):
        ghost_prune(build("llama"), char_tokenizer(), tmp_path / "latin1.txt", **FAST)
    with pytest.raises(GhostedError, match=rf"Calibration text {tmp_path} is a folder that holds neither a saved"):
        ghost_prune(build("llama"), char_tokenizer(), tmp_path, **FAST)
    with pytest.raises(FileNotFoundError, match="Calibration text file nothing.txt does not exist"):
        ghost_prune(build("llama"), char_tokenizer(), "nothing.txt", **FAST)


def test_non_finite_activations_are_a_ghosted_error() -> None:
    model = build("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match=r"Non-finite activations \(NaN/Inf\) first appear at the input of layer 2"):
        ghost_prune(model, char_tokenizer(), texts(), **FAST)


# ---------------------------------------------------------------- command line (in process)


def one_line_error(capsys, *argv) -> str:
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]  # progress bars also write to stderr
    command = " ".join(str(a) for a in argv[:2 if argv[0] == "stats" else 1])
    assert len(errors) == 1 and errors[0].startswith(f"ghosted {command}: error: ") and "Traceback" not in err, err
    return errors[0]


def test_cli_errors_are_one_line(dense_folder: Path, tmp_path: Path, capsys) -> None:
    cal = ["--calibration", tmp_path / "cal.txt", "--seq-len", "48", "--num-sequences", "16", "--num-layers", "2"]
    assert "does not exist (and it is not a Hub id" in one_line_error(capsys, "prune", tmp_path / "nope", "--dry-run")
    (tmp_path / "file").write_text("x")
    err = one_line_error(capsys, "prune", dense_folder, *cal, "--output", tmp_path / "file")
    assert f"--output {tmp_path / 'file'} exists and is not a folder; name a folder" in err
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("a folder of text files is no dataset")
    err = one_line_error(capsys, "prune", dense_folder, "--calibration", tmp_path / "texts", "--dry-run")
    assert f"Calibration text {tmp_path / 'texts'} is a folder that holds neither" in err
    err = one_line_error(capsys, "prune", dense_folder, *cal, "--output", dense_folder)
    assert f"--output {dense_folder} is the input {dense_folder}; write it somewhere else" in err
    err = one_line_error(capsys, "eval", dense_folder, "--limit", "4")
    assert "--limit applies to zero-shot tasks: pass --tasks too" in err
    err = one_line_error(capsys, "heal", dense_folder, "--output", tmp_path / "healed", "--max-steps", "1")
    assert "heal expects a model pruned by ghosted_hf, and this LlamaForCausalLM records no pruning" in err
    err = one_line_error(capsys, "inspect", dense_folder)
    assert "holds a 'llama' model that ghosted_hf did not make" in err
    err = one_line_error(capsys, "heal", dense_folder, "--output", dense_folder)
    assert f"--output {dense_folder} is the input {dense_folder}; write it somewhere else" in err
    err = one_line_error(capsys, "demo", "--output", dense_folder)
    assert f"--output {dense_folder} already exists; pass --overwrite to replace it, or name a new folder" in err


def test_inspect_names_a_truncated_weight_file(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "ghosted"
    prune_layers(build("llama"), [2], {2: random_operator(1)}).save_pretrained(folder)
    assert main(["inspect", str(folder)]) == 0
    capsys.readouterr()
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) - 1000])
    err = one_line_error(capsys, "inspect", folder)
    assert f"{folder / 'model.safetensors'} is damaged or truncated" in err


def test_cli_reports_non_finite_activations_in_one_line(tmp_path: Path, capsys) -> None:
    model = build("llama")
    with torch.no_grad():
        model.model.layers[2].mlp.down_proj.weight[0, 0] = float("inf")
    model.save_pretrained(tmp_path / "broken")
    char_tokenizer().save_pretrained(tmp_path / "broken")
    (tmp_path / "cal.txt").write_text("\n\n".join(texts()))
    err = one_line_error(capsys, "prune", tmp_path / "broken", "--calibration", tmp_path / "cal.txt", "--seq-len", "48",
                         "--num-sequences", "16", "--num-layers", "2", "--dry-run")
    assert "Non-finite activations (NaN/Inf) first appear at the input of layer 3" in err


def test_help_shows_defaults(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["prune", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "Number of decoder layers to remove (ignored with --criterion manual, --remove and --num-parameters). " \
        "(default: 8)" in out
    assert "all on the dense model (independent, as in the paper). (default: sequential)" in out
    assert "(default: None)" in out and "(None: the model's first). (default: None)" in out


def test_surgery_needs_the_kept_weights_not_the_removed_ones() -> None:
    """Removed layers may stay unloaded (meta); a kept weight on the meta device is refused by name."""
    def with_meta(layer: int) -> LlamaForCausalLM:
        model = build("llama")
        for module in model.model.layers[layer].modules():
            for name, p in [(n, p) for n, p in module._parameters.items() if p is not None]:
                module._parameters[name] = torch.nn.Parameter(torch.empty_like(p, device="meta"))
        return model

    pruned = prune_layers(with_meta(2), [2], {2: random_operator(0)})
    assert pruned.config.removed_layers == [2]
    with pytest.raises(GhostedError, match=r"kept weight model.layers.3.self_attn.q_proj.weight is on the meta device"):
        prune_layers(with_meta(3), [2], {2: random_operator(0)})


@pytest.mark.parametrize("device, message", [("gpu7", "stats_device 'gpu7' is not a device torch knows"),
                                             ("cuda:3", "stats_device 'cuda:3': this machine has")])
def test_a_stats_device_torch_or_the_machine_refuses_is_named(device: str, message: str) -> None:
    if device.startswith("cuda") and torch.cuda.device_count() > 3:
        pytest.skip("this machine has that device")
    with pytest.raises(GhostedError, match=message):
        PruneOptions(stats_device=device)


def test_a_teacher_with_another_vocabulary_is_refused() -> None:
    from ghosted_hf.pipelines.healing import heal

    student = ghost_prune(build("llama"), char_tokenizer(), texts(), criterion="manual", layers=[2, 3], seq_len=48,
                          num_sequences=24)
    with pytest.raises(GhostedError, match="The teacher has a vocabulary of 200 tokens and the model 128"):
        heal(student, char_tokenizer(), texts(), teacher=build("llama", vocab_size=200), max_steps=1, progress=False)


def test_too_little_text_for_a_stable_fit_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    # 24 x 8 = 192 tokens for C = 32: between C and 10 C
    with caplog.at_level("WARNING", logger="ghosted_hf.pipelines.prune"):
        ghost_prune(build("llama"), char_tokenizer(), texts(), seq_len=8, num_sequences=24, criterion="manual",
                    layers=[2, 3])
    assert "gave 192 tokens for a 32x32 operator: fewer than 10x the 32 inputs of the fit (320)" in caplog.text


def test_every_command_that_writes_refuses_an_existing_output_and_never_writes_into_an_input(
        dense_folder: Path, tmp_path: Path, capsys) -> None:
    """One rule for prune, stats collect / merge, heal, export-stock, export-gguf and demo: an existing output is
    replaced only with --overwrite; an output that is, lies inside or contains an input is refused even then (the
    check runs before any model is loaded, so a refused run has written and loaded nothing)."""
    cal = tmp_path / "cal.txt"
    fit = ["--calibration", cal, "--num-layers", "2", "--seq-len", "48", "--num-sequences", "16"]
    assert main([str(a) for a in ["prune", dense_folder, *fit, "--output", tmp_path / "ghosted"]]) == 0
    assert main([str(a) for a in ["stats", "collect", dense_folder, *fit, "--output", tmp_path / "s.safetensors"]]) == 0
    ghosted, stats = tmp_path / "ghosted", tmp_path / "s.safetensors"
    commands = {  # command -> (argv up to the output, input folder or file, the output is a file)
        "prune": (lambda out: ["prune", dense_folder, *fit, "--output", out], dense_folder, False),
        "stats collect": (lambda out: ["stats", "collect", dense_folder, *fit, "--output", out], dense_folder, True),
        "stats merge": (lambda out: ["stats", "merge", stats, "--output", out], stats, True),
        "heal": (lambda out: ["heal", ghosted, "--max-steps", "1", "--output", out], ghosted, False),
        "export-stock": (lambda out: ["export-stock", ghosted, "--output", out], ghosted, False),
        "export-gguf": (lambda out: ["export-gguf", ghosted, out, "--llama-cpp", tmp_path], ghosted, True),
        "demo": (lambda out: ["demo", "--model", dense_folder, "--output", out], dense_folder, False),
    }
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    (tmp_path / "taken.bin").write_text("mine")
    for name, (argv, source, is_file) in commands.items():
        existing = tmp_path / ("taken.bin" if is_file else "taken")
        err = one_line_error(capsys, *argv(existing))
        assert f"--output {existing} already exists; pass --overwrite to replace it" in err, (name, err)
        inside = source / "model.safetensors" if is_file and source.is_dir() else (
            source if source.is_file() else source / "sub")
        for target in (inside, source):
            err = one_line_error(capsys, *argv(target), "--overwrite")
            assert f"--output {target} " in err and f"the input {source}; write it somewhere else" in err, (name, err)
    assert (tmp_path / "taken" / "keep.txt").read_text() == (tmp_path / "taken.bin").read_text() == "mine"
    before = (ghosted / "model.safetensors").read_bytes()
    assert main([str(a) for a in commands["prune"][0](ghosted / "..")]) == 2  # contains the input ghosted/
    assert (ghosted / "model.safetensors").read_bytes() == before
    # --overwrite replaces an output that is no input, whole
    assert main([str(a) for a in commands["prune"][0](tmp_path / "taken")] + ["--overwrite"]) == 0
    assert not (tmp_path / "taken" / "keep.txt").exists() and (tmp_path / "taken" / "config.json").is_file()


def test_a_folder_whose_config_does_not_describe_its_weights_is_refused_by_every_command_before_any_build(
        dense_folder: Path, tmp_path: Path, capsys) -> None:
    """A config claiming 10^6 layers, another MLP width, or a stock export one layer short: every command that
    reads a model folder runs the same header-level check (the one inspect runs) before anything is built, so the
    refusal takes a second whatever the claim."""
    import json
    import shutil
    import time

    cal = tmp_path / "cal.txt"
    cases = {"10^6 layers": ({"num_hidden_layers": 10**6}, "claims 1000000 decoder layers, but the weight files hold 6"),
             "another MLP width": ({"intermediate_size": 65}, "claims (hidden_size, intermediate_size) = (32, 65)"),
             "a string depth": ({"num_hidden_layers": "6"}, "num_hidden_layers must be a positive integer, and is '6'")}
    for name, (change, message) in cases.items():
        folder = tmp_path / name.replace(" ", "_").replace("^", "")
        shutil.copytree(dense_folder, folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **change}))
        for argv in (["eval", folder, "--windows", "1"], ["prune", folder, "--calibration", cal, "--num-layers", "1",
                                                        "--output", tmp_path / "out"],
                     ["prune", folder, "--calibration", cal, "--num-layers", "1", "--layerwise", "--output",
                      tmp_path / "out"], ["stats", "collect", folder, "--calibration", cal, "--output",
                                          tmp_path / "s.safetensors"], ["inspect", folder]):
            start = time.monotonic()
            err = one_line_error(capsys, *argv)
            assert message in err, (name, argv[0], err)
            assert time.monotonic() - start < 30, (name, argv[0])
    # a stock checkpoint ghosted_hf made must hold exactly the layers it claims (inspect passed one short)
    stock = tmp_path / "stock"
    shutil.copytree(dense_folder, stock)
    config = json.loads((stock / "config.json").read_text())
    (stock / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 5, "ghost_provenance": {"stock_export": {}}}))
    for argv in (["inspect", stock], ["eval", stock, "--windows", "1"]):
        assert "claims 5 decoder layers, but the weight files hold 6" in one_line_error(capsys, *argv), argv


def test_options_that_mean_nothing_and_misleading_inputs_get_one_line_that_points_the_right_way(
        dense_folder: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """Values that parse but mean nothing (a one-token window, adapters wider than the stream, a ridge that makes
    every fit the identity, a timeout of zero) and inputs whose message used to send the user elsewhere."""
    import os

    cal = tmp_path / "cal.txt"
    ghosted = tmp_path / "ghosted"
    assert main([str(a) for a in ["prune", dense_folder, "--calibration", cal, "--num-layers", "2", "--seq-len", "48",
                                  "--num-sequences", "16", "--output", ghosted]]) == 0
    os.mkfifo(tmp_path / "fifo")
    heal = ["heal", ghosted, "--output", tmp_path / "healed", "--max-steps", "1"]
    cases = [
        ([*heal, "--seq-len", "1"], "seq_len must be at least 2"),
        ([*heal, "--seq-len", "100000"], "seq_len 100000 is beyond the model's"),
        ([*heal, "--rank", "1000"], "rank 1000 is above the model's hidden size 32"),
        ([*heal, "--kd-weight", "0.5"], "kd_weight weighs the distillation loss: pass a teacher"),
        ([*heal, "--data", cal, "--eval-data", cal], "The evaluation data is the training data"),
        ([*heal, "--data", cal, "--text-column", "body"], "is a text file (one document per blank-line-separated block)"),
        ([*heal, "--data", cal, "--split", "test"], "split and text_column apply to datasets"),
        ([*heal, "--data", tmp_path / "fifo"], "is neither a regular file nor a folder (a FIFO or a device?)"),
        ([*heal, "--eval-data", tmp_path / "none.txt"], "Evaluation data "),
        ([*heal, "--seed", "-1"], "seed must be between 0 and 2^32 - 1"),
        ([*heal[:-2], "--minutes", "1e308"], "minutes must be a finite number"),
        ([*heal, "--minutes", "1"], "Give one budget: max_steps, tokens or minutes, not max_steps and minutes"),
        ([*heal, "--resume", tmp_path / "nowhere", "--checkpoints", tmp_path / "ck"], "nowhere does not exist"),
        (["export-gguf", ghosted, tmp_path / "m.gguf", "--llama-cpp", tmp_path, "--timeout", "0"],
         "timeout must be a positive, finite number of seconds, got 0.0"),
        (["export-gguf", ghosted, tmp_path / "m.gguf", "--llama-cpp", tmp_path, "--timeout", "nan"],
         "timeout must be a positive, finite number"),
        (["inspect", ghosted, "--top", "-1"], "--top must be 0 or more"),
        (["prune", dense_folder, "--calibration", cal, "--ridge", "1e300", "--dry-run"], "ridge must be at least 0 and "
                                                                                         "below 1"),
        (["export-stock", ghosted, "--ridge", "1e300", "--output", tmp_path / "stock"], "ridge must be at least 0"),
        (["prune", dense_folder, "--calibration", cal, "--stats-device", "meta", "--dry-run"], "holds no values"),
    ]
    for argv, message in cases:
        assert message in one_line_error(capsys, *argv), (argv, message)
    monkeypatch.setenv("WORLD_SIZE", "abc")
    err = one_line_error(capsys, "prune", dense_folder, "--calibration", cal, "--num-layers", "2", "--dry-run")
    assert "The launcher's environment is inconsistent (RANK='0', WORLD_SIZE='abc'" in err


def test_a_statistics_file_that_cannot_be_written_is_one_line_and_leaves_nothing(dense_folder: Path,
                                                                                 tmp_path: Path, capsys) -> None:
    """/proc refuses new files even to root (a read-only or full disk, as a test can make one): the write of the
    statistics fails with one line, not an internal error, and no partial file is left anywhere."""
    err = one_line_error(capsys, "stats", "collect", dense_folder, "--calibration", tmp_path / "cal.txt",
                         "--num-layers", "2", "--seq-len", "48", "--num-sequences", "8", "--output",
                         "/proc/ghosted-stats.safetensors")
    assert "Cannot write /proc/ghosted-stats.safetensors" in err and "check the disk space" in err


def test_what_the_config_and_the_arguments_can_tell_is_refused_before_any_weight_is_read(
        dense_folder: Path, tmp_path: Path, capfd, monkeypatch) -> None:
    """A layer count the model does not have, empty calibration text, a Hub id that is neither cached (offline)
    nor reachable: one line each, and no "Loading weights" bar before it (minutes for a large model)."""
    import socket
    import time

    import huggingface_hub.constants

    import ghosted_hf.model.loading

    (tmp_path / "empty.txt").write_text("\n\n  \n")
    for argv, message in [(["--num-layers", "40"], "num_layers must be between 1 and 5 for a model with 6 layers"),
                          (["--num-layers", "0"], "num_layers must be between 1 and 5"),
                          (["--calibration", tmp_path / "empty.txt"], "The calibration text (empty.txt) is empty")]:
        args = ["prune", dense_folder, "--calibration", tmp_path / "cal.txt", "--num-layers", "2", *argv, "--dry-run"]
        assert main([str(a) for a in args]) == 2
        err = capfd.readouterr().err
        assert message in err and "Loading weights" not in err, (argv, err)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["prune", "someone/not-cached", "--calibration", str(tmp_path / "cal.txt"), "--dry-run"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "someone/not-cached is not a local folder and cannot be read from the Hub or its local " \
                             "cache" in err[0] and "pass the folder instead" in err[0], err
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with socket.socket() as server:  # accepts connections, never answers
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(ghosted_hf.model.loading, "HUB_TIMEOUT_S", 1.0)
        start = time.monotonic()
        assert main(["prune", "someone/model", "--calibration", str(tmp_path / "cal.txt"), "--dry-run"]) == 2
    assert time.monotonic() - start < 30
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"Cannot read the Hub model 'someone/model': {endpoint} could not be reached or did not " \
                             "answer within 1 s" in err[0] and "pass a local folder instead" in err[0], err


def test_what_a_run_reports_is_what_it_did(dense_folder: Path, tmp_path: Path, capsys, caplog) -> None:
    """Two budgets are refused rather than one silently winning; a 2-step heal reports its two steps, not "first 5
    / last 5" of the same mean; manual layers with no recovery neither read nor warn about calibration text."""
    from tiny import build, char_tokenizer

    from ghosted_hf import ghost_prune
    from ghosted_hf.pipelines.healing import HealOptions

    with pytest.raises(GhostedError, match="Give one budget: max_steps, tokens or minutes, not max_steps and minutes"):
        HealOptions(max_steps=10, minutes=1.0)
    ghosted = tmp_path / "ghosted"
    assert main([str(a) for a in ["prune", dense_folder, "--calibration", tmp_path / "cal.txt", "--num-layers", "2",
                                  "--seq-len", "48", "--num-sequences", "16", "--output", ghosted]]) == 0
    capsys.readouterr()
    assert main([str(a) for a in ["heal", ghosted, "--data", tmp_path / "cal.txt", "--max-steps", "2", "--seq-len", "32",
                                  "--eval-sequences", "0", "--adapter-only", "--output", tmp_path / "healed"]]) == 0
    assert "loss: first 1 step " in capsys.readouterr().out
    with caplog.at_level("INFO", logger="ghosted_hf"):
        stock = ghost_prune(build("llama"), char_tokenizer(), ["a few words"], criterion="manual", layers=[2, 3],
                            operator="none")
    assert stock.config.num_hidden_layers == 4 and "calibration text is unused" in caplog.text
    assert "tokens for a" not in caplog.text  # no warning about too little text it never needed


def test_a_second_demo_run_replaces_its_own_default_output(dense_folder: Path, tmp_path: Path, fake_demo,
                                                           capsys) -> None:
    """The demo's default folder is its own: run twice, the second replaces the first instead of stopping with an
    error about an --output the user never passed; an --output the user names is still protected."""
    for _ in range(2):
        assert main(["demo", "--model", str(dense_folder)]) == 0
    out = capsys.readouterr().out
    assert f"Saved the ghosted model to {tmp_path / 'ghosted-demo-output' / 'dense-ghosted'}" in out
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("mine")
    err = one_line_error(capsys, "demo", "--model", dense_folder, "--output", tmp_path / "mine")
    assert "already exists; pass --overwrite" in err


def _tree_digest(path: Path) -> dict[str, bytes]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p): p.read_bytes() for p in files}


@pytest.mark.parametrize("command", ["prune", "demo", "stats collect", "stats merge", "heal teacher base",
                                     "heal resume", "export-stock", "export-gguf"])
def test_overwrite_never_removes_a_path_the_command_read(command: str, dense_folder: Path, tmp_path: Path, capsys,
                                                         monkeypatch) -> None:
    """Every path a command reads is an input, however it was reached (the packaged model's cache folder, the teacher
    'base' resolved from the model's provenance, a checkpoint resumed from, llama.cpp's converter, a statistics file):
    `--overwrite` onto it is refused in one line and the input is left as it was. (eval, inspect and push write
    nothing.)"""
    import json
    import shutil

    from ghosted_hf import assets

    monkeypatch.setenv("GHOSTED_HF_CACHE", str(tmp_path / "cache"))  # the packaged default: a copy of the tiny model
    packaged = assets.cache_root() / assets.PACKAGED_MODELS[assets.DEFAULT_MODEL].hub_id.split("/")[1]
    shutil.copytree(dense_folder, packaged)
    (packaged / assets.SOURCE_FILE).write_text(json.dumps({"hub_id": "test/tiny"}))
    cal = tmp_path / "cal.txt"
    fit = ["--calibration", cal, "--num-layers", "2", "--seq-len", "48", "--num-sequences", "16"]
    ghosted, stats = tmp_path / "ghosted", tmp_path / "s.safetensors"
    if command in ("heal teacher base", "heal resume", "export-stock", "export-gguf"):
        assert main([str(a) for a in ["prune", dense_folder, *fit, "--output", ghosted]]) == 0
    if command == "stats merge":
        assert main([str(a) for a in ["stats", "collect", dense_folder, *fit, "--output", stats]]) == 0
    checkpoint = tmp_path / "run" / "ck" / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text("{}")
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(cal, data / "cal.txt")
    converter = tmp_path / "cpp" / "convert_hf_to_gguf.py"
    converter.parent.mkdir()
    converter.write_text("print('the converter')\n")
    argv, read = {  # the command's arguments, and the input its output would replace
        "prune": (["prune", *fit, "--output", packaged], packaged),
        "demo": (["demo", "--output", packaged], packaged),
        "stats collect": (["stats", "collect", *fit, "--output", packaged / "model.safetensors"], packaged),
        "stats merge": (["stats", "merge", stats, "--output", stats], stats),
        "heal teacher base": (["heal", ghosted, "--teacher", "base", "--max-steps", "1", "--output", dense_folder],
                              dense_folder),
        "heal resume": (["heal", ghosted, "--resume", checkpoint, "--max-steps", "1", "--output", tmp_path / "run"],
                        checkpoint),
        "export-stock": (["export-stock", ghosted, "--calibration", data / "cal.txt", "--output", data], data / "cal.txt"),
        "export-gguf": (["export-gguf", ghosted, converter, "--llama-cpp", converter.parent], converter),
    }[command]
    before = _tree_digest(read)
    err = one_line_error(capsys, *argv, "--overwrite")
    assert "write it somewhere else" in err and str(read) in err, err
    assert _tree_digest(read) == before


def test_claimed_sizes_are_checked_against_the_weight_headers_before_anything_is_allocated(
        dense_folder: Path, tmp_path: Path) -> None:
    """Under `ulimit -v` 4 GB, inspect, eval and prune refuse in one line (exit status 2, within 10 s each) a config
    claiming 10^9 layers, a GPT-2 folder whose config says mistral (a default Mistral-7B would be built), an index
    naming 10^6 layers its files do not hold, a config with num_attention_heads 0, and a calibration batch larger
    than memory; the remote code alone (no ghosted_hf) refuses a ghosted folder claiming 10^9 layers, one whose
    model.safetensors is empty, and one with num_attention_heads 0, with a ValueError naming the problem."""
    import json
    import shutil
    import subprocess
    import sys

    from isolated import run_without_ghosted
    from transformers import GPT2Config, GPT2LMHeadModel

    def variant(name: str, source: Path, change) -> Path:
        folder = tmp_path / name
        shutil.copytree(source, folder)
        config = json.loads((folder / "config.json").read_text())
        change(config, folder)
        (folder / "config.json").write_text(json.dumps(config))
        return folder

    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128)).save_pretrained(tmp_path / "gpt2")
    char_tokenizer().save_pretrained(tmp_path / "gpt2")

    def index_of_many_layers(config: dict, folder: Path) -> None:
        names = {f"model.layers.{i}.mlp.down_proj.weight": "model.safetensors" for i in range(10**6)}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))
        config["num_hidden_layers"] = 10**6

    cases = {
        variant("layers", dense_folder, lambda c, f: c.update(num_hidden_layers=10**9)):
            "claims 1000000000 decoder layers, but the weight files hold 6",
        variant("mistral", tmp_path / "gpt2", lambda c, f: c.update(model_type="mistral")):
            "describes a mistral model of 6,980,112,384 parameters, but the weight files hold 62,336 values",
        variant("index", dense_folder, index_of_many_layers): "names 999994 tensors that its files do not hold",
        variant("heads", dense_folder, lambda c, f: c.update(num_attention_heads=0)):
            "num_attention_heads must be a positive integer, and is 0",
    }
    cal = tmp_path / "cal.txt"
    argvs = []
    for folder, message in cases.items():
        for argv in (["inspect", folder], ["eval", folder, "--windows", "1"],
                     ["prune", folder, "--calibration", cal, "--num-layers", "1", "--dry-run"]):
            if folder.name != "index" or argv[0] == "inspect":  # (one reader of a 10^6-entry index is enough)
                argvs.append(([str(a) for a in argv], message))
    argvs.append((["prune", str(dense_folder), "--calibration", str(cal), "--batch-size", "100000", "--num-sequences",
                   "100000", "--seq-len", "8", "--num-layers", "2", "--dry-run"],  # a tiny text, 1 MiB of memory below
                  "batch_size: one forward of "))
    script = """
import contextlib, io, json, resource, sys, time
from ghosted_hf.utils import memory
memory.available_bytes = lambda: 2**20  # the calibration batch of the last case: 1 MiB available
resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))
from ghosted_hf.cli import main
for argv, message in json.loads(sys.argv[1]):
    err, start = io.StringIO(), time.monotonic()
    with contextlib.redirect_stderr(err):
        status = main(argv)
    lines = [line for line in err.getvalue().splitlines() if "error:" in line]
    assert status == 2 and len(lines) == 1 and message in lines[0], (argv, status, err.getvalue())
    assert time.monotonic() - start < 10, (argv, time.monotonic() - start)
print("REFUSED", len(sys.argv[1]))
"""
    done = subprocess.run([sys.executable, "-c", script, json.dumps(argvs)], capture_output=True, text=True,
                          cwd=Path(__file__).parent, timeout=600)
    assert done.returncode == 0 and "REFUSED" in done.stdout, done.stderr[-3000:]

    ghosted = tmp_path / "ghosted"
    assert main([str(a) for a in ["prune", dense_folder, "--calibration", cal, "--num-layers", "2", "--seq-len", "48",
                                  "--num-sequences", "16", "--output", ghosted]]) == 0
    remote = {
        variant("g-layers", ghosted, lambda c, f: (c["text_config"].update(num_hidden_layers=10**9),
                                                   c.update(original_num_hidden_layers=10**9 + 2))):
            "claims 1000000000 decoder layers (text_config.num_hidden_layers), but the weight files hold 4",
        variant("g-empty", ghosted, lambda c, f: (f / "model.safetensors").write_bytes(b"")):
            "model.safetensors is empty or truncated (0 bytes)",
        variant("g-heads", ghosted, lambda c, f: c["text_config"].update(num_attention_heads=0)):
            "text_config.num_attention_heads must be a positive integer, and is 0",
    }
    out = run_without_ghosted(f"""
        import resource, time
        resource.setrlimit(resource.RLIMIT_AS, (4 * 2**30, 4 * 2**30))
        from transformers import AutoModelForCausalLM
        for folder, message in {[(str(k), v) for k, v in remote.items()]!r}:
            start = time.monotonic()
            try:
                AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
            except ValueError as error:
                assert message in str(error), (folder, str(error))
            else:
                raise AssertionError(folder + " loaded")
            assert time.monotonic() - start < 10, folder
        print("REFUSED")
        """, tmp_path)
    assert "REFUSED" in out


def test_nothing_that_cannot_run_is_returned_or_saved(monkeypatch) -> None:
    """A hybrid's removal that takes every full-attention layer is refused before any fitting (by hand, or avoided by
    the criteria that choose); replacing every layer's attention (a network without token mixing) is refused; and
    whatever else cannot run is caught by one forward and one cached step of the result before it is returned."""
    from tiny import tiny_family

    from ghosted_hf.model import surgery

    hybrid = tiny_family("qwen3_5_text")
    assert hybrid.config.layer_types[1::2] == ["full_attention"] * 3
    message = (r"Removing layers \[1, 3, 5\] leaves this qwen3_5_text hybrid without a full-attention layer, and it "
               r"builds its attention masks from one: keep at least one of layers \[1, 3, 5\]")
    with pytest.raises(GhostedError, match=message):
        prune_layers(tiny_family("qwen3_5_text"), [1, 3, 5])
    calls = []
    monkeypatch.setattr("ghosted_hf.statistics.Calibrator.collect", lambda *a, **k: calls.append(a))
    with pytest.raises(GhostedError, match=message):
        ghost_prune(tiny_family("qwen3_5_text"), char_tokenizer(), texts(), criterion="manual", layers=[1, 3, 5], **{
            k: v for k, v in FAST.items() if k != "num_layers"})
    assert not calls  # refused before any calibration pass
    monkeypatch.undo()
    for chosen in ("ghost-aware", "shortgpt"):
        removed = ghost_prune(
            tiny_family("qwen3_5_text"), char_tokenizer(), texts(), **{**FAST, "num_layers": 5, "criterion": chosen}
        ).config.removed_layers
        assert {1, 3, 5} - set(removed), (chosen, removed)
    with pytest.raises(GhostedError, match="Replacing the attention of every layer leaves no token mixing"):
        ghost_prune(build("llama"), char_tokenizer(), texts(), unit="subblock", criterion="manual",
                    subblocks=[f"{i}.attention" for i in range(6)], seq_len=48, num_sequences=24)
    # the last guard: with the rule switched off, the forward check still refuses the hybrid
    monkeypatch.setattr(surgery, "check_removal", lambda config, removed: None)
    with pytest.raises(GhostedError, match="The pruned model cannot run: one forward and one cached step of a few "
                                           "tokens failed .*get_mask_sizes"):
        prune_layers(tiny_family("qwen3_5_text"), [1, 3, 5])


def _fake_llama_cpp(folder: Path, script: str) -> Path:
    """A llama.cpp folder whose converter runs `script` (its --outfile is sys.argv[3])."""
    folder.mkdir()
    (folder / "convert_hf_to_gguf.py").write_text("import sys\n" + script)
    return folder


def test_what_used_to_be_raw_or_an_internal_error_is_one_line(dense_folder: Path, tmp_path: Path, capsys) -> None:
    """auto_map with a non-string value, a converter that writes a garbage GGUF or runs out of disk, a path component
    that is a file (heal's --checkpoints): one line each, exit status 2. (An empty model.safetensors loaded by the
    remote code alone and num_attention_heads 0: test_claimed_sizes_are_checked_...)"""
    import json
    import shutil

    cal = tmp_path / "cal.txt"
    broken = tmp_path / "automap"
    shutil.copytree(dense_folder, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": 5}}))
    for argv in (["inspect", broken], ["eval", broken, "--windows", "1"]):
        assert "auto_map.AutoModelForCausalLM should name a class" in one_line_error(capsys, *argv)
    normed = tmp_path / "normed"
    assert main([str(a) for a in ["prune", dense_folder, "--calibration", cal, "--num-layers", "2", "--seq-len", "48",
                                  "--num-sequences", "16", "--operator", "normed", "--output", normed]]) == 0
    garbage = _fake_llama_cpp(tmp_path / "cpp-garbage", "open(sys.argv[3], 'wb').write(b'GGUF' + bytes(64))\n")
    full = _fake_llama_cpp(tmp_path / "cpp-full", "sys.exit('OSError: [Errno 28] No space left on device')\n")
    for cpp, message in ((garbage, "exited without an error but wrote no readable GGUF"), (full, "the disk is full")):
        err = one_line_error(capsys, "export-gguf", normed, tmp_path / "out.gguf", "--llama-cpp", cpp)
        assert message in err and "pip install" not in err, err
    (tmp_path / "afile").write_text("x")
    err = one_line_error(capsys, "heal", normed, "--max-steps", "1", "--save-steps", "1", "--checkpoints",
                         tmp_path / "afile" / "ck", "--output", tmp_path / "healed")
    assert f"--checkpoints {tmp_path / 'afile' / 'ck'}: {tmp_path / 'afile'} is a file, not a folder" in err


def test_lines_that_used_to_mislead_point_the_right_way(dense_folder: Path, tmp_path: Path, capsys) -> None:
    """inspect of a file or a missing path, a BERT folder, export-gguf of a Qwen3 model, --subblocks without
    --criterion manual, a converter failure that is not about its requirements, a mistyped packaged name, and
    values that start with a dash."""
    from transformers import BertConfig, BertForMaskedLM

    cal = tmp_path / "cal.txt"
    assert one_line_error(capsys, "inspect", cal).endswith(f"{cal} is a file; inspect reads a saved model folder "
                                                           "(the one holding config.json).")
    assert one_line_error(capsys, "inspect", tmp_path / "none").endswith(f"{tmp_path / 'none'} does not exist.")
    BertForMaskedLM(BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                               vocab_size=128)).save_pretrained(tmp_path / "bert")
    for argv in (["inspect", tmp_path / "bert"], ["eval", tmp_path / "bert"]):
        assert "'bert' is an encoder (a masked LM), not a decoder-only causal LM" in one_line_error(capsys, *argv)
    qwen3 = tmp_path / "qwen3"
    build("qwen3").save_pretrained(tmp_path / "qwen3-dense")
    char_tokenizer().save_pretrained(tmp_path / "qwen3-dense")
    assert main([str(a) for a in ["prune", tmp_path / "qwen3-dense", "--calibration", cal, "--num-layers", "2",
                                  "--seq-len", "48", "--num-sequences", "16", "--operator", "normed", "--output",
                                  qwen3]]) == 0
    cpp = _fake_llama_cpp(tmp_path / "cpp", "sys.exit('NotImplementedError: BPE pre-tokenizer was not recognized')\n")
    err = one_line_error(capsys, "export-gguf", qwen3, tmp_path / "q.gguf", "--llama-cpp", cpp)
    assert "a pruned qwen3 model is not" in err, err
    normed = tmp_path / "normed"
    assert main([str(a) for a in ["prune", dense_folder, "--calibration", cal, "--num-layers", "2", "--seq-len", "48",
                                  "--num-sequences", "16", "--operator", "normed", "--output", normed]]) == 0
    err = one_line_error(capsys, "export-gguf", normed, tmp_path / "n.gguf", "--llama-cpp", cpp)
    assert "this llama.cpp does not know the model's tokenizer" in err and "pip install" not in err, err
    fit = ["--calibration", cal, "--seq-len", "48", "--num-sequences", "16", "--dry-run"]
    assert "subblocks=[...] names what to replace, which criterion 'ghost-aware' chooses itself" in one_line_error(
        capsys, "prune", dense_folder, *fit, "--unit", "subblock", "--subblocks", "1.mlp", "--remove", "25%")
    assert "There is no packaged model named 'Gemma3-270M' (did you mean 'gemma3-270m'?)" in one_line_error(
        capsys, "demo", "--model", "Gemma3-270M")
    assert "remove is a share of the decoder's parameters" in one_line_error(capsys, "prune", dense_folder, *fit,
                                                                             "--remove", "-5%")
    assert "A sub-block is written LAYER.KIND" in one_line_error(capsys, "prune", dense_folder, *fit, "--unit",
                                                                "subblock", "--criterion", "manual", "--subblocks",
                                                                "-1.mlp")


def test_questionable_input_is_refused_or_read_as_documented(dense_folder: Path, tmp_path: Path, capsys) -> None:
    """A statistics shard relabelled as whole statistics (hashes recomputed) is a part of its set; prune's calibration
    refuses windows beyond the model's positions as heal does; a JSON array of strings is read as one document per
    string (as `datasets` reads it). (A rank given another --output, and a peer that never comes announced while it
    is awaited: tests/test_distributed.py.)"""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from ghosted_hf.statistics.store import metadata_sha256
    from ghosted_hf.text.documents import read_documents

    cal = tmp_path / "cal.txt"
    fit = ["--calibration", cal, "--num-layers", "2", "--seq-len", "48", "--num-sequences", "24", "--batch-size", "4"]
    shard = tmp_path / "shard.safetensors"
    assert main([str(a) for a in ["stats", "collect", dense_folder, *fit, "--shard", "0/3", "--output", shard]]) == 0
    with safe_open(str(shard), framework="pt") as handle:
        metadata, tensors = handle.metadata(), {k: handle.get_tensor(k) for k in handle.keys()}
    origin = json.loads(metadata["origin"])
    assert origin["shard"] == "0/3" and origin["set_tokens"] > json.loads(metadata["tokens"])
    metadata["origin"] = json.dumps({**origin, "shard": "0/1"})
    metadata["integrity"] = metadata_sha256(metadata)
    save_file(tensors, str(tmp_path / "relabelled.safetensors"), metadata=metadata)
    err = one_line_error(capsys, "prune", dense_folder, *fit, "--statistics", tmp_path / "relabelled.safetensors",
                         "--dry-run")
    assert "tokens of the" in err and "a part of it (a shard, whatever its label says)" in err, err
    assert "seq_len 100000 is beyond the model's 256 positions" in one_line_error(
        capsys, "prune", dense_folder, "--calibration", cal, "--num-layers", "2", "--seq-len", "100000", "--dry-run")
    (tmp_path / "array.json").write_text(json.dumps(["first document", "second document"]))
    assert list(read_documents(tmp_path / "array.json").texts) == ["first document", "second document"]
