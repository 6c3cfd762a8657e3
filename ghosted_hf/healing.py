"""LoRA healing of any model ghosted_hf pruned, on transformers' `Trainer` with PEFT (accelerate underneath): one
CPU, one GPU, or data-parallel under `torchrun` / `accelerate launch` (FSDP and DeepSpeed through accelerate's
config files), with gradient accumulation and checkpointing, resumable checkpoints, held-out evaluation and
tensorboard / wandb reports. A ghosted model heals into a ghosted model; a stock export (`folded`,
`replaceme-ls`, `none`) into a stock checkpoint of its architecture.

`Trainer` rather than TRL's trainers: the data is packed fixed-length token sequences and the loss next-token or
KL to a teacher; SFTTrainer's additions (chat templates, prompt/completion packing) do not apply, and TRL's
distillation trainers hold the full batch x sequence x vocabulary logits, which `distillation.chunked_kd_loss`
avoids. LoRA goes on every linear layer of every decoder layer: adapters only near the boundaries, or only
downstream of them, healed less at every budget measured (docs/removed-levers.md)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from .data import TrainingSequences, training_sequences
from .distillation import Head, chunked_kd_loss, final_hidden_states, head_is_plain, shifted_labels
from .distributed import check_agreement, is_main_process, timeout_s
from .architectures import lora_target_parameters, lora_targets
from .checkpoint import made_as
from .diskio import atomic_write_text, read_json_object
from .files import relation
from .hashing import file_sha256, tensor_sha256
from .errors import GhostedError, MissingDependencyError, MissingFileError
from .statistics.origin import config_sha256, model_fingerprint
from .provenance import Provenance
from .text import read_documents
from .options import Options, PruneOptions, option, positive, same_as
from .remote.modeling_ghosted import GHOST_MODULE, process_gone, process_tag, scratch_folder

logger = logging.getLogger(__name__)

SCHEDULES = ("constant", "linear")
PRECISIONS = ("auto", "fp32", "bf16")
REPORTERS = ("none", "tensorboard", "wandb")
CHECKPOINT_RECORD = "ghosted_checkpoint.json"  # written last: a checkpoint without it is incomplete
DEFAULT_STEPS = 150  # without steps, tokens or minutes
RUN_RECORD = "ghosted_run.json"  # which run (and process) a checkpoints folder belongs to


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


class Budget:
    """What a run may spend: `steps`, or `seconds` by `clock` (then `fraction` is the share spent). Rank 0's clock
    decides (broadcast every step), so that every process uses the same learning rate and stops at the same step."""

    def __init__(self, steps: int | None, seconds: float | None, clock: Callable[[], float]) -> None:
        self.steps, self.seconds, self.clock, self.spent = steps, seconds, clock, 0.0
        self.fraction, self._started = 0.0, clock()

    def restart(self) -> None:
        self._started = self.clock() - self.spent

    def measure(self, device: torch.device) -> None:
        """Update the fraction of a timed run done (a step run's fraction is its step count: see the scheduler)."""
        self.spent = self.clock() - self._started
        fraction = torch.tensor([self.spent / self.seconds], dtype=torch.float64, device=device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.broadcast(fraction, src=0)
        self.fraction = float(fraction)


class _Schedule(TrainerCallback):
    """Measures the budget after every optimizer step (before the scheduler reads it) and stops a timed run."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget

    def on_train_begin(self, args, state, control, **kwargs):
        self.budget.restart()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.budget.seconds is not None:
            self.budget.measure(args.device)

    def on_step_end(self, args, state, control, **kwargs):
        if self.budget.seconds is not None and self.budget.fraction >= 1:
            control.should_training_stop = True


class _Progress(TrainerCallback):
    """One bar (steps, or seconds of a timed run) with the loss and tokens/s, on the main process only."""

    def __init__(self, budget: Budget, tokens_per_step: int, enabled: bool) -> None:
        self.budget, self.tokens_per_step, self.enabled, self.bar = budget, tokens_per_step, enabled, None

    def on_train_begin(self, args, state, control, **kwargs):
        if self.enabled and state.is_world_process_zero:
            timed = self.budget.seconds is not None
            self.bar = tqdm(total=round(self.budget.seconds) if timed else self.budget.steps,
                            unit="s" if timed else "step", desc="Healing", initial=0 if timed else state.global_step)
            self._clock, self._first_step = time.perf_counter(), state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.bar is not None and logs and "loss" in logs:
            speed = (state.global_step - self._first_step) * self.tokens_per_step / (time.perf_counter() - self._clock)
            self.bar.set_postfix(loss=f"{logs['loss']:.4f}", tokens_per_s=f"{speed:.0f}")

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            done = round(self.budget.spent) if self.budget.seconds is not None else state.global_step
            self.bar.update(min(done, self.bar.total) - self.bar.n)

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()


class _Record(TrainerCallback):
    """Completes every checkpoint with a record of its files' sha256 (and the time spent, for timed runs), written
    last and atomically: a checkpoint without a valid record is one a kill interrupted, and is never resumed."""

    def __init__(self, budget: Budget, run: dict[str, Any]) -> None:
        self.budget, self.run = budget, run

    def on_save(self, args, state, control, **kwargs):
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()  # every process has written its RNG state
        if not state.is_world_process_zero:
            return
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        files = {p.relative_to(folder).as_posix(): file_sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()}
        atomic_write_text(folder / CHECKPOINT_RECORD, json.dumps({"step": state.global_step, "run": self.run,
                                                                 "seconds_spent": self.budget.spent, "files": files}))


# What may change when a run is resumed: how often it saves and evaluates, and where it reports.
RESUMABLE_CHANGES = ("save_every", "eval_every", "report_to")


def run_identity(options: HealOptions, sequences: TrainingSequences, processes: int,
                 model: nn.Module) -> dict[str, Any]:
    """What a resumed run must share with the run that wrote the checkpoint for the two to be one run: options,
    data, process count and the model healed (its config and weights)."""
    config = {k: v for k, v in model.config.to_dict().items() if k != "ghost_provenance"}  # (holds timings)
    return {"options": {k: v for k, v in options.to_dict().items() if k not in RESUMABLE_CHANGES},
            "data_sha256": sequences.text_sha256, "processes": processes, "model_config_sha256": config_sha256(config),
            "model_weights_sha256": json.dumps(model_fingerprint(model)["weights_sha256"], sort_keys=True)}


def agreement_claims(options: HealOptions, sequences: TrainingSequences, run: dict[str, Any],
                     teacher: nn.Module | None) -> dict[str, str]:
    """What every process of a data-parallel run must share (`distributed.check_agreement`): every option (the
    ones a resume may change too: each process saves and evaluates in the same steps), the token sequences each
    process draws its share from, the model healed and the teacher."""
    claims = {name: repr(value) for name, value in options.to_dict().items()}
    claims.update({"training data": tensor_sha256(sequences.train), "held-out data": tensor_sha256(sequences.held_out),
                   "model config": run["model_config_sha256"], "model weights": run["model_weights_sha256"]})
    if teacher is not None:
        claims["teacher"] = json.dumps(model_fingerprint(teacher), sort_keys=True)
    return claims


def check_same_run(record: dict[str, Any], run: dict[str, Any], folder: Path) -> None:
    """Refuse to resume a checkpoint with other options, data or process count than the run that wrote it."""
    def flat(identity: dict[str, Any]) -> dict[str, Any]:
        options = identity.get("options")
        return {**(options if isinstance(options, dict) else {"options": options}),
                **{k: v for k, v in identity.items() if k != "options"}}

    then, now = flat(record["run"]), flat(run)
    changed = sorted(k for k in then.keys() | now.keys() if then.get(k) != now.get(k))
    if changed:
        details = ", ".join(f"{k} {then.get(k)!r} then, {now.get(k)!r} now" for k in changed)
        raise GhostedError(f"Checkpoint {folder} was written by another run ({details}): resume with the options and "
                           "data of that run, or start a new one.")


def claim_checkpoint_folder(folder: Path, model: nn.Module, resuming: bool) -> None:
    """Make `folder` this run's: refuse one inside the healed model's own folder, one a running heal uses, and,
    unless resuming, one that holds checkpoints (rotation would delete another run's, or this run's would be mixed
    with them; a resumed run is checked against its checkpoint's record). Records this process in RUN_RECORD."""
    source = getattr(model.config, "_name_or_path", "") or ""
    if source and Path(source).is_dir() and relation(folder, source) in ("is", "lies inside"):
        raise GhostedError(f"The checkpoints folder {folder} lies inside the model folder {source}: checkpoints would "
                           "be written into the model; name a folder outside it.")
    folder.mkdir(parents=True, exist_ok=True)
    record_path = folder / RUN_RECORD
    if record_path.exists():
        owner = read_json_object(record_path, "the checkpoints folder's run record", {"process": str})["process"]
        if owner != process_tag() and not process_gone(owner):
            raise GhostedError(f"The checkpoints folder {folder} is in use by a running heal (process {owner}): "
                               "give each run its own folder.")
    if not resuming and any(folder.glob("checkpoint-*")):
        raise GhostedError(f"The checkpoints folder {folder} already holds checkpoints: continue that run with "
                           "--resume last (resume=\"last\"), or name an empty folder.")
    atomic_write_text(record_path, json.dumps({"process": process_tag()}))  # a resumed run checks its checkpoint's


def verified_checkpoint(folder: Path) -> dict[str, Any]:
    """The record of a complete checkpoint whose every file still has the recorded sha256."""
    path = folder / CHECKPOINT_RECORD
    if not folder.is_dir():
        raise MissingFileError(f"Checkpoint {folder} does not exist (or is not a folder): name a checkpoint-N folder "
                               "of the run, or resume='last'.")
    if not path.is_file():
        raise GhostedError(f"Checkpoint {folder} is incomplete (no {CHECKPOINT_RECORD}: the run was stopped while it "
                           "was written); resume from an earlier one.")
    record = read_json_object(path, "checkpoint record", {"step": int, "seconds_spent": (int, float), "run": dict,
                                                          "files": dict})
    for name, digest in record["files"].items():
        inside = not Path(name).is_absolute() and ".." not in Path(name).parts
        if not inside or not (folder / name).is_file() or file_sha256(folder / name) != digest:
            raise GhostedError(f"Checkpoint file {folder / name} is missing or not what the checkpoint recorded; "
                               "resume from another checkpoint.")
    return record


def resume_point(checkpoints: Path, resume: str | os.PathLike) -> Path:
    """`resume` as a checkpoint folder: "last" is the newest complete one under `checkpoints`."""
    if str(resume) != "last":
        return Path(resume)
    found = sorted((p for p in checkpoints.glob("checkpoint-*") if (p / CHECKPOINT_RECORD).is_file()),
                   key=lambda p: int(p.name.split("-")[-1]))
    if not found:
        raise MissingFileError(f"No complete checkpoint under {checkpoints} to resume from; start without resume.")
    return found[-1]


class _SequenceDataset(torch.utils.data.Dataset):
    def __init__(self, sequences: torch.Tensor) -> None:
        self.sequences = sequences

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.sequences[index]}


def _collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    ids = torch.stack([item["input_ids"] for item in items]).long()
    return {"input_ids": ids, "labels": ids.clone()}


class HealingTrainer(Trainer):
    """`Trainer` with the KL to a teacher as the training loss (held-out evaluation stays next-token perplexity),
    our learning-rate schedule (by steps or by time), and the perplexity logged beside every evaluation loss."""

    def __init__(self, *args: Any, teacher: nn.Module | None, kd_weight: float, kl_chunk: int, budget: Budget,
                 schedule: str, precision: str, plain_heads: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.teacher, self.kd_weight, self.kl_chunk, self.budget = teacher, kd_weight, kl_chunk, budget
        self.plain_heads = plain_heads  # the chunked KL from hidden states gives both models' logits
        self.schedule, self.precision = schedule, precision
        self._gathered_head: Head | None = None  # the student's output layer, gathered once under ZeRO-3
        # Every batch holds the same number of tokens: the mean loss per micro-batch, divided by the number of
        # micro-batches (and averaged over processes by DDP) is the mean over the whole step.
        self.model_accepts_loss_kwargs, self.loss_is_scaled_for_ga = False, False

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        if self.lr_scheduler is None:
            budget, schedule = self.budget, self.schedule

            def factor(step: int) -> float:
                return lr_factor(schedule, step / budget.steps if budget.seconds is None else budget.fraction)

            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer, factor)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # bf16 autocast here, not through accelerate's mixed precision: that also converts every output to fp32,
        # a copy of the batch x sequence x vocabulary logits each step (benchmarks/results/healing_loop.md).
        with torch.autocast(self.args.device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16"):
            if self.teacher is None or not model.training:
                result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            else:
                result = self._distillation_loss(model, inputs, return_outputs)
        loss = result[0] if return_outputs else result
        if model.training and not torch.isfinite(loss.detach()).all():
            raise GhostedError(
                f"Healing diverged at step {self.state.global_step + 1}: the training loss is {float(loss):g}. "
                "Nothing was saved. Lower --lr (or check that the model and the teacher hold finite weights: "
                "ghosted inspect)."
            )
        return result

    def _distillation_loss(self, model, inputs, return_outputs):
        ids = inputs["input_ids"]
        teacher_device = next(self.teacher.parameters()).device
        labels = shifted_labels(inputs["labels"])
        if not self.plain_heads:  # logits post-processed by the family's forward: KL of the forwards' own logits
            with torch.no_grad():
                target = self.teacher(input_ids=ids.to(teacher_device)).logits
            outputs = model(input_ids=ids)
            loss = chunked_kd_loss(outputs.logits, target, labels, nn.Identity(), nn.Identity(),
                                   kd_weight=self.kd_weight, chunk=self.kl_chunk)
            return (loss, outputs) if return_outputs else loss
        with torch.no_grad():
            teacher_hidden = self.teacher.get_decoder()(input_ids=ids.to(teacher_device)).last_hidden_state
        with final_hidden_states(model) as captured:
            outputs = model(input_ids=ids, logits_to_keep=1)  # the logits come chunk by chunk below
        loss = chunked_kd_loss(captured[-1], teacher_hidden, labels, self._student_head(model),
                               self.teacher.get_output_embeddings(), kd_weight=self.kd_weight, chunk=self.kl_chunk)
        return (loss, outputs) if return_outputs else loss

    def _student_head(self, model: nn.Module) -> Head:
        """The student's output layer, called chunk by chunk outside the model's forward. Under ZeRO-3 its weight is
        a partition there (and again when the backward pass recomputes a chunk): gathered once into a plain copy,
        which is exact because healing never trains the output layer."""
        head = self.accelerator.unwrap_model(model).get_output_embeddings()
        if not hasattr(head.weight, "ds_id"):
            return head
        if self._gathered_head is None:
            import deepspeed

            with deepspeed.zero.GatheredParameters([head.weight]):
                self._gathered_head = functools.partial(nn.functional.linear, weight=head.weight.detach().clone())
        return self._gathered_head

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        if "eval_loss" in logs:
            logs["eval_perplexity"] = math.exp(min(logs["eval_loss"], 80.0))
        super().log(logs, *args, **kwargs)


class HealResult(NamedTuple):
    """What `heal` returns: the PEFT model, the loss of every step, the held-out evaluations (step, loss,
    perplexity) and the record `merge` saves in the provenance (what was trained, on what, for how long)."""

    model: PeftModel | None  # None on the processes other than the main one after FSDP / ZeRO-3 (`_unsharded`)
    losses: list[float]
    record: dict[str, Any]
    evaluations: list[dict[str, float]]


@contextlib.contextmanager
def _checkpoint_folder(checkpoints: str | os.PathLike | None) -> Iterator[Path]:
    """The Trainer's output folder: the user's checkpoints folder, or a scratch folder in the temp folder (removed
    afterwards; one that a killed run left is removed by the next run)."""
    if checkpoints is not None:
        yield Path(checkpoints)
        return
    scratch = scratch_folder(Path(tempfile.gettempdir()), "ghosted-heal-")
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _lora(model: PreTrainedModel, options: HealOptions) -> PeftModel:
    torch.manual_seed(options.seed)
    config = LoraConfig(r=options.rank, lora_alpha=options.alpha, lora_dropout=0.0, target_modules=lora_targets(model),
                        target_parameters=lora_target_parameters(model) or None,
                        modules_to_save=[GHOST_MODULE] if options.train_operators else None, task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def _arguments(options: HealOptions, output_dir: str) -> TrainingArguments:
    report = [] if options.report_to == "none" else [options.report_to]
    if report and importlib.util.find_spec(options.report_to) is None:
        raise MissingDependencyError(f"report_to {options.report_to} needs the {options.report_to} package: pip install "
                                     f"{options.report_to}.")
    return TrainingArguments(
        output_dir=output_dir, max_steps=options.steps or DEFAULT_STEPS, per_device_train_batch_size=options.batch_size,
        per_device_eval_batch_size=options.batch_size, gradient_accumulation_steps=options.gradient_accumulation,
        learning_rate=options.lr, weight_decay=0.01, max_grad_norm=0.0,  # as measured: AdamW, no clipping
        activation_checkpointing=options.gradient_checkpointing, activation_checkpointing_kwargs={"use_reentrant": False},
        logging_steps=1, report_to=report,
        eval_strategy="steps" if options.eval_every else "no", eval_steps=options.eval_every,
        prediction_loss_only=True, label_names=["labels"],
        save_strategy="steps" if options.save_every else "no", save_steps=options.save_every or 1, save_total_limit=2, seed=options.seed, data_seed=options.seed, remove_unused_columns=False,
        disable_tqdm=True, ddp_timeout=int(timeout_s()), use_cpu=not torch.cuda.is_available(),
    )


def heal(
    model: PreTrainedModel,
    tokenizer: Any,
    data: Any,
    options: HealOptions | None = None,
    *,
    teacher: nn.Module | None = None,
    eval_data: Any = None,
    checkpoints: str | os.PathLike | None = None,
    resume: str | os.PathLike | None = None,
    callbacks: Sequence[TrainerCallback] = (),
    progress: bool = True,
    clock: Callable[[], float] = time.perf_counter,
    **overrides: Any,
) -> HealResult:
    """Train LoRA adapters (and, with `train_operators`, the ghost operators) on `data` (anything `text.read_documents`
    reads) for `steps` steps, `tokens` tokens or `minutes` by `clock` (seconds). With a `teacher` the loss is
    KL(teacher || student) (mixed with the next-token loss by `kd_weight`), otherwise next-token cross-entropy.
    `eval_data`: held-out text (else carved off `data`). `checkpoints`: the folder of resumable checkpoints (with
    `save_every`); `resume`: "last" or a checkpoint folder. `callbacks`: more `transformers.TrainerCallback`s.
    Under FSDP or DeepSpeed ZeRO-3 `model` is consumed (sharded in place); the result's model is the healed model
    gathered on the main process, None on the others."""
    options = HealOptions.build(options, **overrides)
    kd_weight = 1.0 if options.kd_weight is None else options.kd_weight
    kind, model_class = healed_kind(model), type(model)  # FSDP2 swaps the class of the modules it shards
    if options.train_operators and kind == "stock":
        raise GhostedError("train_operators needs a ghosted model: a stock checkpoint has its operators folded into "
                           "its weights, and LoRA already trains those.")
    check_meaningful(options, model, teacher, data, eval_data)
    plain_heads = True
    if teacher is not None:
        check_same_vocabulary(model, teacher)
        plain_heads = head_is_plain(model) and head_is_plain(teacher)
    if (options.save_every or resume is not None or options.report_to != "none") and checkpoints is None:
        raise GhostedError("save_every, resume and report_to need the checkpoints folder (the run's checkpoints, and "
                           "its logs under runs/).")
    with _checkpoint_folder(checkpoints) as output_dir:
        # Building the arguments joins the launcher's process group: the world size is known from here on.
        args = _arguments(options, str(output_dir))
        device = args.device
        precision = resolve_precision(options.precision, device)
        per_step = options.batch_size * options.gradient_accumulation * args.world_size
        steps = (math.ceil(options.tokens / (per_step * options.seq_len)) if options.tokens
                 else options.steps or DEFAULT_STEPS)
        args.max_steps = 10**9 if options.minutes else steps  # a timed run is stopped by `_Schedule`
        sequences = _training_data(tokenizer, data, eval_data, options, per_step, steps * per_step)
        budget = Budget(None if options.minutes else steps, options.minutes * 60 if options.minutes else None, clock)
        run = run_identity(options, sequences, args.world_size, model)
        check_agreement(agreement_claims(options, sequences, run, teacher))  # before any collective of training
        if checkpoints is not None and is_main_process():
            claim_checkpoint_folder(Path(output_dir), model, resuming=resume is not None)
        start = None if resume is None else resume_point(Path(output_dir), resume)
        if start is not None:
            record = verified_checkpoint(start)
            check_same_run(record, run, start)
            budget.spent = record["seconds_spent"]
        peft_model = _lora(model, options)
        trainer = HealingTrainer(
            model=peft_model, args=args, train_dataset=_SequenceDataset(sequences.train), data_collator=_collate,
            eval_dataset=_SequenceDataset(sequences.held_out) if len(sequences.held_out) else None,
            callbacks=[_Schedule(budget), _Record(budget, run), _Progress(budget, per_step * options.seq_len, progress),
                       *callbacks],
            teacher=teacher, kd_weight=kd_weight, kl_chunk=options.kl_chunk, budget=budget,
            schedule=options.schedule, precision=precision, plain_heads=plain_heads)
        gather = sharded(trainer)
        fsdp_asked = os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
        if fsdp_asked and not trainer.is_fsdp_enabled and is_main_process():
            logger.warning("The accelerate config asks for FSDP, which accelerate applies on GPUs (and other "
                           "accelerators) only: these %d CPU processes train data-parallel, each holding the whole "
                           "model.", args.world_size)
        for replaced in (ProgressCallback, PrinterCallback):  # `_Progress` replaces them (and knows timed runs)
            trainer.remove_callback(replaced)
        with training_attention(model, device, options.seq_len):
            trainer.train(resume_from_checkpoint=None if start is None else str(start))
            evaluated_last = trainer.state.log_history[-2:-1] and "eval_loss" in trainer.state.log_history[-2]
            if len(sequences.held_out) and not evaluated_last:  # the last step may have evaluated already
                trainer.evaluate()
    # accelerate wrapped the forward in bf16 autocast for training: the model returned computes as given again
    trainer.accelerator.unwrap_model(peft_model, keep_fp32_wrapper=False).eval()
    if gather:
        peft_model = _unsharded(trainer, peft_model, model_class)
    history = trainer.state.log_history
    losses = [entry["loss"] for entry in history if "loss" in entry]
    evaluations = [{"step": e["step"], "loss": e["eval_loss"], "perplexity": e["eval_perplexity"]}
                   for e in history if "eval_loss" in e]
    logger.info("Healing loss %.4f -> %.4f over %d steps.", losses[0], losses[-1], len(losses))
    distillation = ("kd_weight", "kl_chunk")  # recorded only where they applied
    record = {**{k: v for k, v in options.to_dict().items() if teacher is not None or k not in distillation},
              "precision": precision, "kd_weight": kd_weight if teacher is not None else None,
              "loss": ("KL to the teacher's logits" if teacher is not None else "next-token cross-entropy")
              + (f", {1 - kd_weight:g} x next-token" if teacher is not None and kd_weight < 1 else ""),
              "teacher": getattr(getattr(teacher, "config", None), "_name_or_path", None) if teacher is not None else None,
              "steps": trainer.state.global_step, "tokens": trainer.state.global_step * per_step * options.seq_len,
              "processes": args.world_size, "data": sequences.describe()}
    if evaluations:
        record["held_out_perplexity"] = evaluations[-1]["perplexity"]
    return HealResult(peft_model, losses, record, evaluations)


def sharded(trainer: Trainer) -> bool:
    """Whether each process holds only a shard of the parameters: FSDP, or DeepSpeed ZeRO stage 3 (refused, before
    any training, when the config keeps its shards from being gathered at the end)."""
    deepspeed = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    if deepspeed is None or deepspeed.zero_stage != 3:
        return trainer.is_fsdp_enabled
    if not deepspeed.deepspeed_config.get("zero_optimization", {}).get("stage3_gather_16bit_weights_on_model_save"):
        raise GhostedError("Healing under DeepSpeed ZeRO-3 gathers the trained weights at the end: set "
                           "`zero3_save_16bit_model: true` in the accelerate config (in a DeepSpeed config file, "
                           "`stage3_gather_16bit_weights_on_model_save: true`).")
    return True


@contextlib.contextmanager
def _without_zero3_construction() -> Iterator[None]:
    """While a ZeRO-3 config is active transformers builds every model partitioned (`deepspeed.zero.Init`), a
    collective the other processes would not join: the main process builds its unsharded copy without it."""
    from transformers.integrations import deepspeed as hf_deepspeed

    active = hf_deepspeed._hf_deepspeed_config_weak_ref  # restored afterwards, as the Trainer left it
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = active


def _unsharded(trainer: Trainer, peft_model: PeftModel, model_class: type[PreTrainedModel]) -> PeftModel | None:
    """Neither `merge` nor `save_pretrained` can use parameter shards, and gathering them is a collective: every
    process takes part, the main process rebuilds the PEFT model unsharded on its CPU from the full state dict (the
    others get None: only the main process writes)."""
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    if not is_main_process():
        return None
    with torch.device("meta"), _without_zero3_construction():
        config = peft_model.peft_config[peft_model.active_adapter]
        rebuilt = get_peft_model(model_class._from_config(peft_model.get_base_model().config), config)
    rebuilt.load_state_dict({name: tensor.cpu() for name, tensor in state.items()}, strict=True, assign=True)
    # Buffers are not sharded, and the non-persistent ones (rotary frequencies) are not in a state dict.
    trained = {name.replace("_fsdp_wrapped_module.", ""): b for name, b in peft_model.named_buffers()}
    for name, buffer in list(rebuilt.named_buffers()):
        if buffer.is_meta:
            owner, _, leaf = name.rpartition(".")
            rebuilt.get_submodule(owner).register_buffer(leaf, trained[name].detach().cpu(), persistent=False)
    rebuilt.get_base_model().tie_weights()
    return rebuilt.eval()


def _training_data(tokenizer: Any, data: Any, eval_data: Any, options: HealOptions, per_step: int,
                   needed: int) -> TrainingSequences:
    """The packed training and held-out sequences, refused when there is less than one step of training text or
    no held-out text was left to evaluate on. The training set is cut to whole steps of `per_step` sequences:
    every step then has as many tokens, however the sequences are split over processes."""
    corpus = read_documents(data, split=options.split, text_column=options.text_column, streaming=options.streaming,
                            what="Training data")
    held_out = None if eval_data is None else read_documents(eval_data, text_column=options.text_column,
                                                          what="Evaluation data")
    # A streamed corpus is read only as far as the step budget needs (a timed run cycles over that).
    sequences = training_sequences(tokenizer, corpus, options.seq_len, held_out=options.eval_sequences,
                                   held_out_corpus=held_out, max_sequences=needed if options.streaming else None,
                                   seed=options.seed)
    if not sequences.documents:
        raise GhostedError(f"The training data ({sequences.name}) holds no text.")
    if len(sequences.train) < per_step:
        raise GhostedError(f"The training data ({sequences.name}) gives {len(sequences.train)} sequences of "
                           f"{options.seq_len} tokens (after {len(sequences.held_out)} held out), fewer than one step "
                           f"needs ({per_step}): give more text, or lower seq_len / batch_size.")
    if options.eval_sequences and not len(sequences.held_out):
        raise GhostedError(f"No held-out sequence of {options.seq_len} tokens could be made from "
                           f"{'the evaluation data' if eval_data is not None else sequences.name}: give more text, or "
                           "eval_sequences=0 to train without held-out evaluation.")
    sequences.train = sequences.train[:len(sequences.train) // per_step * per_step]
    return sequences


def merge(healed: HealResult) -> PreTrainedModel:
    """Fold the adapters (and trained operators) into the weights: a model of the class healed (a ghosted model
    stays ghosted, a stock checkpoint stock), its provenance extended by the healing record."""
    peft_model = healed.model
    if peft_model is None:
        raise GhostedError("This process holds no healed model: under FSDP and ZeRO-3 it is gathered on the main "
                           "process (rank 0), which merges and saves it.")
    lora = peft_model.peft_config[peft_model.active_adapter]
    original = type(peft_model.get_base_model())
    merged = peft_model.merge_and_unload()
    if type(merged) is not original:
        raise GhostedError(f"Expected the merged model to be a {original.__name__}, got {type(merged).__name__}.")
    Provenance.of(merged.config).with_changes(healing={
        "method": "LoRA (merged)", "r": lora.r, "lora_alpha": lora.lora_alpha, "target_modules": str(lora.target_modules),
        "target_parameters": sorted(lora.target_parameters or ()),
        "trained_operators": GHOST_MODULE in (lora.modules_to_save or ()), **healed.record}).save_to(merged.config)
    return merged
