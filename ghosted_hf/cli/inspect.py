"""`ghosted inspect`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..io.summary import inspect_folder
from ..options import from_namespace, option


@dataclass(kw_only=True)
class InspectArgs:
    """Arguments of `ghosted inspect`."""

    folder: str = option(help="Saved ghosted model folder, or a stock checkpoint ghosted_hf made.")
    top: int = option(8, "Selection scores to show.")


def cmd_inspect(args: argparse.Namespace) -> int:
    """`ghosted inspect`: what a saved folder ghosted_hf made contains and how it was made."""
    run = from_namespace(InspectArgs, args)
    print(inspect_folder(run.folder, top_scores=run.top))
    return 0
