"""`ghosted demo`."""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from .. import assets
from ..io.files import check_output
from ..options import PruneOptions, from_namespace, option
from .common import OutputArgs

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class DemoArgs(OutputArgs):
    """Arguments of `ghosted demo` besides the `PruneOptions`."""

    model: str | None = option(None, "A packaged model (" + ", ".join(assets.PACKAGED_MODELS) + "), folder or Hub id "
                               "instead of the packaged default.")
    output: str | None = option(None, "New folder to save the ghosted model to (None: "
                                      "ghosted-demo-output/<model>-ghosted).")
    eval_windows: int = option(16, "Held-out 512-token windows for perplexity.")

    # Flags of the shared options whose default here is another (with what it means): the packaged model's own demo
    # removal, as the README states it, unless --num-layers is given.
    cli_defaults = {"num_layers": (None, "None: the packaged model's own ({}), else {}.".format(
        ", ".join(f"{name} {model.demo_layers}" for name, model in assets.PACKAGED_MODELS.items()),
        PruneOptions.num_layers))}


def cmd_demo(args: argparse.Namespace) -> int:
    """`ghosted demo`: the main job on the packaged model and corpus."""
    from ..pipelines.demo import demo_output, format_rows, run_demo

    run = from_namespace(DemoArgs, args)
    if args.num_layers is None:
        args.num_layers = assets.demo_layers(run.model) or PruneOptions.num_layers
    options = from_namespace(PruneOptions, args)
    own = run.output is None  # the demo's own default folder: a second run replaces what the first saved there
    run.output = run.output or demo_output(run.model)
    check_output(run.output, (run.model,), overwrite=run.overwrite or own)
    if own and Path(run.output).exists():
        logger.warning("Replacing the previous demo output in %s.", Path(run.output).resolve())
    rows = run_demo(run.output, options, model=run.model, eval_windows=run.eval_windows)
    config = json.loads((Path(run.output) / "config.json").read_text())
    print("\n" + format_rows(rows, config["removed_layers"], f"{run.eval_windows} windows of 512 tokens"))
    print(f"\nSaved the ghosted model to {Path(run.output).resolve()} "
          f"(load it with AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)).")
    return 0
