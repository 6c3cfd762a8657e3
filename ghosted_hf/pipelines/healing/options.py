"""What `heal` is asked (`HealOptions`: transformers' `TrainingArguments` extended, shared by the Python API and the
CLI) and the rules that refuse a request that cannot mean anything: the model must be one ghosted_hf pruned, the
teacher must share its vocabulary, the precision must be one the device runs."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel, TrainingArguments
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

from ...errors import GhostedError, MissingDependencyError
from ...model.checkpoint import made_as
from ...model.provenance import Provenance
from ...options import Options, PruneOptions, option, option_fields, positive, same_as
from ...text.tokens import check_positions
from ...utils.distributed import init_distributed, rendezvous, timeout_s
from ...utils.inputs import relation

SCHEDULES = ("constant", "linear")
PRECISIONS = ("auto", "fp32", "bf16")
REPORTERS = ("none", "tensorboard", "wandb")
DEFAULT_STEPS = 150  # without max_steps, tokens or minutes


@dataclass
class HealOptions(Options, TrainingArguments):
    """How `heal` trains: transformers' `TrainingArguments` (every field applies, as in TRL's configs) with
    healing's defaults (LoRA on every linear layer, AdamW at 2e-3 decaying linearly, 150 steps of 4 x 256 tokens),
    and what healing adds: the adapters, a budget in tokens or minutes, a teacher's loss, the data's columns. The
    flags of `ghosted heal` are the fields declared here."""

    # Trainer settings declared again for healing's defaults (and flags)
    max_steps: int = option(-1, "Optimizer steps (-1: 150 unless tokens or minutes is given; 150 x 4 x 256 tokens: "
                                "10-13 CPU-minutes for a 135M model on one core with AVX512-BF16, 4-5 s a step, "
                                "all-linear, without a teacher).", renamed_from="steps")
    learning_rate: float = option(2e-3, "AdamW learning rate (peak).", renamed_from="lr")
    lr_scheduler_type: str = option("linear", "Learning rate over the run: constant, or decayed linearly to zero by "
                                    "the end (the last step, or the end of `minutes`).", SCHEDULES,
                                    renamed_from="schedule")
    per_device_train_batch_size: int = option(4, "Sequences per step and process (per micro-batch with "
                                                 "gradient accumulation).", renamed_from="batch_size")
    gradient_accumulation_steps: int = option(1, "Micro-batches per optimizer step.",
                                              renamed_from="gradient_accumulation")
    activation_checkpointing: bool = option(False, "Recompute activations in the backward pass: less memory, about a "
                                                   "third more compute.", renamed_from="gradient_checkpointing")
    weight_decay: float = option(0.01, "AdamW weight decay.")
    max_grad_norm: float = option(0.0, "Gradient-norm clipping (0: none, as measured).")
    eval_steps: int | None = option(None, "Also evaluate held-out perplexity every N steps (it is always evaluated "
                                          "at the end when there is held-out text).", renamed_from="eval_every")
    save_steps: int | None = option(None, "Save a resumable checkpoint every N steps (the last two are kept).",
                                    renamed_from="save_every")
    report_to: str = option("none", "Where to log losses and evaluations.", REPORTERS)
    seed: int = option(0, "Random seed of the adapters' initialisation and of the order of the training sequences.")
    # Trainer settings healing sets (not flags): the run's folder comes from `heal`'s `checkpoints`
    output_dir: str | None = field(default=None, metadata={"help": "Folder of the run's checkpoints and logs."})
    per_device_eval_batch_size: int = 4
    logging_steps: float = 1
    save_total_limit: int | None = 2
    disable_tqdm: bool | None = True  # `Progress` shows the run (and knows timed runs)
    remove_unused_columns: bool = False
    prediction_loss_only: bool = True
    ddp_timeout: int = field(default_factory=lambda: int(timeout_s()))
    # What healing adds
    train_operators: bool = option(False, "Also train the ghost operators (saved merged into the model; ghosted "
                                          "models only).")
    rank: int = option(8, "LoRA rank.")
    alpha: int = option(16, "LoRA alpha.")
    tokens: int | None = option(None, "Train on this many tokens instead of max_steps steps (rounded up to whole "
                                      "steps of batch x accumulation x processes x seq_len tokens).")
    minutes: float | None = option(None, "Train for this many minutes (wall-clock) instead of max_steps steps, the "
                                   "schedule decaying over the time (at least one step is taken).")
    precision: str = option("auto", "Matrix products under bf16 autocast (adapters and optimizer state stay fp32), "
                            "or in fp32; auto: bf16 where the device computes it natively (CUDA with bf16, a CPU with "
                            "AVX512-BF16 or AMX), else fp32.", PRECISIONS)
    seq_len: int = option(256, "Training sequence length in tokens (documents are packed, joined by EOS).")
    kd_weight: float | None = option(None, "With a teacher: the weight of KL(teacher || student); the rest, "
                                           "1 - kd_weight, goes to the next-token loss (None: 1).")
    kl_chunk: int | None = option(None, "Token positions per chunk of the loss's logits, the KL's and the next-token "
                                        "loss's (memory: chunk x vocabulary; None: as many as 256 MiB of float32 "
                                        "logits hold).")
    local_layers: int = option(0, "Local distillation before the global phase: the N decoder layers after each "
                                  "boundary or replaced sub-block, with its operator or map, trained to give the dense "
                                  "model's hidden states N layers on, from dense states computed once (no head, no "
                                  "vocabulary; ghosted models; the teacher, else the base model; 0: no local phase).")
    local_steps: int = option(150, "Optimizer steps of local distillation (with local_layers; max_steps, tokens and "
                                   "minutes budget the global phase after it).")
    local_sequences: int = option(256, "Training sequences whose dense states local distillation computes and cycles "
                                       "over (memory: sequences x seq_len x hidden size x 2 bytes per state).")
    eval_sequences: int = option(16, "Held-out sequences: carved off the start of the data as whole documents when no "
                                     "evaluation data is given (0: no held-out evaluation).")
    text_column: str = same_as(PruneOptions, "text_column")
    split: str | None = same_as(PruneOptions, "split")
    streaming: bool = same_as(PruneOptions, "streaming")

    def __post_init__(self) -> None:
        self.report_to = _one_reporter(self.report_to)  # a list where `TrainingArguments` left it (`build`)
        Options.__post_init__(self)
        # Derived, so that options rebuilt with other values stay consistent
        self.eval_strategy = "steps" if self.eval_steps else "no"
        self.save_strategy = "steps" if self.save_steps else "no"
        self.data_seed, self.label_names = self.seed, ["labels"]
        self.activation_checkpointing_kwargs = self.activation_checkpointing_kwargs or {"use_reentrant": False}
        self.use_cpu = self.use_cpu or not torch.cuda.is_available()
        output_dir = self.output_dir
        if not torch.cuda.is_available():  # CPU processes join here (accelerate would wait 30 minutes, not ours)
            init_distributed()
        # `TrainingArguments` sets the device up (a launched process joins its group) and, under ZeRO-3, makes every
        # model loaded from then on partitioned: that is left to the Trainer's own arguments (`trainer_arguments`).
        with rendezvous():
            zero3_before = is_deepspeed_zero3_enabled()
            TrainingArguments.__post_init__(self)
        if not zero3_before:
            unset_hf_deepspeed_config()
        self.output_dir = output_dir  # None stays None: `heal` makes the run's folder

    def trainer_arguments(self, output_dir: str) -> TrainingArguments:
        """The Trainer's settings as plain `TrainingArguments` writing to `output_dir` (a checkpoint's
        training_args.bin then unpickles without ghosted_hf)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(TrainingArguments) if f.init}
        return TrainingArguments(**{**values, "output_dir": output_dir})

    def check(self) -> None:
        positive(self, "rank", "alpha", "seq_len", "per_device_train_batch_size", "gradient_accumulation_steps",
                 "local_steps", "local_sequences",
                 *(("kl_chunk",) if self.kl_chunk is not None else ()))
        budgets = [name for name, given in (("max_steps", self.max_steps != -1), ("tokens", self.tokens is not None),
                                            ("minutes", self.minutes is not None)) if given]
        if len(budgets) > 1:
            raise GhostedError(f"Give one budget: max_steps, tokens or minutes, not {' and '.join(budgets)}.")
        if self.max_steps < 1 and self.max_steps != -1:
            raise GhostedError(f"max_steps must be positive (or -1: 150 unless tokens or minutes), got "
                               f"{self.max_steps}.")
        if self.seq_len < 2:
            raise GhostedError(f"seq_len must be at least 2 (a token and the next to predict), got {self.seq_len}.")
        if not 0 <= self.seed < 2**32:
            raise GhostedError(f"seed must be between 0 and 2^32 - 1, got {self.seed}.")
        for name in ("tokens", "eval_steps", "save_steps"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise GhostedError(f"{name} must be positive (or left out), got {getattr(self, name)}.")
        if self.minutes is not None and not math.isfinite(self.minutes * 60):
            raise GhostedError(f"minutes must be a finite number, got {self.minutes}.")
        if self.minutes is not None and not self.minutes > 0:
            raise GhostedError(f"minutes must be positive (or left out to train for max_steps steps), got "
                               f"{self.minutes}.")
        if not self.learning_rate > 0:
            raise GhostedError(f"learning_rate must be positive, got {self.learning_rate}.")
        if self.kd_weight is not None and not 0 <= self.kd_weight <= 1:
            raise GhostedError(f"kd_weight must be between 0 and 1, got {self.kd_weight}.")
        if self.local_layers < 0:
            raise GhostedError(f"local_layers must be 0 (no local phase) or more, got {self.local_layers}.")
        if self.eval_sequences < 0:
            raise GhostedError(f"eval_sequences must be 0 or more, got {self.eval_sequences}.")
        if self.eval_steps and not self.eval_sequences:
            raise GhostedError("eval_steps needs held-out text: eval_sequences must be positive.")
        if self.bf16 or self.fp16:
            raise GhostedError("heal computes in bf16 with precision='bf16' (or 'auto'), under its own autocast: leave "
                               "bf16 and fp16 off (accelerate's mixed precision copies the logits to fp32 each step).")
        if self.warmup_steps:
            raise GhostedError(f"heal's learning rate follows lr_scheduler_type from the first step (no warmup): "
                               f"leave warmup_steps at 0, got {self.warmup_steps}.")
        if self.report_to != "none" and importlib.util.find_spec(self.report_to) is None:
            raise MissingDependencyError(f"report_to {self.report_to} needs the {self.report_to} package: pip install "
                                         f"{self.report_to}.")

    def to_dict(self) -> dict[str, Any]:
        """What was asked, as plain values: every healing option, and the Trainer settings that differ from
        healing's defaults (recorded in the provenance, and what a resumed run must share)."""
        values, defaults = TrainingArguments.to_dict(self), _default_values()
        declared = {f.name for f in option_fields(self)}
        values["report_to"] = _one_reporter(values["report_to"])
        return {name: value for name, value in values.items()
                if name in declared or (value != defaults.get(name) and name not in NOT_ASKED)}

    def writes_files(self) -> bool:
        """Whether the run writes into its folder (checkpoints, or logs for a reporter)."""
        return bool(self.save_steps or self.report_to)


# Set by `heal` or derived from other options: where this run writes, how long it waits for peers, the strategies
# that follow eval_steps and save_steps, the data order that follows the seed.
NOT_ASKED = ("output_dir", "ddp_timeout", "eval_strategy", "save_strategy", "data_seed")


def _one_reporter(report_to: str | list[str]) -> str | list[str]:
    """The option's form of `TrainingArguments`' list of reporters: "none", one name, or (from Python) several."""
    if not isinstance(report_to, list):
        return report_to
    return report_to[0] if len(report_to) == 1 else report_to or "none"


@functools.cache
def _default_values() -> dict[str, Any]:
    """`TrainingArguments.to_dict` of healing's defaults, read by every record."""
    return TrainingArguments.to_dict(HealOptions())


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
    config = model.config.get_text_config()  # the language decoder's
    hidden = getattr(config, "hidden_size", None)
    if isinstance(hidden, int) and options.rank > hidden:
        raise GhostedError(f"rank {options.rank} is above the model's hidden size {hidden}: a LoRA update of that rank "
                           "adds nothing over a full one; use a rank of at most a few dozen.")
    check_positions(config, options.seq_len)
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


def resolve_precision(precision: str, device: torch.device) -> str:
    """"auto" resolved for `device`: bf16 where it multiplies bf16 matrices natively, else fp32 (on CPUs without
    AVX512-BF16 or AMX, bf16 is emulated and slower)."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp32"
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported") if device.type == "cpu" else ()
    return "bf16" if any(getattr(torch.cpu, probe, lambda: False)() for probe in probes) else "fp32"
