"""`ghosted heal`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from .. import assets
from ..errors import GhostedError
from ..io.files import check_creatable, check_output, staged_folder
from ..model.loading import DTYPES
from ..options import from_namespace, option
from ..utils.inputs import relation
from .common import TEXT_HELP, LoadArgs, OutputArgs, check_same_outputs


@dataclass(kw_only=True)
class HealArgs(LoadArgs, OutputArgs):
    """Arguments of `ghosted heal` besides the `HealOptions`."""

    folder: str = option(help="A model ghosted_hf pruned (a ghosted model or a stock export): folder or Hub id.")
    output: str | None = option(None, "New folder to save the healed model (or adapter) to.", required=True)
    data: str | None = option(None, f"Training text: {TEXT_HELP} (None: the packaged calibration articles).")
    eval_data: str | None = option(None, "Held-out text, read like --data (None: carved off --data).")
    teacher: str = option("none", "'none': language-modelling loss on the text; or a dense model to distill from (KL to "
                                  "its logits): a folder or Hub id, or 'base': the model it was pruned from (recorded "
                                  "in its config).")
    teacher_dtype: str | None = option(None, "Dtype to load the teacher in (None: --dtype), e.g. bfloat16 for a teacher "
                                             "twice the student's size.", tuple(DTYPES))
    checkpoints: str | None = option(None, "Folder of the run's checkpoints (--save-every) and logs (--report-to) "
                                           "(None: OUTPUT.checkpoints).")
    resume: str | None = option(None, "Resume from 'last' (the newest complete checkpoint in --checkpoints) or a "
                                      "checkpoint folder; the other options must be those of the first run.")
    adapter_only: bool = option(False, "Save only the PEFT adapter.")


def cmd_heal(args: argparse.Namespace) -> int:
    """`ghosted heal`: LoRA-heal a pruned model and save it merged (or the adapter alone); rank 0 writes."""
    from ..io.card import save_with_card
    from ..pipelines.healing import HealOptions, heal, load_teacher, merge
    from ..utils.distributed import is_main_process

    run, options = from_namespace(HealArgs, args), from_namespace(HealOptions, args)
    check_output(run.output, (run.folder, run.data, run.eval_data, run.teacher, run.checkpoints, run.resume),
                 overwrite=run.overwrite)
    check_same_outputs(output=run.output, overwrite=run.overwrite, adapter_only=run.adapter_only)
    needs_folder = options.writes_files() or run.resume
    checkpoints = run.checkpoints or (f"{run.output.rstrip('/')}.checkpoints" if needs_folder else None)
    if checkpoints is not None:
        check_creatable(Path(checkpoints), "--checkpoints")
    for folder, what in ((run.output, "the output folder"), (run.folder, "the model folder")):
        if checkpoints is not None and relation(checkpoints, folder) in ("is", "lies inside"):
            raise GhostedError(f"--checkpoints {checkpoints} {relation(checkpoints, folder)} {what} {folder}: "
                               "checkpoints would be written into a model; name a folder outside it.")
    model, tokenizer = run.load(run.folder)
    teacher = None if run.teacher == "none" else load_teacher(
        model, run.teacher, dtype=run.teacher_dtype or run.dtype, trust_remote_code=run.trust_remote_code)
    healed = heal(model, tokenizer, run.data or assets.wikipedia_split("calibration"), options, teacher=teacher,
                  eval_data=run.eval_data, checkpoints=checkpoints, resume=run.resume)
    if not is_main_process():
        return 0
    losses, window = healed.losses, min(5, len(healed.losses) // 2)
    steps = f"{window} step{'s' * (window > 1)}"
    trained = (f"loss: first {steps} {sum(losses[:window]) / window:.4f}, last {steps} "
               f"{sum(losses[-window:]) / window:.4f}" if window else f"loss {losses[-1]:.4f} after 1 step")
    print(trained + (f"; held-out perplexity {healed.record['held_out_perplexity']:.3f}"
                     if "held_out_perplexity" in healed.record else ""))
    if run.adapter_only:
        with staged_folder(run.output) as staging:
            healed.model.save_pretrained(staging)
        print(f"Saved the adapter to {run.output} (load with PeftModel.from_pretrained(base, path)).")
    else:
        save_with_card(merge(healed), run.output, tokenizer)
        print(f"Saved the merged model to {run.output}.")
    return 0
