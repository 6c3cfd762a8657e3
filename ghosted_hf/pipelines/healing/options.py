"""What `heal` is asked (`HealOptions`, shared by the Python API and the CLI) and the rules that refuse a request that
cannot mean anything: the model must be one ghosted_hf pruned, the teacher must share its vocabulary, the precision
must be one the device runs."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from ...errors import GhostedError
from ...io.files import relation
from ...model.checkpoint import made_as
from ...model.provenance import Provenance
from ...options import Options, PruneOptions, option, positive, same_as

SCHEDULES = ("constant", "linear")


PRECISIONS = ("auto", "fp32", "bf16")


REPORTERS = ("none", "tensorboard", "wandb")


DEFAULT_STEPS = 150  # without steps, tokens or minutes


@dataclass
class HealOptions(Options):
    """How `heal` trains: LoRA on every linear layer, next-token loss (or KL to a teacher), a linear decay."""

    train_operators: bool = option(False, "Also train the ghost operators (saved merged into the model; ghosted "
                                          "models only).")
    rank: int = option(8, "LoRA rank.")
    alpha: int = option(16, "LoRA alpha.")
    steps: int | None = option(None, "Optimizer steps (None: 150 unless tokens or minutes is given; 150 x 4 x 256 "
                                     "tokens: 10-13 CPU-minutes for a 135M model on one core with AVX512-BF16, 4-5 s a "
                                     "step, all-linear, without a teacher).")
    tokens: int | None = option(None, "Train on this many tokens instead of `steps` steps (rounded up to whole steps "
                                      "of batch_size x gradient_accumulation x processes x seq_len tokens).")
    minutes: float | None = option(None, "Train for this many minutes (wall-clock) instead of `steps` steps, the "
                                   "schedule decaying over the time (at least one step is taken).")
    lr: float = option(2e-3, "AdamW learning rate (peak).")
    schedule: str = option("linear", "Learning rate over the run: constant, or decayed linearly to zero by the end "
                           "(the last step, or the end of `minutes`).", SCHEDULES)
    precision: str = option("auto", "Matrix products under bf16 autocast (adapters and optimizer state stay fp32), "
                            "or in fp32; auto: bf16 where the device computes it natively (CUDA with bf16, a CPU with "
                            "AVX512-BF16 or AMX), else fp32.", PRECISIONS)
    seq_len: int = option(256, "Training sequence length in tokens (documents are packed, joined by EOS).")
    batch_size: int = option(4, "Sequences per step and process (per micro-batch with gradient_accumulation).")
    gradient_accumulation: int = option(1, "Micro-batches per optimizer step.")
    gradient_checkpointing: bool = option(False, "Recompute activations in the backward pass: less memory, about a "
                                                 "third more compute.")
    kd_weight: float | None = option(None, "With a teacher: the weight of KL(teacher || student); the rest, "
                                           "1 - kd_weight, goes to the next-token loss (None: 1).")
    kl_chunk: int = option(1024, "With a teacher: token positions per chunk of the KL (memory: chunk x vocabulary).")
    eval_every: int | None = option(None, "Also evaluate held-out perplexity every N steps (it is always evaluated at "
                                          "the end when there is held-out text).")
    eval_sequences: int = option(16, "Held-out sequences: carved off the start of the data as whole documents when no "
                                     "evaluation data is given (0: no held-out evaluation).")
    save_every: int | None = option(None, "Save a resumable checkpoint every N steps (the last two are kept).")
    report_to: str = option("none", "Where to log losses and evaluations.", REPORTERS)
    text_column: str = same_as(PruneOptions, "text_column")
    split: str | None = same_as(PruneOptions, "split")
    streaming: bool = same_as(PruneOptions, "streaming")
    seed: int = option(0, "Random seed of the adapters' initialisation and of the order of the training sequences.")

    def check(self) -> None:
        positive(self, "rank", "alpha", "seq_len", "batch_size", "gradient_accumulation", "kl_chunk")
        budgets = [name for name in ("steps", "tokens", "minutes") if getattr(self, name) is not None]
        if len(budgets) > 1:
            raise GhostedError(f"Give one budget: steps, tokens or minutes, not {' and '.join(budgets)}.")
        if self.seq_len < 2:
            raise GhostedError(f"seq_len must be at least 2 (a token and the next to predict), got {self.seq_len}.")
        if not 0 <= self.seed < 2**32:
            raise GhostedError(f"seed must be between 0 and 2^32 - 1, got {self.seed}.")
        if self.minutes is not None and not math.isfinite(self.minutes * 60):
            raise GhostedError(f"minutes must be a finite number, got {self.minutes}.")
        if not math.isfinite(self.lr):
            raise GhostedError(f"lr must be a finite number, got {self.lr}.")
        for name in ("steps", "tokens", "eval_every", "save_every"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise GhostedError(f"{name} must be positive (or left out), got {getattr(self, name)}.")
        if self.minutes is not None and not self.minutes > 0:
            raise GhostedError(f"minutes must be positive (or left out to train for `steps` steps), got {self.minutes}.")
        if not self.lr > 0:
            raise GhostedError(f"lr must be positive, got {self.lr}.")
        if self.kd_weight is not None and not 0 <= self.kd_weight <= 1:
            raise GhostedError(f"kd_weight must be between 0 and 1, got {self.kd_weight}.")
        if self.eval_sequences < 0:
            raise GhostedError(f"eval_sequences must be 0 or more, got {self.eval_sequences}.")
        if self.eval_every and not self.eval_sequences:
            raise GhostedError("eval_every needs held-out text: eval_sequences must be positive.")


def healed_kind(model: Any) -> str:
    """"ghosted" or "stock" (a stock checkpoint ghosted_hf exported); a model that was never pruned is refused:
    healing it would be fine-tuning."""
    kind = made_as(getattr(model, "config", None))
    if kind is not None:
        return kind
    raise GhostedError(f"heal expects a model pruned by ghosted_hf, and this {type(model).__name__} records no pruning "
                       "(no ghost_provenance in its config): healing a dense model is fine-tuning. Prune it first "
                       "(ghosted prune / ghost_prune).")


def check_meaningful(options: HealOptions, model: nn.Module, teacher: nn.Module | None, data: Any,
                     eval_data: Any) -> None:
    """Refuse options that would mean nothing for this model and data (before any text is read): adapters wider
    than the stream, positions the model has none for, a distillation weight without a teacher, a held-out set that
    is the training set."""
    config = getattr(model.config, "text_config", None) or model.config
    hidden, positions = getattr(config, "hidden_size", None), getattr(config, "max_position_embeddings", None)
    if isinstance(hidden, int) and options.rank > hidden:
        raise GhostedError(f"rank {options.rank} is above the model's hidden size {hidden}: a LoRA update of that rank "
                           "adds nothing over a full one; use a rank of at most a few dozen.")
    if isinstance(positions, int) and options.seq_len > positions:
        raise GhostedError(f"seq_len {options.seq_len} is beyond the model's {positions} positions "
                           "(max_position_embeddings); use at most that.")
    if teacher is None and options.kd_weight is not None:
        raise GhostedError("kd_weight weighs the distillation loss: pass a teacher (--teacher base or a folder), or "
                           "leave kd_weight out.")
    if isinstance(data, (str, os.PathLike)) and isinstance(eval_data, (str, os.PathLike)) and (
            str(data) == str(eval_data) or (Path(data).exists() and relation(data, eval_data) == "is")):
        raise GhostedError(f"The evaluation data is the training data ({data}): held-out perplexity on text the run "
                           "trains on says nothing; leave eval_data out (whole documents are then held out of the "
                           "data) or give other text.")


def check_same_vocabulary(student: nn.Module, teacher: nn.Module) -> None:
    """Distillation compares logits token by token: the teacher must have the student's vocabulary."""
    sizes = [m.get_input_embeddings().weight.shape[0] for m in (student, teacher)]
    if sizes[0] != sizes[1]:
        raise GhostedError(f"The teacher has a vocabulary of {sizes[1]} tokens and the model {sizes[0]}: distillation "
                           "needs the dense model the student was pruned from (or one with the same tokenizer).")


def base_model_reference(model: PreTrainedModel) -> str:
    """Where the dense model that `model` was pruned from lives (the natural distillation teacher): the folder
    recorded at pruning time if it still exists here, else its Hub id."""
    healed_kind(model)
    provenance = Provenance.of(model.config)
    path, hub_id = provenance.base_model_path, provenance.base_model
    if path and Path(path).is_dir():
        return path
    if hub_id:
        return hub_id
    raise GhostedError(f"The model records no reachable base model (path {path!r}, Hub id {hub_id!r}) to distill "
                       "from; pass the dense model's folder or Hub id as the teacher, or train with the "
                       "language-modelling loss (teacher 'none').")


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
