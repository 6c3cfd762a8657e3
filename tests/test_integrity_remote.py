"""Integrity of the saved format, enforced by the remote model class: operator dtype and sha256 in config.json."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import batch, build, random_operator
from transformers import AutoModelForCausalLM

from ghosted_hf import GhostedForCausalLM, prune_layers

LAYER_KEY = "model.layers.1.ghost.operator"
NORM_KEY = "model.norm.ghost.operator"


def ghosted(arch: str = "llama") -> GhostedForCausalLM:
    # Boundaries feed pruned layer 1 (removed [1]) and the final norm (removed [5]).
    return prune_layers(build(arch), [1, 5], {1: random_operator(1), 5: random_operator(2)}).eval()


def read_safetensors(path: Path) -> tuple[dict, int, bytes]:
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + size]), 8 + size, raw


def boundaries(folder: Path) -> dict[str, dict]:
    config = json.loads((folder / "config.json").read_text())
    keys = {"layer": lambda b: f"model.layers.{b['layer']}.ghost.operator", "norm": lambda b: NORM_KEY}
    return {keys[b["target"]](b): b for b in config["ghost_boundaries"]}


def test_save_records_sha256_of_the_stored_bytes(tmp_path: Path) -> None:
    ghosted().save_pretrained(tmp_path)
    header, start, raw = read_safetensors(tmp_path / "model.safetensors")
    recorded = boundaries(tmp_path)
    assert set(recorded) == {LAYER_KEY, NORM_KEY}
    for key, boundary in recorded.items():
        assert header[key]["dtype"] == "F32"
        a, b = header[key]["data_offsets"]
        assert boundary["sha256"] == hashlib.sha256(raw[start + a:start + b]).hexdigest(), key
    assert json.loads((tmp_path / "config.json").read_text())["operator_dtype"] == "float32"


def test_flipped_byte_in_an_operator_is_refused_naming_it(tmp_path: Path) -> None:
    ghosted().save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    header, start, raw = read_safetensors(path)
    a, b = header[NORM_KEY]["data_offsets"]
    data = bytearray(raw)
    data[start + a + 5] ^= 0x01  # a mantissa bit: the value stays finite and plausible
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"{NORM_KEY} does not match the sha256 recorded") as info:
        AutoModelForCausalLM.from_pretrained(tmp_path)
    assert LAYER_KEY not in str(info.value)


def test_operator_finite_in_float64_but_not_in_storage_dtype_is_refused(tmp_path: Path) -> None:
    ghosted().save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    operator = tensors[LAYER_KEY].double()
    operator[0, 0] = 1e300  # finite as float64, inf as float32
    assert torch.isfinite(operator).all()
    tensors[LAYER_KEY] = operator
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    for boundary in config["ghost_boundaries"]:
        boundary.pop("sha256")  # no hash to catch it: the finiteness check must
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"operator {LAYER_KEY} holds NaN or Inf values \(as float32\)"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_finiteness_is_judged_in_the_storage_dtype() -> None:
    model = ghosted()
    assert model.operator_value_problems() == []
    wide = model.get_parameter(LAYER_KEY).detach().double()
    wide[3, 4] = 1e300  # as a loader that kept the checkpoint's float64 would leave it
    model.model.layers[1].ghost.operator = torch.nn.Parameter(wide)
    assert torch.isfinite(model.get_parameter(LAYER_KEY)).all()
    assert model.operator_value_problems() == [f"operator {LAYER_KEY} holds NaN or Inf values (as float32)"]


def test_cast_to_bfloat16_then_save_records_bfloat16(tmp_path: Path) -> None:
    model = ghosted("qwen3").to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["operator_dtype"] == "bfloat16"
    stored = load_file(tmp_path / "model.safetensors")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.operator_dtype == "bfloat16"
    for name, operator in model.ghost_operators().items():
        assert stored[name].dtype == torch.bfloat16, name
        assert loaded.get_parameter(name).dtype == torch.bfloat16, name
        assert torch.equal(loaded.get_parameter(name), operator), name
    inputs = batch()
    with torch.no_grad():  # not bit-equal: `.to()` also rounded the rotary buffers that a fresh build keeps fp32
        torch.testing.assert_close(loaded(**inputs).logits, model(**inputs).logits, rtol=0, atol=3e-2)


def test_bfloat16_load_of_float32_operators_passes_the_hash_check(tmp_path: Path) -> None:
    model = ghosted("qwen2")
    model.save_pretrained(tmp_path)
    assert all("sha256" in b for b in boundaries(tmp_path).values())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    for name, operator in model.ghost_operators().items():
        assert loaded.get_parameter(name).dtype == torch.float32, name
        assert torch.equal(loaded.get_parameter(name), operator), name


def test_hash_follows_operators_changed_after_a_save(tmp_path: Path) -> None:
    model = ghosted()
    model.save_pretrained(tmp_path / "first")
    with torch.no_grad():
        model.get_parameter(LAYER_KEY).mul_(0.5)
    model.save_pretrained(tmp_path / "second")
    first, second = boundaries(tmp_path / "first"), boundaries(tmp_path / "second")
    assert first[LAYER_KEY]["sha256"] != second[LAYER_KEY]["sha256"]
    assert first[NORM_KEY]["sha256"] == second[NORM_KEY]["sha256"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "second")
    assert torch.equal(loaded.get_parameter(LAYER_KEY), model.get_parameter(LAYER_KEY))


def test_operators_in_an_unsupported_dtype_are_not_saved(tmp_path: Path) -> None:
    model = ghosted().to(torch.float16)
    with pytest.raises(ValueError, match=r"model.layers.1.ghost.operator: float16.*float32, bfloat16"):
        model.save_pretrained(tmp_path)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize("recorded", [None, ""])
def test_a_checkpoint_without_operator_hashes_is_refused_unless_asked(tmp_path: Path, recorded: str | None) -> None:
    ghosted().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for boundary in config["ghost_boundaries"]:
        if recorded is None:
            boundary.pop("sha256")
        else:
            boundary["sha256"] = recorded
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"operator {LAYER_KEY} has no sha256 in config.json, so it cannot be verified"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, verify_operator_hashes=False)  # the user's explicit choice
    assert torch.equal(loaded.get_parameter(LAYER_KEY), ghosted().get_parameter(LAYER_KEY))
