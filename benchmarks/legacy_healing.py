"""The hand-written single-device healing loop of ghosted_hf 1.0 (before `heal` moved onto transformers' Trainer),
kept only so that `benchmarks/healing.py --implementations legacy trainer` can run the two side by side: same
LoRA, same AdamW groups, same shuffled packed batches, bf16 autocast where native, linear decay to zero."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import torch
from peft import LoraConfig, get_peft_model

from ghosted_hf.architectures import lora_targets
from ghosted_hf.pipelines.healing import HealOptions, lr_factor, resolve_precision, training_attention
from ghosted_hf.text.tokens import tokenize_texts


def legacy_heal(model, tokenizer, data, options: HealOptions, *, minutes: float | None = None,
                clock: Callable[[], float] = time.process_time,
                on_step: Callable[[float], None] | None = None) -> tuple[torch.nn.Module, int]:
    """(PEFT model, steps): next-token loss for `minutes` by `clock` (the schedule decaying over the time), or for
    `options.max_steps` steps; `on_step(time)` gets the `clock` at the start of every step and at the end."""
    torch.manual_seed(options.seed)
    batches = tokenize_texts(tokenizer, data, options.seq_len, batch_size=options.per_device_train_batch_size,
                             shuffle_seed=options.seed).batches
    config = LoraConfig(r=options.rank, lora_alpha=options.alpha, lora_dropout=0.0, target_modules=lora_targets(model),
                        task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in trainable if p.ndim > 1], "weight_decay": 0.01},
              {"params": [p for p in trainable if p.ndim <= 1], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=options.learning_rate)
    device = next(peft_model.parameters()).device
    precision = resolve_precision(options.precision, device)
    budget, steps, started = minutes * 60 if minutes else None, 0, clock()
    with training_attention(model, device, options.seq_len):
        for batch in itertools.cycle(batches):
            done = (clock() - started) / budget if budget else steps / options.max_steps
            if on_step is not None:
                on_step(clock())
            if done >= 1 and steps:
                break
            for group in optimizer.param_groups:
                group["lr"] = options.learning_rate * lr_factor(options.lr_scheduler_type, done)
            peft_model.train()
            ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = peft_model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps += 1
    return peft_model.eval(), steps
