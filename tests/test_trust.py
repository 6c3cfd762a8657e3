"""One trust policy: without --trust-remote-code no Python file of a model folder is imported, whatever the
folder holds (custom generation, a tokenizer's, processor's or feature extractor's code, an `auto_map` entry of
any Auto class); ghosted_hf's own classes load its models without any."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny import build, char_tokenizer, random_operator, texts

from ghosted_hf import prune_layers, save_with_card
from ghosted_hf.cli import main

# Each file writes its own marker when imported, then defines what its folder's configs name.
EVIL = """
from pathlib import Path
Path({marker!r}).write_text("ran")
from transformers import PreTrainedTokenizerFast, LlamaForCausalLM, LlamaConfig
class EvilTokenizer(PreTrainedTokenizerFast):
    pass
class EvilModel(LlamaForCausalLM):
    pass
class EvilConfig(LlamaConfig):
    pass
class EvilProcessor:
    pass
def generate(model, *args, **kwargs):
    raise RuntimeError("custom generate ran")
"""
CODE_FILES = ("custom_generate/generate.py", "tokenization_evil.py", "processing_evil.py", "feature_evil.py",
              "modeling_evil.py", "configuration_evil.py")


def plant_code(folder: Path, auto_map: bool = True) -> list[Path]:
    """Put every kind of code a model folder can carry into `folder`, each named by the config that loads it (the
    model config's `auto_map` too, unless not `auto_map`); returns the markers that an import would write."""
    for name in CODE_FILES:
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text(EVIL.format(marker=str(folder / f"RAN-{Path(name).stem}")))
    (folder / "custom_generate" / "requirements.txt").write_text("")
    tokenizer = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer["auto_map"] = {"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]}
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    (folder / "processor_config.json").write_text(json.dumps({"auto_map": {"AutoProcessor": "processing_evil.EvilProcessor"}}))
    (folder / "preprocessor_config.json").write_text(json.dumps(
        {"auto_map": {"AutoFeatureExtractor": "feature_evil.EvilProcessor", "AutoImageProcessor": "feature_evil.EvilProcessor"}}))
    config = json.loads((folder / "config.json").read_text())
    if not auto_map:  # a ghosted model's own auto_map, untouched
        return [folder / f"RAN-{Path(name).stem}" for name in CODE_FILES]
    auto_map = config.get("auto_map", {})
    for auto in ("AutoModel", "AutoModelForSequenceClassification", "AutoModelForTokenClassification"):
        auto_map[auto] = "modeling_evil.EvilModel"
    if config["model_type"] != "ghosted":  # a stock folder: every entry points at the planted code
        auto_map |= {"AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilModel"}
    config["auto_map"] = auto_map
    (folder / "config.json").write_text(json.dumps(config))
    return [folder / f"RAN-{Path(name).stem}" for name in CODE_FILES]


@pytest.fixture
def folders(tmp_path: Path) -> dict[str, Path]:
    """Two ghosted folders (one with its own auto_map) and a stock (dense Llama) one; calibration text."""
    ghosted, dense = tmp_path / "ghosted", tmp_path / "dense"
    for folder in (ghosted, tmp_path / "ghosted-mapped"):
        save_with_card(prune_layers(build("llama"), [2, 3], {2: random_operator(1)}), folder, char_tokenizer())
    build("llama").save_pretrained(dense)
    char_tokenizer().save_pretrained(dense)
    (tmp_path / "cal.txt").write_text("\n\n".join(texts()))
    return {"ghosted": ghosted, "mapped": tmp_path / "ghosted-mapped", "dense": dense, "cal": tmp_path / "cal.txt"}


def commands(folders: dict[str, Path], out: Path) -> list[list[str]]:
    """Every command that loads a model, on a folder carrying code."""
    ghosted, mapped, dense, cal = (str(folders[k]) for k in ("ghosted", "mapped", "dense", "cal"))
    small = ["--seq-len", "16", "--num-sequences", "8", "--calibration", cal]
    return [
        ["eval", ghosted, "--windows", "1", "--seq-len", "16", "--text", cal],
        ["eval", mapped, "--windows", "1", "--seq-len", "16", "--text", cal],
        ["eval", dense, "--windows", "1", "--seq-len", "16", "--text", cal],
        ["prune", dense, "--num-layers", "1", "--dry-run", *small],
        ["prune", dense, "--num-layers", "1", "--layerwise", "--dry-run", *small],
        ["stats", "collect", dense, "--num-layers", "1", "--output", str(out / "stats.safetensors"), *small],
        ["export-stock", ghosted, "--output", str(out / "stock"), "--seq-len", "16", "--num-sequences", "8", "--calibration", cal],
        ["heal", ghosted, "--output", str(out / "healed"), "--max-steps", "1", "--seq-len", "16", "--per-device-train-batch-size", "1",
         "--eval-sequences", "1", "--data", cal],
        ["export-gguf", ghosted, str(out / "model.gguf"), "--llama-cpp", str(out / "no-llama-cpp")],
        ["inspect", ghosted],
    ]


@pytest.mark.slow
def test_no_code_of_a_folder_runs_without_trust(folders: dict[str, Path], tmp_path: Path, capsys) -> None:
    markers = plant_code(folders["ghosted"], auto_map=False) + plant_code(folders["mapped"]) + plant_code(folders["dense"])
    for argv in commands(folders, tmp_path):
        code, err = main(argv), capsys.readouterr().err
        assert code == 0 or "llama.cpp" in err, (argv, err)  # export-gguf stops at the missing converter
        assert not [m.name for m in markers if m.exists()], argv
    # The same folders with the user's trust: the check above can fail.
    main(["eval", str(folders["ghosted"]), "--windows", "1", "--seq-len", "16", "--text", str(folders["cal"]),
          "--trust-remote-code"])
    ran = {m.name for m in markers if m.exists()}
    assert {"RAN-generate", "RAN-tokenization_evil"} <= ran


def test_loaded_models_never_fetch_hub_kernels(dense_folder: Path, monkeypatch) -> None:
    """transformers kernelizes every model it loads when `kernels` is installed, and on a GPU that downloads and
    runs Hub code at the next train()/eval() (an offline heal on an H200 failed there). ghosted_hf's loads, the
    demo's included, never ask for it; a plain from_pretrained does (the check can fail)."""
    import transformers.modeling_utils as modeling_utils
    from transformers import AutoModelForCausalLM

    from ghosted_hf.model.loading import load_model

    kernelized = []
    monkeypatch.setattr(modeling_utils, "kernelize", lambda model, **kwargs: kernelized.append(type(model).__name__))
    model, _ = load_model(str(dense_folder))
    model.train()
    model.eval()
    assert not model.use_kernels and kernelized == []
    AutoModelForCausalLM.from_pretrained(dense_folder)
    assert kernelized
