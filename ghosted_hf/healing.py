"""Optional LoRA healing of a ghosted model with PEFT: language-modeling loss or distillation from the
dense teacher's logits, then `merge_and_unload` back into a `GhostedForCausalLM`.

LoRA goes on every linear layer of every decoder layer: adapters only near the boundaries, or only
downstream of them, healed less at every budget measured (docs/removed-levers.md)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn
from tqdm.auto import tqdm

from .data import TextSource, tokenize_texts
from .errors import GhostedError
from .options import Options, positive, option
from .remote.modeling_ghosted import GHOST_MODULE, GhostedForCausalLM

logger = logging.getLogger(__name__)

SCHEDULES = ("constant", "linear")
PRECISIONS = ("auto", "fp32", "bf16")
LINEAR = r"(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"


@dataclass
class HealOptions(Options):
    """How `heal` trains: LoRA on every linear layer, next-token loss (or KL to a teacher), a linear decay."""

    train_operators: bool = option(False, "Also train the ghost operators (saved merged into the model).")
    rank: int = option(8, "LoRA rank.")
    alpha: int = option(16, "LoRA alpha.")
    steps: int = option(150, "Optimizer steps (150 x 4 x 256 tokens: 10-13 CPU-minutes for a 135M model on one core "
                             "with AVX512-BF16, 4-5 s a step, all-linear, without a teacher).")
    lr: float = option(2e-3, "AdamW learning rate (peak).")
    minutes: float | None = option(None, "Train for this many minutes (wall-clock) instead of `steps` steps, the "
                                   "schedule decaying over the time (at least one step is taken).")
    schedule: str = option("linear", "Learning rate over the run: constant, or decayed linearly to zero by the end "
                           "(the last step, or the end of `minutes`).", SCHEDULES)
    precision: str = option("auto", "Matrix products under bf16 autocast (adapters and optimizer state stay fp32), "
                            "or in fp32; auto: bf16 where the device computes it natively (CUDA with bf16, a CPU with "
                            "AVX512-BF16 or AMX), else fp32.", PRECISIONS)
    seq_len: int = option(256, "Training sequence length in tokens.")
    batch_size: int = option(4, "Sequences per step.")
    seed: int = option(0, "Random seed of the adapters' initialisation and of the order of the training sequences.")

    def check(self) -> None:
        positive(self, "rank", "alpha", "steps", "seq_len", "batch_size")
        if self.minutes is not None and not self.minutes > 0:
            raise GhostedError(f"minutes must be positive (or left out to train for `steps` steps), got {self.minutes}.")
        if not self.lr > 0:
            raise GhostedError(f"lr must be positive, got {self.lr}.")


def check_ghosted(model: Any) -> None:
    """Refuse a model that is not a ghosted one (healing a dense model is fine-tuning)."""
    if getattr(getattr(model, "config", None), "model_type", None) != "ghosted":
        raise GhostedError(f"heal expects a ghosted model (GhostedForCausalLM), got {type(model).__name__}; prune it "
                           "with ghosted_hf.ghost_prune first.")


def check_same_vocabulary(student: nn.Module, teacher: nn.Module) -> None:
    """Distillation compares logits token by token: the teacher must have the student's vocabulary."""
    sizes = [m.get_input_embeddings().weight.shape[0] for m in (student, teacher)]
    if sizes[0] != sizes[1]:
        raise GhostedError(f"The teacher has a vocabulary of {sizes[1]} tokens and the model {sizes[0]}: distillation "
                           "needs the dense model the student was pruned from (or one with the same tokenizer).")


def base_model_reference(model: GhostedForCausalLM) -> str:
    """Where the dense model that `model` was pruned from lives (the natural distillation teacher): the folder
    recorded at pruning time if it still exists here, else its Hub id."""
    check_ghosted(model)
    provenance = getattr(model.config, "ghost_provenance", None) or {}
    path, hub_id = provenance.get("base_model_path"), provenance.get("base_model")
    if path and Path(path).is_dir():
        return path
    if hub_id:
        return hub_id
    raise GhostedError(f"The model records no reachable base model (path {path!r}, Hub id {hub_id!r}) to distill "
                       "from; pass the dense model's folder or Hub id as the teacher, or train with the "
                       "language-modelling loss (teacher 'none').")


TARGET_MODULES = rf"model\.layers\.\d+\.{LINEAR}"  # every linear layer of every decoder layer


