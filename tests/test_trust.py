"""One trust policy: ghosted_hf's own remote code runs byte for byte; any other code file (a tokenizer's, a
config pointing elsewhere) runs only with --trust-remote-code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ghosted_hf import prune_layers, save_with_card
from ghosted_hf.loading import is_own_ghosted_model
from tiny import build, char_tokenizer, random_operator

EVIL = """
from pathlib import Path
Path({marker!r}).write_text("ran")
from transformers import PreTrainedTokenizerFast
class EvilTokenizer(PreTrainedTokenizerFast):
    pass
"""


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    target = tmp_path / "ghosted"
    save_with_card(prune_layers(build("llama"), [2, 3], {2: random_operator(1)}), target, char_tokenizer())
    return target


def ghosted_eval(folder: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ghosted_hf.cli", "eval", str(folder), "--windows", "1",
                           "--seq-len", "16", "--text", str(folder / "config.json"), *extra],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_tokenizer_s_code_never_inherits_the_model_s_trust(folder: Path) -> None:
    (folder / "tokenization_evil.py").write_text(EVIL.format(marker=str(folder / "EXECUTED")))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_evil.EvilTokenizer"]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert is_own_ghosted_model(str(folder))  # the model's code is ours: it is trusted
    ghosted_eval(folder)
    assert not (folder / "EXECUTED").exists()  # ... and the tokenizer's is not
    ghosted_eval(folder, "--trust-remote-code")
    assert (folder / "EXECUTED").exists()  # the user's explicit trust runs it (the check above can fail)


def test_a_config_pointing_at_other_code_is_not_our_code(folder: Path) -> None:
    (folder / "modeling_evil.py").write_text(EVIL.format(marker=str(folder / "EXECUTED")))
    config = json.loads((folder / "config.json").read_text())
    assert is_own_ghosted_model(str(folder))
    for reference in ("modeling_evil.GhostedForCausalLM", "someone/else--modeling_ghosted.GhostedForCausalLM"):
        config["auto_map"]["AutoModelForCausalLM"] = reference
        (folder / "config.json").write_text(json.dumps(config))
        assert not is_own_ghosted_model(str(folder)), reference
