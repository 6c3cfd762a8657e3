"""`heal` and `merge`: the recipe that puts the options, data, trainer, callbacks and checkpoints together."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn
from transformers import PreTrainedModel, TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from ...architectures import lora_target_parameters, lora_targets
from ...errors import GhostedError
from ...model.loading import DTYPES, load_model, resolve
from ...model.provenance import Provenance
from ...remote.format_ghosted import GHOST_MODULE
from ...statistics.capture import LOGITS_BYTES
from ...text.documents import read_documents
from ...text.tokens import TrainingSequences, training_sequences
from ...utils.distributed import check_agreement, is_main_process
from ...utils.memory import check_batch_memory
from .callbacks import Budget, Progress, Record, Schedule
from .checkpoints import (agreement_claims, check_same_run, checkpoint_folder, claim_checkpoint_folder, resume_point,
                          run_identity, verified_checkpoint)
from .distillation import head_is_plain, unwrapped
from .local import distill_locally
from .options import (DEFAULT_STEPS, HealOptions, base_model_reference, check_meaningful, check_same_vocabulary,
                      healed_kind, resolve_precision)
from .trainer import HealingTrainer, collate, sharded, training_attention, unsharded

logger = logging.getLogger(__name__)


class HealResult(NamedTuple):
    """What `heal` returns; `record` is what `merge` saves in the provenance (what was trained, on what, how long)."""

    model: PeftModel | None  # None on the processes other than the main one after FSDP / ZeRO-3 (`unsharded`)
    losses: list[float]
    record: dict[str, Any]
    evaluations: list[dict[str, float]]


def _lora(model: PreTrainedModel, options: HealOptions) -> PeftModel:
    torch.manual_seed(options.seed)
    config = LoraConfig(r=options.rank, lora_alpha=options.alpha, lora_dropout=0.0, target_modules=lora_targets(model),
                        target_parameters=lora_target_parameters(model) or None,
                        modules_to_save=[GHOST_MODULE] if options.train_operators else None, task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def load_teacher(model: PreTrainedModel, teacher: str, *, dtype: str | None = None,
                 trust_remote_code: bool = False) -> PreTrainedModel:
    """The dense model to distill `model` from: "base" (the model it was pruned from, as its provenance records it)
    or a folder / Hub id; in `dtype` (None: the student's), on the GPU the student trains on when there is one."""
    reference = base_model_reference(model) if teacher == "base" else teacher
    resolve(reference, "teacher")  # noted as read: 'base' may be the very folder the command writes
    names = {value: name for name, value in DTYPES.items()}
    loaded, _ = load_model(reference, dtype=dtype or names.get(model.dtype, "float32"),
                           trust_remote_code=trust_remote_code)
    if torch.cuda.is_available():
        loaded.to(f"cuda:{torch.cuda.current_device()}")
    return loaded


def heal(
    model: PreTrainedModel,
    tokenizer: Any,
    data: Any,
    options: HealOptions | None = None,
    *,
    teacher: nn.Module | str | None = None,
    eval_data: Any = None,
    checkpoints: str | os.PathLike | None = None,
    resume: str | os.PathLike | None = None,
    callbacks: Sequence[TrainerCallback] = (),
    progress: bool = True,
    clock: Callable[[], float] = time.perf_counter,
    **overrides: Any,
) -> HealResult:
    """Train LoRA adapters (and, with `train_operators`, the ghost operators) on `data` (anything `text.read_documents`
    reads) for `max_steps` steps, `tokens` tokens or `minutes` by `clock` (seconds). With a `teacher` the loss is
    KL(teacher || student) (mixed with the next-token loss by `kd_weight`), otherwise next-token cross-entropy;
    `teacher` is a model, or "base" / a folder / a Hub id (`load_teacher`).
    `eval_data`: held-out text (else carved off `data`). `checkpoints` (or the options' `output_dir`): the folder of
    resumable checkpoints (with `save_steps`); `resume`: "last" or a checkpoint folder. `callbacks`: more
    `transformers.TrainerCallback`s.
    Under FSDP or DeepSpeed ZeRO-3 `model` is consumed (sharded in place); the result's model is the healed model
    gathered on the main process, None on the others."""
    options = HealOptions.build(options, **overrides)
    kd_weight = 1.0 if options.kd_weight is None else options.kd_weight
    kind, model_class = healed_kind(model), type(model)  # FSDP2 swaps the class of the modules it shards
    for asked, name in ((options.train_operators, "train_operators"), (options.local_layers, "local_layers")):
        if asked and kind == "stock":
            raise GhostedError(f"{name} needs a ghosted model: a stock checkpoint has its operators folded into its "
                               "weights (and records no boundaries); heal it without it.")
    if resume is not None and options.local_layers:
        raise GhostedError("A run with local_layers cannot be resumed: the operators its local phase trained are not "
                           "in the Trainer's checkpoints. Resume with local_layers=0 from a run without it, or start "
                           "again.")
    if options.local_layers and options.world_size > 1:  # (the options joined the launcher's group: it is known)
        raise GhostedError(f"Local distillation runs in one process, and this run has {options.world_size}: heal in "
                           "one process, or with local_layers=0.")
    if isinstance(teacher, str):
        teacher = load_teacher(model, teacher)
    check_meaningful(options, model, teacher, data, eval_data)
    check_batch_memory(options.per_device_train_batch_size, options.seq_len, model.config, "per_device_train_batch_size")
    if teacher is not None:
        check_same_vocabulary(model, teacher)
    plain_heads = head_is_plain(model), teacher is None or head_is_plain(teacher)
    if checkpoints is not None and options.output_dir is not None and str(checkpoints) != options.output_dir:
        raise GhostedError(f"Two folders for the run's checkpoints: checkpoints={str(checkpoints)!r} and the options' "
                           f"output_dir={options.output_dir!r}; give one.")
    checkpoints = options.output_dir if checkpoints is None else checkpoints
    if (options.writes_files() or resume is not None) and checkpoints is None:
        raise GhostedError("save_steps, resume and report_to need the checkpoints folder (the run's checkpoints, and "
                           "its logs under runs/): checkpoints= or the options' output_dir.")
    with checkpoint_folder(checkpoints) as output_dir:
        # The options joined the launcher's process group: the world size is known.
        args = options.trainer_arguments(str(output_dir))
        device, precision = args.device, resolve_precision(options.precision, args.device)
        per_step = options.per_device_train_batch_size * options.gradient_accumulation_steps * args.world_size
        steps = (math.ceil(options.tokens / (per_step * options.seq_len)) if options.tokens
                 else options.max_steps if options.max_steps > 0 else DEFAULT_STEPS)
        args.max_steps = 10**9 if options.minutes else steps  # a timed run is stopped by `Schedule`
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
        local_losses = _local_phase(peft_model, teacher, sequences, options, precision, progress)
        trainer = HealingTrainer(
            model=peft_model, args=args, train_dataset=sequences.train, data_collator=collate,
            eval_dataset=sequences.held_out if len(sequences.held_out) else None,
            callbacks=[Schedule(budget), Record(budget, run), Progress(budget, per_step * options.seq_len, progress),
                       *callbacks],
            teacher=teacher, kd_weight=kd_weight, budget=budget,
            kl_chunk=options.kl_chunk or max(1, LOGITS_BYTES // (4 * model.get_output_embeddings().weight.shape[0])),
            schedule=options.lr_scheduler_type, precision=precision, plain_heads=plain_heads)
        gather = sharded(trainer)
        fsdp_asked = os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
        if fsdp_asked and not trainer.is_fsdp_enabled and is_main_process():
            logger.warning("The accelerate config asks for FSDP, which accelerate applies on GPUs (and other "
                           "accelerators) only: these %d CPU processes train data-parallel, each holding the whole "
                           "model.", args.world_size)
        for replaced in (ProgressCallback, PrinterCallback):  # `Progress` replaces them (and knows timed runs)
            trainer.remove_callback(replaced)
        with training_attention(model, device, options.seq_len):
            trainer.train(resume_from_checkpoint=None if start is None else str(start))
            evaluated_last = trainer.state.log_history[-2:-1] and "eval_loss" in trainer.state.log_history[-2]
            if len(sequences.held_out) and not evaluated_last:  # the last step may have evaluated already
                trainer.evaluate()
    # accelerate wrapped the forward in bf16 autocast for training: the model returned computes as given again
    trainer.accelerator.unwrap_model(peft_model, keep_fp32_wrapper=False).eval()
    if gather:
        peft_model = unsharded(trainer, peft_model, model_class)
    history = trainer.state.log_history
    losses = [entry["loss"] for entry in history if "loss" in entry]
    evaluations = [{"step": e["step"], "loss": e["eval_loss"], "perplexity": e["eval_perplexity"]}
                   for e in history if "eval_loss" in e]
    logger.info("Healing loss %.4f -> %.4f over %d steps.", losses[0], losses[-1], len(losses))
    distillation = ("kd_weight",)  # recorded only where it applied
    record = {**{k: v for k, v in options.to_dict().items() if teacher is not None or k not in distillation},
              "precision": precision, "kd_weight": kd_weight if teacher is not None else None,
              "loss": ("KL to the teacher's logits" if teacher is not None else "next-token cross-entropy")
              + (f", {1 - kd_weight:g} x next-token" if teacher is not None and kd_weight < 1 else ""),
              "teacher": getattr(getattr(teacher, "config", None), "_name_or_path", None) if teacher is not None else None,
              "steps": trainer.state.global_step, "tokens": trainer.state.global_step * per_step * options.seq_len,
              "processes": args.world_size, "data": sequences.describe(),
              **({"local_loss": [local_losses[0], local_losses[-1]]} if local_losses else {})}
    if evaluations:
        record["held_out_perplexity"] = evaluations[-1]["perplexity"]
    return HealResult(peft_model, losses, record, evaluations)


def _local_phase(model: PeftModel, teacher: nn.Module | None, sequences: TrainingSequences, options: HealOptions,
                 precision: str, progress: bool) -> list[float]:
    """Local distillation before the Trainer's phase (`local.distill_locally`), from the teacher or else the base
    model, loaded for this phase only."""
    if not options.local_layers:
        return []
    student = unwrapped(model)
    dense = teacher if teacher is not None else load_teacher(student, "base")
    with training_attention(student, student.device, options.seq_len):
        return distill_locally(model, dense, sequences.train, options, precision, progress)


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
