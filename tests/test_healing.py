"""LoRA healing with PEFT: loss goes down, merge keeps the format, adapters round-trip."""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path

import pytest
import torch
from isolated import assert_loads_with_same_logits
from peft import PeftModel
from tiny import batch, build, char_tokenizer, kl_to_dense, texts
from transformers import AutoModelForCausalLM, TrainerCallback, TrainingArguments

from ghosted_hf import ghost_prune, save_with_card
from ghosted_hf.architectures import lora_targets
from ghosted_hf.cli import build_parser
from ghosted_hf.errors import GhostedError
from ghosted_hf.pipelines.healing import (EAGER_MAX_LEN, HealOptions, base_model_reference, heal, lr_factor,
                                          merge, resolve_precision, sharded)
from ghosted_hf.text.tokens import tokenize_texts

FAST = dict(seq_len=48, num_sequences=24)


def pruned(**overrides):
    return ghost_prune(build("llama", **overrides), char_tokenizer(), texts(), criterion="manual", layers=[2, 3], **FAST)


def mean_lm_loss(model, batches) -> float:
    with torch.no_grad():
        return sum(model(**b, labels=b["input_ids"].masked_fill(b["attention_mask"] == 0, -100)).loss.item()
                   for b in batches) / len(batches)


def test_lora_goes_on_every_linear_layer_of_every_decoder_layer() -> None:
    import re

    healed = heal(pruned(), char_tokenizer(), texts(), max_steps=1, seq_len=48, progress=False)
    adapted = {n.split(".lora_A")[0].removeprefix("base_model.model.") for n, _ in healed.model.named_parameters()
               if "lora_A" in n}
    linear = {f"model.layers.{i}.{name}" for i in range(4) for name in
              ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")}
    assert adapted == linear and not re.fullmatch(lora_targets(healed.model.get_base_model()), "lm_head")


@pytest.mark.parametrize("teacher", [False, True])
def test_healing_lowers_the_training_loss(teacher: bool) -> None:
    tokenizer = char_tokenizer()
    model = pruned()
    batches = tokenize_texts(tokenizer, texts(), 48, batch_size=4).batches
    dense = build("llama")
    measure = (lambda m: kl_to_dense(dense, m, batches)) if teacher else (lambda m: mean_lm_loss(m, batches))
    before = measure(model)
    peft_model, losses, _, _ = heal(model, tokenizer, texts(), teacher=dense if teacher else None, max_steps=30,
                                 learning_rate=1e-3 if teacher else 5e-3, seq_len=48, train_operators=True, progress=False)
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

    class StepTakes50Seconds(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            nonlocal now
            now += 50.0

    # steps start at 0, 50 and 100 s of a 120 s budget; the one that would start at 150 s does not
    _, losses, record, _ = heal(pruned(), char_tokenizer(), texts(), minutes=2, seq_len=48, progress=False,
                                clock=lambda: now, callbacks=[StepTakes50Seconds()], eval_sequences=0)
    assert len(losses) == 3 and record["steps"] == 3 and record["minutes"] == 2
    for minutes in (0, -1):  # no silent "train for steps instead"
        with pytest.raises(ValueError, match=f"minutes must be positive .*got {minutes}"):
            heal(pruned(), char_tokenizer(), texts(), minutes=minutes, progress=False)


@pytest.mark.parametrize("seq_len, during", [(48, "eager"), (EAGER_MAX_LEN + 1, "sdpa")])
def test_short_training_sequences_use_eager_attention_on_cpu_then_the_models_own(seq_len: int, during: str) -> None:
    model = pruned(max_position_embeddings=1024)
    model.set_attn_implementation("sdpa")
    seen: list[str] = []

    class Watch(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(model.model.layers[0].self_attn.config._attn_implementation)

    heal(model, char_tokenizer(), texts() * 4, max_steps=2, seq_len=seq_len, per_device_train_batch_size=1, progress=False,
         callbacks=[Watch()], eval_sequences=1)
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
    healed = heal(model, tokenizer, texts(), max_steps=30, learning_rate=5e-3, seq_len=48, precision="bf16",
                  lr_scheduler_type="linear", progress=False)
    assert mean_lm_loss(healed.model, batches) < before
    adapters = [p for n, p in healed.model.named_parameters() if "lora_" in n]
    assert adapters and all(p.dtype == torch.float32 for p in adapters)
    healing = merge(healed).config.ghost_provenance["healing"]
    assert healing["precision"] == "bf16" and healing["lr_scheduler_type"] == "linear"


@pytest.mark.slow
def test_merged_model_saves_and_reloads_without_ghosted_hf(tmp_path: Path) -> None:
    merged = merge(heal(pruned(), char_tokenizer(), texts(), max_steps=10, learning_rate=5e-3, seq_len=48, train_operators=True,
                        progress=False))
    healing = merged.config.ghost_provenance["healing"]
    assert type(merged).__name__ == "GhostedForCausalLM" and healing["r"] == 8
    assert healing["steps"] == 10 and healing["learning_rate"] == 5e-3 and healing["loss"] == "next-token cross-entropy"
    assert 0 < healing["tokens"] <= 10 * 4 * 48
    merged.save_pretrained(tmp_path / "merged")
    assert "LOADED transformers_modules" in assert_loads_with_same_logits(tmp_path / "merged", merged, batch(), tmp_path)


def test_adapter_round_trip_with_peft(tmp_path: Path) -> None:
    base = pruned()
    base.save_pretrained(tmp_path / "base")
    peft_model = heal(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), char_tokenizer(), texts(), max_steps=10,
                      learning_rate=5e-3, seq_len=48, train_operators=True, progress=False).model
    peft_model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    inputs = batch()
    with torch.no_grad():
        expected = peft_model(**inputs).logits
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(reloaded(**inputs).logits, expected)


def test_a_callback_sees_every_step_and_can_stop_training() -> None:
    calls: list[tuple[int, bool]] = []

    class StopAt3(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            calls.append((state.global_step, model.training))
            control.should_training_stop = state.global_step == 3

    _, losses, record, _ = heal(pruned(), char_tokenizer(), texts(), max_steps=10, learning_rate=5e-3, seq_len=48, progress=False,
                                callbacks=[StopAt3()])
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


def test_heal_loads_the_base_model_as_teacher(tmp_path: Path) -> None:
    """What `ghosted heal --teacher base` does, the Python API does too: the recorded dense folder is the teacher."""
    build("llama").save_pretrained(tmp_path / "dense")
    char_tokenizer().save_pretrained(tmp_path / "dense")
    model = pruned()
    model.config.ghost_provenance = {**model.config.ghost_provenance, "base_model_path": str(tmp_path / "dense")}
    healed = heal(model, char_tokenizer(), texts(), teacher="base", max_steps=2, seq_len=48, progress=False)
    assert healed.record["teacher"] == str(tmp_path / "dense")
    assert healed.record["loss"] == "KL to the teacher's logits"


def stock(operator: str = "folded"):
    return ghost_prune(build("llama"), char_tokenizer(), texts(), criterion="manual", layers=[2, 3], operator=operator,
                       **FAST)


@pytest.mark.slow
@pytest.mark.parametrize("operator", ["folded", "replaceme-ls", "none"])
def test_a_stock_export_heals_into_a_stock_checkpoint_that_loads_without_remote_code(tmp_path: Path,
                                                                                     operator: str) -> None:
    from ghosted_hf.io.card import save_with_card

    healed = merge(heal(stock(operator), char_tokenizer(), texts(), max_steps=5, learning_rate=5e-3, seq_len=48, progress=False))
    assert type(healed).__name__ == "LlamaForCausalLM" and healed.config.num_hidden_layers == 4
    provenance = healed.config.ghost_provenance
    assert provenance["stock_export"]["removed_layers"] == [2, 3] and provenance["healing"]["steps"] == 5
    save_with_card(healed, tmp_path / "healed", char_tokenizer())
    assert not list((tmp_path / "healed").glob("*.py"))  # no remote code added
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "healed")  # trust_remote_code not needed
    inputs = batch()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, healed(**inputs).logits)
    assert reloaded.config.ghost_provenance["healing"]["loss"] == "next-token cross-entropy"
    with pytest.raises(ValueError, match="train_operators needs a ghosted model"):
        heal(stock(operator), char_tokenizer(), texts(), train_operators=True, progress=False)


def test_a_teacher_in_another_dtype_distills() -> None:
    """A bf16 teacher gives the losses its float32 copy gives, up to bf16 rounding of its logits, and not the
    losses of healing without a teacher: it is used, in its own dtype."""
    teacher = build("llama").to(torch.bfloat16)
    run = dict(max_steps=2, seq_len=48, progress=False, precision="fp32")
    healed = heal(pruned(), char_tokenizer(), texts(), teacher=teacher, **run)
    assert next(teacher.parameters()).dtype == torch.bfloat16  # left as given
    upcast = heal(pruned(), char_tokenizer(), texts(), teacher=copy.deepcopy(teacher).float(), **run)
    alone = heal(pruned(), char_tokenizer(), texts(), **run)
    assert len(healed.losses) == 2 and all(math.isfinite(loss) and loss > 0 for loss in healed.losses)
    assert healed.losses == pytest.approx(upcast.losses, rel=0.02)
    assert all(abs(a - b) > 0.05 * b for a, b in zip(healed.losses, alone.losses))


def test_a_dense_model_is_refused() -> None:
    with pytest.raises(ValueError, match=r"records no pruning .*healing a dense model is fine-tuning"):
        heal(build("llama"), char_tokenizer(), texts(), max_steps=1, progress=False)


@pytest.mark.parametrize("override, message", [
    (dict(max_steps=0), "max_steps must be positive (or -1: 150 unless tokens or minutes), got 0"),
    (dict(tokens=0), "tokens must be positive"),
    (dict(minutes=float("nan")), "minutes must be a finite number, got nan"),
    (dict(kd_weight=1.5), "kd_weight must be between 0 and 1, got 1.5"),
    (dict(tokens=100, minutes=1.0), "Give one budget"),
    (dict(eval_steps=2, eval_sequences=0), "eval_steps needs held-out text"),
    (dict(bf16=True), "leave bf16 and fp16 off"),
    (dict(warmup_steps=5), "leave warmup_steps at 0, got 5"),
    (dict(lr_scheduler_type="cosine"), "Unknown lr_scheduler_type 'cosine'; choose one of: constant, linear"),
])
def test_bad_options_are_refused_with_the_value(override: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        heal(pruned(), char_tokenizer(), texts(), progress=False, **override)


def test_heal_options_extend_training_arguments_and_every_trainer_setting_applies_and_is_recorded() -> None:
    """As TRL's configs do: a Trainer setting healing does not declare (here AdamW's beta2) reaches the optimizer,
    and the record keeps the settings changed from healing's defaults, not the Trainer's hundred others."""
    seen = {}

    class Spy(TrainerCallback):
        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            seen["betas"] = optimizer.param_groups[0]["betas"]

    healed = heal(pruned(), char_tokenizer(), texts(), max_steps=1, seq_len=48, adam_beta2=0.95, progress=False,
                  callbacks=[Spy()])
    assert isinstance(HealOptions(), TrainingArguments) and seen["betas"] == (0.9, 0.95)
    assert healed.record["adam_beta2"] == 0.95 and healed.record["learning_rate"] == 2e-3
    assert "adam_beta1" not in healed.record and "output_dir" not in healed.record


def test_former_option_names_are_still_accepted_with_a_future_warning() -> None:
    with pytest.warns(FutureWarning, match="The option lr is now learning_rate"):
        options = HealOptions.build(lr=1e-3, steps=5, batch_size=2)
    assert (options.learning_rate, options.max_steps, options.per_device_train_batch_size) == (1e-3, 5, 2)
    parsed = build_parser().parse_args(["heal", "pruned", "--output", "healed", "--steps", "3", "--save-every", "2"])
    assert (parsed.max_steps, parsed.save_steps) == (3, 2)


def test_too_little_or_no_text_is_refused() -> None:
    with pytest.raises(ValueError, match=r"gives 3 sequences of 48 tokens \(after 1 held out\), fewer than one step needs \(4\)"):
        heal(pruned(), char_tokenizer(), [texts()[0][:60], texts()[1][:150]], seq_len=48, eval_sequences=1,
             progress=False)
    with pytest.raises(ValueError, match=r"The training data \(2 texts given as a list of strings\) holds no text"):
        heal(pruned(), char_tokenizer(), ["  ", ""], seq_len=48, progress=False)
    with pytest.raises(ValueError, match="No held-out sequence of 48 tokens could be made from the evaluation data"):
        heal(pruned(), char_tokenizer(), texts(), seq_len=48, eval_data=["too short"], progress=False)


def test_a_token_budget_is_whole_steps_and_recorded() -> None:
    _, losses, record, _ = heal(pruned(), char_tokenizer(), texts(), tokens=1000, seq_len=48, progress=False)
    assert len(losses) == 6 == record["steps"] and record["tokens"] == 6 * 4 * 48  # ceil(1000 / 192)


def adapters(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def test_gradient_accumulation_trains_as_the_larger_batch() -> None:
    """Every micro-batch holds as many tokens, so two of 2 sequences are one step of 4 (up to float rounding)."""
    runs = [adapters(heal(pruned(), char_tokenizer(), texts(), max_steps=4, seq_len=48, progress=False, precision="fp32",
                          per_device_train_batch_size=batch_size, gradient_accumulation_steps=accumulation).model)
            for batch_size, accumulation in ((4, 1), (2, 2))]
    assert runs[0].keys() == runs[1].keys()
    for name in runs[0]:
        torch.testing.assert_close(runs[0][name], runs[1][name], rtol=1e-4, atol=1e-5)


def test_gradient_checkpointing_recomputes_the_same_training() -> None:
    runs = [adapters(heal(pruned(), char_tokenizer(), texts(), max_steps=3, seq_len=48, progress=False, precision="fp32",
                          activation_checkpointing=checkpointing).model) for checkpointing in (False, True)]
    for name in runs[0]:
        torch.testing.assert_close(runs[0][name], runs[1][name], rtol=1e-5, atol=1e-6)


def test_held_out_perplexity_is_the_models_perplexity_on_text_it_never_trained_on() -> None:
    from ghosted_hf.text.documents import Documents
    from ghosted_hf.text.tokens import training_sequences

    healed = heal(pruned(), char_tokenizer(), texts(), max_steps=3, seq_len=48, eval_sequences=4, progress=False,
                  precision="fp32")
    held = training_sequences(char_tokenizer(), Documents(texts(), "t"), 48, held_out=4).held_out
    ids = held.long()
    with torch.no_grad():
        loss = healed.model(input_ids=ids, labels=ids).loss
    assert healed.evaluations[-1]["step"] == 3 and healed.record["data"]["held_out_sequences"] == 4
    assert healed.record["held_out_perplexity"] == pytest.approx(float(loss.exp()), rel=1e-5)


@pytest.mark.slow
def test_tensorboard_gets_every_step_and_the_evaluations(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    heal(pruned(), char_tokenizer(), texts(), max_steps=4, seq_len=48, eval_steps=2, progress=False,
         report_to="tensorboard", checkpoints=tmp_path)
    events = EventAccumulator(str(next(tmp_path.glob("runs/*")))).Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
    assert [e.step for e in events.Scalars("eval/perplexity")] == [2, 4]
    with pytest.raises(ValueError, match="need the checkpoints folder"):
        heal(pruned(), char_tokenizer(), texts(), report_to="tensorboard", progress=False)


def test_zero3_that_cannot_gather_its_shards_is_refused_before_training() -> None:
    """The healed model is gathered from ZeRO-3's shards at the end, which DeepSpeed does only with 16-bit weights on
    save: without them the run would train and then fail, so it is refused at once, naming the setting."""
    from types import SimpleNamespace

    def trainer(zero_optimization: dict) -> SimpleNamespace:
        plugin = SimpleNamespace(zero_stage=zero_optimization.get("stage"),
                                 deepspeed_config={"zero_optimization": zero_optimization})
        return SimpleNamespace(accelerator=SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin)),
                               is_fsdp_enabled=False)

    with pytest.raises(GhostedError, match="zero3_save_16bit_model: true"):
        sharded(trainer({"stage": 3}))
    assert sharded(trainer({"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}))
    assert not sharded(trainer({"stage": 2}))


@pytest.mark.parametrize("cause", ["learning rate", "teacher"])
def test_a_diverged_heal_stops_with_the_step_and_saves_nothing(cause: str, tmp_path: Path) -> None:
    """A run whose loss becomes NaN or Inf stops there with one line naming the step and the remedy; a model
    holding NaN or Inf anywhere (not only in its operators) is never saved."""
    teacher = None
    options = dict(max_steps=3, seq_len=48, progress=False)
    if cause == "teacher":
        teacher = build("llama")
        with torch.no_grad():
            teacher.lm_head.weight[3, 5] = float("nan")
    else:
        options["learning_rate"] = 1e10
    with pytest.raises(GhostedError, match=r"Healing diverged at step \d+: the training loss is (nan|inf).*Lower --learning-rate"):
        heal(pruned(), char_tokenizer(), texts(), teacher=teacher, **options)

    model = pruned()
    save_with_card(model, tmp_path / "saved", char_tokenizer())
    before = sorted(p.name for p in (tmp_path / "saved").iterdir())
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("inf")
    with pytest.raises(GhostedError, match=r"NaN or Inf values in 1 tensor\(s\) \(model\.layers\.1\.mlp\.down_proj"):
        save_with_card(model, tmp_path / "saved", char_tokenizer())
    assert sorted(p.name for p in (tmp_path / "saved").iterdir()) == before  # the previous save is intact
    assert [p.name for p in tmp_path.iterdir()] == ["saved"]  # and no staging folder is left


@pytest.mark.parametrize("teacher", [False, True])
def test_a_family_whose_head_is_more_than_a_layer_heals_without_whole_logits(teacher: bool) -> None:
    """Gemma 2 (soft-capped logits): training and held-out losses go through the family's own head a chunk of
    positions at a time, never batch x sequence x vocabulary logits, and healing lowers the training loss."""
    from tiny import tiny_family

    dense = tiny_family("gemma2")
    model = ghost_prune(copy.deepcopy(dense), char_tokenizer(), texts(), criterion="manual", layers=[1], **FAST)
    rows: list[int] = []
    model.get_output_embeddings().register_forward_hook(lambda m, args, out: rows.append(out.shape[:-1].numel()))
    batches = tokenize_texts(char_tokenizer(), texts(), 48, batch_size=4).batches
    measure = (lambda m: kl_to_dense(dense, m, batches)) if teacher else (lambda m: mean_lm_loss(m, batches))
    before = measure(model)
    rows.clear()
    healed, losses, _, _ = heal(model, char_tokenizer(), texts(), teacher=dense if teacher else None, max_steps=10,
                                learning_rate=5e-3, seq_len=48, kl_chunk=8, eval_sequences=2, progress=False)
    assert len(losses) == 10 and rows and max(rows) <= 8, max(rows)
    assert measure(healed) < before