def native_bf16(device: torch.device) -> bool:
    """Whether `device` multiplies bf16 matrices natively (on CPUs without it, bf16 is emulated and slower)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return any(getattr(torch.cpu, probe, lambda: False)()
                   for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return False


def resolve_precision(precision: str, device: torch.device) -> str:
    """"auto" resolved for `device`: bf16 where it is native, else fp32."""
    return ("bf16" if native_bf16(device) else "fp32") if precision == "auto" else precision


def lr_factor(schedule: str, done: float) -> float:
    """Learning rate as a fraction of the peak, after the fraction `done` of the run (steps or time). A linear decay
    to zero anneals a short run into a lower loss than a constant rate does."""
    return max(1.0 - done, 0.0) if schedule == "linear" else 1.0


EAGER_MAX_LEN = 256  # the training length measured faster with eager attention (benchmarks/healing_step.py)


@contextlib.contextmanager
def training_attention(model: nn.Module, device: torch.device, seq_len: int) -> Iterator[None]:
    """Plain (eager) attention while training on a CPU at short lengths, the model's own kernel again afterwards:
    there PyTorch's fused CPU attention is the slower one, its backward most (benchmarks/healing_step.py), and the
    result is the same softmax attention. Longer sequences keep the fused kernel: eager attention stores an
    L x L matrix per head for the backward pass."""
    original = model.config._attn_implementation
    switch = device.type == "cpu" and seq_len <= EAGER_MAX_LEN and original != "eager"
    if switch:
        model.set_attn_implementation("eager")
    try:
        yield
    finally:
        if switch:
            model.set_attn_implementation(original)


def training_loss(student: nn.Module, teacher: nn.Module | None, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, or with a teacher KL(teacher || student) over the real tokens."""
    if teacher is None:
        return student(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
    with torch.no_grad():
        target = teacher(input_ids=ids, attention_mask=mask).logits.float().log_softmax(-1)
    predicted = student(input_ids=ids, attention_mask=mask).logits.float().log_softmax(-1)
    return (target.exp() * (target - predicted)).sum(-1)[mask.bool()].mean()


class HealResult(NamedTuple):
    """What `heal` returns: the PEFT model, the loss of every step, and the record `merge` saves in the
    provenance (what was trained, on what, for how long)."""

    model: PeftModel
    losses: list[float]
    record: dict[str, Any]


def heal(
    model: GhostedForCausalLM,
    tokenizer: Any,
    data: TextSource,
    options: HealOptions | None = None,
    *,
    teacher: nn.Module | None = None,
    progress: bool = True,
    after_step: Callable[[PeftModel, list[float]], bool] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    **overrides: Any,
) -> HealResult:
    """Train LoRA adapters (and, with `train_operators`, the ghost operators, saved with the adapter) for `steps`
    steps, or for `minutes` by `clock` (seconds). With a `teacher` the loss is KL(teacher || student) on real
    tokens, otherwise next-token cross-entropy. Options are `HealOptions` fields. `after_step(model, losses)` runs
    after every step (e.g. to evaluate at time budgets); returning True stops training there."""
    options = HealOptions.build(options, **overrides)
    check_ghosted(model)
    if teacher is not None:
        check_same_vocabulary(model, teacher)
    torch.manual_seed(options.seed)
    batches = tokenize_texts(tokenizer, data, options.seq_len, batch_size=options.batch_size,
                             shuffle_seed=options.seed).batches
    config = LoraConfig(r=options.rank, lora_alpha=options.alpha, lora_dropout=0.0, target_modules=TARGET_MODULES,
                        modules_to_save=[GHOST_MODULE] if options.train_operators else None, task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    # No weight decay on vectors (the usual convention); 0.01 is AdamW's default.
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in trainable if p.ndim > 1], "weight_decay": 0.01},
              {"params": [p for p in trainable if p.ndim <= 1], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=options.lr)
    device = next(peft_model.parameters()).device
    precision = resolve_precision(options.precision, device)
    budget = options.minutes * 60 if options.minutes is not None else None
    losses, tokens, started = [], 0, clock()
    bar = tqdm(total=round(budget) if budget else options.steps, unit="s" if budget else "step", desc="Healing",
               disable=not progress)
    with training_attention(model, device, options.seq_len), bar:
        for batch in itertools.cycle(batches):
            done = (clock() - started) / budget if budget else len(losses) / options.steps
            if done >= 1 and losses:  # at least one step, however short the budget
                break
            for group in optimizer.param_groups:
                group["lr"] = options.lr * lr_factor(options.schedule, done)
            peft_model.train()  # again every step: after_step may have evaluated
            ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
            tokens += int(mask.sum())
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = training_loss(peft_model, teacher, ids, mask)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            bar.update(min(round(clock() - started), bar.total) - bar.n if budget else 1)
            if after_step is not None and after_step(peft_model, losses):
                break
    peft_model.eval()
    logger.info("Healing loss %.4f -> %.4f over %d steps.", losses[0], losses[-1], len(losses))
    record = {"loss": "KL to the teacher's logits" if teacher is not None else "next-token cross-entropy",
              "teacher": getattr(getattr(teacher, "config", None), "_name_or_path", None) if teacher is not None else None,
              "steps": len(losses), "tokens": tokens,
              **{k: v for k, v in options.to_dict().items() if k != "steps"}, "precision": precision}
    return HealResult(peft_model, losses, record)


def merge(healed: HealResult) -> GhostedForCausalLM:
    """Fold the adapters (and trained operators) into the weights: a `GhostedForCausalLM` again, its provenance
    extended by the healing record."""
    peft_model = healed.model
    lora = peft_model.peft_config[peft_model.active_adapter]
    merged = peft_model.merge_and_unload()
    if not isinstance(merged, GhostedForCausalLM):
        raise GhostedError(f"Expected the merged model to be a GhostedForCausalLM, got {type(merged).__name__}.")
    merged.config.ghost_provenance = {**merged.config.ghost_provenance, "healing": {
        "method": "LoRA (merged)", "r": lora.r, "lora_alpha": lora.lora_alpha, "target_modules": str(lora.target_modules),
        "trained_operators": GHOST_MODULE in (lora.modules_to_save or ()), **healed.record}}
    return merged
