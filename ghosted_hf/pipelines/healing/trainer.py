"""The training step on transformers' `Trainer`: packed sequences in, next-token or chunked KL loss out, attention
chosen for the training length, and the FSDP / ZeRO-3 shards gathered at the end."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from typing import Any

import torch
from peft import PeftModel, get_peft_model
from torch import nn
from transformers import PreTrainedModel, Trainer
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from ...architectures import decoder_layers
from ...errors import GhostedError
from ...statistics.capture import last_layer_output
from ...statistics.patch import hidden_of
from ...utils.distributed import is_main_process
from .callbacks import Budget, lr_factor
from .distillation import Head, chunked_kd_loss, family_head, final_hidden_states, shifted_labels, unwrapped

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


def collate(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The packed int32 rows stacked as int64 ids, the labels a copy (the model shifts them)."""
    ids = torch.stack(rows).long()
    return {"input_ids": ids, "labels": ids.clone()}


class HealingTrainer(Trainer):
    """`Trainer` with the KL to a teacher as the training loss (held-out evaluation stays next-token perplexity),
    our learning-rate schedule (by steps or by time), and the perplexity logged beside every evaluation loss."""

    def __init__(self, *args: Any, teacher: nn.Module | None, kd_weight: float, kl_chunk: int, budget: Budget,
                 schedule: str, precision: str, plain_heads: tuple[bool, bool] = (True, True), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.teacher, self.kd_weight, self.kl_chunk, self.budget = teacher, kd_weight, kl_chunk, budget
        self.plain_heads = plain_heads  # (student, teacher): logits = output layer of the final norm's output
        self._sharded: bool | None = None
        self.schedule, self.precision = schedule, precision
        self._gathered_head: Head | None = None  # the student's output layer, gathered once under ZeRO-3
        # Every batch holds the same number of tokens: the mean loss per micro-batch, divided by the number of
        # micro-batches (and averaged over processes by DDP) is the mean over the whole step.
        self.model_accepts_loss_kwargs, self.loss_is_scaled_for_ga = False, False

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        if self.lr_scheduler is None:
            budget = self.budget
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer, lambda step: lr_factor(
                self.schedule, step / budget.steps if budget.seconds is None else budget.fraction))
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # bf16 autocast here, not through accelerate's mixed precision: that also converts every output to fp32,
        # a copy of the batch x sequence x vocabulary logits each step (benchmarks/results/healing_loop.md).
        with torch.autocast(self.args.device.type, dtype=torch.bfloat16, enabled=self.precision == "bf16"):
            ids, labels = inputs["input_ids"], shifted_labels(inputs["labels"])
            student, head, trained, outputs = self._states(model, ids, plain=self.plain_heads[0], student=True)
            target, teacher_head = None, None
            if self.teacher is not None and model.training:
                with torch.no_grad():
                    target, teacher_head, _, _ = self._states(self.teacher, ids, plain=self.plain_heads[1])
            loss = chunked_kd_loss(student, target, labels, head, teacher_head, chunk=self.kl_chunk,
                                   kd_weight=self.kd_weight if target is not None else 0.0, trained=trained)
        if model.training and not torch.isfinite(loss.detach()).all():
            raise GhostedError(
                f"Healing diverged at step {self.state.global_step + 1}: the training loss is {float(loss):g}. "
                "Nothing was saved. Lower --learning-rate (or check that the model and the teacher hold finite "
                "weights: ghosted inspect)."
            )
        return (loss, outputs) if return_outputs else loss

    def _states(self, model: nn.Module, ids: torch.Tensor, *, plain: bool, student: bool = False):
        """(hidden states, the head that makes them logits, the trained parameters that head uses, the forward's
        outputs), from one forward of `model` over `ids` that makes the logits of one position only. A plain head
        (logits = output layer of the final norm's output) reads the final norm's output; any other the last decoder
        layer's, through the family's own head."""
        ids = ids.to(next(model.parameters()).device)
        inner = unwrapped(model)
        if plain:
            with final_hidden_states(model) as captured:
                outputs = model(input_ids=ids, logits_to_keep=1)
            head = self._student_head(model) if student else inner.get_output_embeddings()
            return captured[-1], head, None, outputs
        if self._sharded is None:
            self._sharded = sharded(self)
        trained = [p for p in outside_layers(inner) if p.requires_grad] if student else []
        if trained and self._sharded and not self.is_fsdp_enabled:
            # ZeRO-3 partitions a parameter again before the backward pass unless its module's forward used it
            # there: the operator before the final norm (--train-operators) trains through the whole logits
            outputs = model(input_ids=ids)
            return outputs.logits, nn.Identity(), (), outputs
        with last_layer_output(inner) as last:
            outputs = model(input_ids=ids, logits_to_keep=1)
        # FSDP2 gathers the parameters outside the layers only in its root's forward: the head runs through it
        through = model if self._sharded and self.is_fsdp_enabled else inner
        return hidden_of(last["output"]), family_head(inner, last["output"], through=through), trained, outputs

    def _student_head(self, model: nn.Module) -> Head:
        """The student's output layer, called chunk by chunk outside the model's forward. Under ZeRO-3 its weight is
        a partition there: gathered once into a plain copy, which is exact because healing never trains the output
        layer."""
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


def outside_layers(model: PreTrainedModel) -> list[nn.Parameter]:
    """The parameters of `model` outside its decoder layers: the only ones a head after the last layer can use."""
    inside = {id(p) for p in decoder_layers(model).parameters()}
    return [p for p in model.parameters() if id(p) not in inside]


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


def unsharded(trainer: Trainer, peft_model: PeftModel, model_class: type[PreTrainedModel]) -> PeftModel | None:
    """Neither `merge` nor `save_pretrained` can use parameter shards, and gathering them is a collective: every
    process takes part, the main process rebuilds the PEFT model unsharded on its CPU from the full state dict (the
    others get None: only the main process writes)."""
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    if not is_main_process():
        return None
    # Under ZeRO-3 transformers builds every model partitioned (`deepspeed.zero.Init`), a collective the other
    # processes would not join: the copy is built without it, and the Trainer's setting restored after.
    unset_hf_deepspeed_config()
    try:
        with torch.device("meta"):
            config = peft_model.peft_config[peft_model.active_adapter]
            rebuilt = get_peft_model(model_class._from_config(peft_model.get_base_model().config), config)
    finally:
        deepspeed = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
        if deepspeed is not None:
            deepspeed.set_deepspeed_weakref()
    rebuilt.load_state_dict({name: tensor.cpu() for name, tensor in state.items()}, strict=True, assign=True)
    # Buffers are not sharded, and the non-persistent ones (rotary frequencies) are not in a state dict.
    trained = {name.replace("_fsdp_wrapped_module.", ""): b for name, b in peft_model.named_buffers()}
    for name, buffer in list(rebuilt.named_buffers()):
        if buffer.is_meta:
            owner, _, leaf = name.rpartition(".")
            rebuilt.get_submodule(owner).register_buffer(leaf, trained[name].detach().cpu(), persistent=False)
    rebuilt.get_base_model().tie_weights()
    return rebuilt.eval()
