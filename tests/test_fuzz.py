"""Random damage to saved folders and statistics files (seeded, bounded): every outcome is either a clean
one-line error or a model / statistics equal to the original. Format 1.0 hashes the operators and the
statistics, not the base weights: a changed byte inside a base weight's data is another model, which no
reader can tell from a legitimate one, so the byte flips here target what the files do claim (headers,
operator data, config fields), plus truncations and removed files."""

from __future__ import annotations

import json
import random
import shutil
import struct
from pathlib import Path

import torch
from tiny import PAD, batch, build, char_tokenizer, random_operator, sequences
from transformers import AutoModelForCausalLM

from ghosted_hf import GhostedError, prune_layers, save_with_card
from ghosted_hf.io.files import verify_folder
from ghosted_hf.statistics import CalibrationStatistics, collect_statistics, least_squares
from ghosted_hf.text.tokens import batch_sequences

CASES = 40
CONFIG_EDITS = [
    ("removed_layers", lambda rng: [rng.randrange(8)]), ("original_num_hidden_layers", lambda rng: rng.choice([5, 7, 10**9])),
    ("operator_dtype", lambda rng: rng.choice(["float16", "int8", None])),
    ("ghost_format_version", lambda rng: rng.choice(["2.0", "x", 1, None])),
    ("text_config.num_hidden_layers", lambda rng: rng.choice([1, 3, 5, 10**9])),
    ("text_config.hidden_size", lambda rng: rng.choice([16, 33, 64])),
    ("ghost_boundaries.0.layer", lambda rng: rng.choice([0, 2, 3, None])),
    ("ghost_boundaries.0.sha256", lambda rng: rng.choice(["", "0" * 64, None])),
    ("ghost_boundaries", lambda rng: []),
]


def header_span(path: Path) -> tuple[int, int]:
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    return 8, 8 + length


def operator_span(path: Path, key: str) -> tuple[int, int]:
    raw = path.read_bytes()
    start, end = header_span(path)
    begin, finish = json.loads(raw[start:end])[key]["data_offsets"]
    return end + begin, end + finish


def damage(folder: Path, rng: random.Random) -> str:
    weights = folder / "model.safetensors"
    kind = rng.choice(["header byte", "operator byte", "truncate", "config", "remove"])
    if kind in ("header byte", "operator byte"):
        start, end = header_span(weights) if kind == "header byte" else operator_span(weights, "model.layers.2.ghost.operator")
        raw = bytearray(weights.read_bytes())
        at = rng.randrange(start, end)
        raw[at] ^= 1 << rng.randrange(8)
        weights.write_bytes(bytes(raw))
        return f"{kind} {at}"
    if kind == "truncate":
        size = weights.stat().st_size
        weights.write_bytes(weights.read_bytes()[: rng.randrange(size)])
        return kind
    if kind == "remove":
        name = rng.choice(["config.json", "model.safetensors", "modeling_ghosted.py", "configuration_ghosted.py"])
        (folder / name).unlink()
        return f"remove {name}"
    field, value = rng.choice(CONFIG_EDITS)
    config = json.loads((folder / "config.json").read_text())
    target, *path = field.split(".")
    node = config
    keys = [target, *path]
    for key in keys[:-1]:
        node = node[int(key)] if isinstance(node, list) else node[key]
    last = keys[-1]
    if isinstance(node, list):
        node[int(last)] = value(rng)
    else:
        node[last] = value(rng)
    (folder / "config.json").write_text(json.dumps(config))
    return f"config {field}"


def one_line(error: BaseException) -> bool:
    return bool(str(error).strip()) and "\n" not in str(error).strip()


def test_damaged_folders_give_a_clean_error_or_the_same_model(tmp_path: Path) -> None:
    original = prune_layers(build("llama"), [2, 3], {2: random_operator(1)}).eval()
    save_with_card(original, tmp_path / "good", char_tokenizer())
    inputs = batch()
    with torch.no_grad():
        expected = original(**inputs).logits
    rng = random.Random(0)
    outcomes = []
    for case in range(CASES):
        folder = tmp_path / f"case{case}"
        shutil.copytree(tmp_path / "good", folder)
        what = damage(folder, rng)
        try:
            verify_folder(folder)
            model = AutoModelForCausalLM.from_pretrained(folder).eval()
        except (GhostedError, ValueError, OSError) as error:
            assert one_line(error), (what, str(error)[:500])
            outcomes.append("refused")
            continue
        with torch.no_grad():
            assert torch.equal(model(**inputs).logits, expected), what  # accepted: it must be the same model
        outcomes.append("same")
    assert outcomes.count("refused") >= CASES // 2  # the damage was real


def test_damaged_statistics_files_give_a_clean_error_or_the_same_sums(tmp_path: Path) -> None:
    stats = collect_statistics(build("llama"), batch_sequences(sequences(), 3, PAD), least_squares(1, 4),
                               progress=False)
    stats.save(tmp_path / "good.safetensors")
    rng = random.Random(1)
    refused = 0
    for case in range(CASES):
        path = tmp_path / f"case{case}.safetensors"
        raw = bytearray((tmp_path / "good.safetensors").read_bytes())
        if rng.random() < 0.3:
            raw = raw[: rng.randrange(len(raw))]
        else:
            at = rng.randrange(len(raw))
            raw[at] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(raw))
        try:
            loaded = CalibrationStatistics.load(path)
        except GhostedError as error:
            assert one_line(error), str(error)[:500]
            refused += 1
            continue
        assert loaded.tokens == stats.tokens and all(torch.equal(loaded.tensors[k], v) for k, v in stats.tensors.items())
    assert refused >= CASES // 2
