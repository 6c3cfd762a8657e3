"""`ghosted prune`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..errors import GhostedError
from ..io.files import check_output
from ..model.loading import load_for_calibration
from ..options import PruneOptions, from_namespace, option
from .common import (CALIBRATION_HELP, MODEL_HELP, LoadArgs, MemoryArgs, OutputArgs, calibration_text,
                     check_same_outputs)


@dataclass(kw_only=True)
class PruneArgs(LoadArgs, MemoryArgs, OutputArgs):
    """Arguments of `ghosted prune` besides the `PruneOptions`."""

    model: str | None = option(None, MODEL_HELP, positional=True)
    calibration: str | None = option(None, CALIBRATION_HELP)
    output: str | None = option(None, "New folder to write the pruned model to (needed unless --dry-run).")
    dry_run: bool = option(False, "Select the layers and fit the operators (the calibration passes run), print the "
                                  "result, write nothing.")
    device: str | None = option(None, "device_map for loading (e.g. cpu, cuda, auto).")
    statistics: str | None = option(None, "Precomputed statistics (safetensors) to reuse.")


def cmd_prune(args: argparse.Namespace) -> int:
    """`ghosted prune`: prune, print the summary, save with a card (rank 0 only under torchrun)."""
    from ..io.card import save_with_card
    from ..io.summary import render_text, summarize
    from ..model.loading import load_config
    from ..pipelines.prune import check_request, ghost_prune
    from ..utils.distributed import is_main_process

    run, options = from_namespace(PruneArgs, args), from_namespace(PruneOptions, args)
    if not run.dry_run:
        if run.output is None:
            raise GhostedError("--output DIR is required (or --dry-run to write nothing).")
        check_output(run.output, (run.model, run.calibration, run.statistics), overwrite=run.overwrite)
    check_same_outputs(output=run.output, overwrite=run.overwrite, dry_run=run.dry_run)
    calibration = calibration_text(run.calibration, options, statistics=run.statistics)
    config = load_config(run.model, trust_remote_code=run.trust_remote_code, revision=run.revision)
    check_request(config, options)
    model, tokenizer = load_for_calibration(  # only once everything the config can tell was checked
        run.model, dtype=run.dtype, device=run.device, max_memory=run.max_memory, layerwise=run.layerwise,
        activations_dir=run.activations_dir, trust_remote_code=run.trust_remote_code, revision=run.revision,
        config=config)
    pruned = ghost_prune(model, tokenizer, calibration, options, statistics=run.statistics)
    if not is_main_process():
        return 0  # every process fitted the same operators; the main one reports and writes
    print(render_text(summarize(pruned.config)))
    if run.dry_run:
        print("\n--dry-run: nothing written.")
        return 0
    save_with_card(pruned, run.output, tokenizer)  # a stock checkpoint (folded kinds) saves with its card too
    print(f"\nSaved to {run.output}")
    return 0
