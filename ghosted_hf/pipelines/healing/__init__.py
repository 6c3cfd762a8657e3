"""LoRA healing of any model ghosted_hf pruned, on transformers' `Trainer` with PEFT (accelerate underneath): a
ghosted model heals into a ghosted model, a stock export into a stock checkpoint of its architecture.

`Trainer` rather than TRL's trainers: the data is packed fixed-length token sequences and the loss next-token or
KL to a teacher; SFTTrainer's additions (chat templates, prompt/completion packing) do not apply, and TRL's
distillation trainers hold the full batch x sequence x vocabulary logits, which `distillation.chunked_kd_loss`
avoids. `HealOptions` follows TRL's seam: it extends `TrainingArguments`, so every Trainer setting applies. LoRA
goes on every linear layer of every decoder layer: adapters only near the boundaries, or only downstream of them,
healed less at every budget measured (docs/removed-levers.md)."""

from .callbacks import lr_factor
from .checkpoints import CHECKPOINT_RECORD, RUN_RECORD, check_same_run, resume_point, verified_checkpoint
from .options import DEFAULT_STEPS, HealOptions, base_model_reference, healed_kind, resolve_precision
from .recipe import HealResult, heal, load_teacher, merge
from .trainer import EAGER_MAX_LEN, sharded, training_attention

__all__ = ["CHECKPOINT_RECORD", "DEFAULT_STEPS", "EAGER_MAX_LEN", "RUN_RECORD", "HealOptions", "HealResult",
           "base_model_reference", "check_same_run", "heal", "healed_kind", "load_teacher", "lr_factor", "merge",
           "resolve_precision", "resume_point", "sharded", "training_attention", "verified_checkpoint"]
