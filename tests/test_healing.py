"""LoRA healing with PEFT: loss goes down, merge keeps the format, adapters round-trip."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from ghosted_hf import ghost_prune
from ghosted_hf.data import tokenize_texts
from ghosted_hf.healing import EAGER_MAX_LEN, TARGET_MODULES, base_model_reference, heal, lr_factor, merge, resolve_precision
from isolated import assert_loads_with_same_logits
from tiny import batch, build, char_tokenizer, kl_to_dense, texts

FAST = dict(seq_len=48, num_sequences=24)


def pruned():
    return ghost_prune(build("llama"), char_tokenizer(), texts(), criterion="manual", layers=[2, 3], **FAST)


def mean_lm_loss(model, batches) -> float:
    with torch.no_grad():
        return sum(model(**b, labels=b["input_ids"].masked_fill(b["attention_mask"] == 0, -100)).loss.item()
                   for b in batches) / len(batches)


def test_lora_goes_on_every_linear_layer_of_every_decoder_layer() -> None:
    import re

    healed = heal(pruned(), char_tokenizer(), texts(), steps=1, seq_len=48, progress=False)
    adapted = {n.split(".lora_A")[0].removeprefix("base_model.model.") for n, _ in healed.model.named_parameters()
               if "lora_A" in n}
    linear = {f"model.layers.{i}.{name}" for i in range(4) for name in
              ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")}
    assert adapted == linear and not re.fullmatch(TARGET_MODULES, "lm_head")


@pytest.mark.parametrize("teacher", [False, True])
def test_healing_lowers_the_training_loss(teacher: bool) -> None:
    tokenizer = char_tokenizer()
    model = pruned()
    batches = tokenize_texts(tokenizer, texts(), 48, batch_size=4).batches
    dense = build("llama")
    measure = (lambda m: kl_to_dense(dense, m, batches)) if teacher else (lambda m: mean_lm_loss(m, batches))
    before = measure(model)
    peft_model, losses, _ = heal(model, tokenizer, texts(), teacher=dense if teacher else None, steps=30,
                                 lr=1e-3 if teacher else 5e-3, seq_len=48, train_operators=True, progress=False)
    assert len(losses) == 30
    assert measure(peft_model) < before  # the training objective, on all training batches
    trained = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert any("lora_A" in n for n in trained) and any(".ghost." in n for n in trained)


def test_linear_schedule_decays_to_zero_and_constant_stays() -> None:
    assert [lr_factor("linear", step / 4) for step in range(4)] == [1.0, 0.75, 0.5, 0.25]
    assert lr_factor("linear", 1.25) == 0.0  # a timed run's last step may start past its budget
    assert {lr_factor("constant", step / 4) for step in range(4)} == {1.0}


def test_timed_healing_stops_once_the_budget_is_spent() -> None:
    now = 0.0

    def step_takes_50_seconds(model, losses: list[float]) -> bool:
        nonlocal now
        now += 50.0
        return False

    # steps start at 0, 50 and 100 s of a 120 s budget; the one that would start at 150 s does not
    _, losses, record = heal(pruned(), char_tokenizer(), texts(), minutes=2, steps=1, seq_len=48, progress=False,
                             clock=lambda: now, after_step=step_takes_50_seconds)
    assert len(losses) == 3 and record["steps"] == 3 and record["minutes"] == 2
    for minutes in (0, -1):  # no silent "train for steps instead"
        with pytest.raises(ValueError, match=f"minutes must be positive .*got {minutes}"):
            heal(pruned(), char_tokenizer(), texts(), minutes=minutes, progress=False)


@pytest.mark.parametrize("seq_len, during", [(48, "eager"), (EAGER_MAX_LEN + 1, "sdpa")])
def test_short_training_sequences_use_eager_attention_on_cpu_then_the_models_own(seq_len: int, during: str) -> None:
    model = pruned()
    model.set_attn_implementation("sdpa")
    seen: list[str] = []
    heal(model, char_tokenizer(), texts() * 4, steps=2, seq_len=seq_len, batch_size=1, progress=False,
         after_step=lambda m, l: seen.append(model.model.layers[0].self_attn.config._attn_implementation) or False)
    assert seen == [during, during] and model.model.layers[0].self_attn.config._attn_implementation == "sdpa"


def test_precision_auto_is_bf16_only_where_native(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert resolve_precision("fp32", cpu) == "fp32" and resolve_precision("bf16", cpu) == "bf16"
    assert resolve_precision("auto", torch.device("meta")) == "fp32"
    for amx, avx512_bf16, expected in [(False, False, "fp32"), (True, False, "bf16"), (False, True, "bf16")]:
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
        assert resolve_precision("auto", cpu) == expected


def test_bf16_autocast_healing_trains_fp32_adapters_and_records_its_options() -> None:
    tokenizer = char_tokenizer()
    model = pruned()
    batches = tokenize_texts(tokenizer, texts(), 48, batch_size=4).batches
    before = mean_lm_loss(model, batches)
    healed = heal(model, tokenizer, texts(), steps=30, lr=5e-3, seq_len=48, precision="bf16", schedule="linear",
                  progress=False)
    assert mean_lm_loss(healed.model, batches) < before
    adapters = [p for n, p in healed.model.named_parameters() if "lora_" in n]
    assert adapters and all(p.dtype == torch.float32 for p in adapters)
    healing = merge(healed).config.ghost_provenance["healing"]
    assert healing["precision"] == "bf16" and healing["schedule"] == "linear"


@pytest.mark.slow
def test_merged_model_saves_and_reloads_without_ghosted_hf(tmp_path: Path) -> None:
    merged = merge(heal(pruned(), char_tokenizer(), texts(), steps=10, lr=5e-3, seq_len=48, train_operators=True,
                        progress=False))
    healing = merged.config.ghost_provenance["healing"]
    assert type(merged).__name__ == "GhostedForCausalLM" and healing["r"] == 8
    assert healing["steps"] == 10 and healing["lr"] == 5e-3 and healing["loss"] == "next-token cross-entropy"
    assert 0 < healing["tokens"] <= 10 * 4 * 48
    merged.save_pretrained(tmp_path / "merged")
    assert "LOADED transformers_modules" in assert_loads_with_same_logits(tmp_path / "merged", merged, batch(), tmp_path)


def test_adapter_round_trip_with_peft(tmp_path: Path) -> None:
    base = pruned()
    base.save_pretrained(tmp_path / "base")
    peft_model = heal(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), char_tokenizer(), texts(), steps=10,
                      lr=5e-3, seq_len=48, train_operators=True, progress=False).model
    peft_model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    inputs = batch()
    with torch.no_grad():
        expected = peft_model(**inputs).logits
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(reloaded(**inputs).logits, expected)


def test_after_step_sees_every_step_and_can_stop_training() -> None:
    calls: list[tuple[int, bool]] = []

    def after_step(model, losses: list[float]) -> bool:
        calls.append((len(losses), model.training))
        model.eval()  # as an evaluation would; the next step must train again
        return len(losses) == 3

    _, losses, record = heal(pruned(), char_tokenizer(), texts(), steps=10, lr=5e-3, seq_len=48, progress=False,
                             after_step=after_step)
    assert calls == [(1, True), (2, True), (3, True)] and len(losses) == 3 and record["steps"] == 3


def test_teacher_base_is_the_recorded_base_model(tmp_path: Path) -> None:
    model = pruned()
    model.config.ghost_provenance = {**model.config.ghost_provenance, "base_model_path": str(tmp_path),
                                     "base_model": "someone/dense"}
    assert base_model_reference(model) == str(tmp_path)  # the folder it was pruned from, while it exists
    model.config.ghost_provenance["base_model_path"] = str(tmp_path / "moved")
    assert base_model_reference(model) == "someone/dense"  # else the Hub id
    model.config.ghost_provenance["base_model"] = None
    with pytest.raises(ValueError, match=r"records no reachable base model .*\(teacher 'none'\)"):
        base_model_reference(model)
