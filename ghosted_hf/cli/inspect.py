"""`ghosted inspect`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint import made_as
from ..errors import GhostedError
from ..files import verify_folder
from ..options import from_namespace, option


@dataclass(kw_only=True)
class InspectArgs:
    """Arguments of `ghosted inspect`."""

    folder: str = option(help="Saved ghosted model folder, or a stock checkpoint ghosted_hf made.")
    top: int = option(8, "Selection scores to show.")


def cmd_inspect(args: argparse.Namespace) -> int:
    """`ghosted inspect`: what a saved ghosted folder (or stock checkpoint ghosted_hf made) contains and how it
    was made."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from ..remote.configuration_ghosted import GhostedConfig
    from ..summary import render_text, summarize

    run = from_namespace(InspectArgs, args)
    if run.top < 0:
        raise GhostedError(f"--top must be 0 or more (selection scores to show), got {run.top}.")
    folder = Path(run.folder)
    config_path = folder / "config.json"
    if not folder.is_dir():
        raise GhostedError(f"inspect reads a local model folder, and {folder} is none (for a Hub id, download it first: "
                           f"hf download {folder} --local-dir DIR).")
    if not config_path.is_file():
        raise GhostedError(f"{folder} has no config.json: it is not a saved model folder.")
    raw = verify_folder(folder)  # a truncated or altered weight file is named here, not deep in a load
    kind = made_as(raw)
    if kind == "ghosted":
        config = GhostedConfig.from_pretrained(folder)
        tensors = {}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as handle:
                tensors.update({k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys() if ".ghost." in k})
    elif kind == "stock":  # its operators are in its weights
        config, tensors = AutoConfig.from_pretrained(folder, trust_remote_code=False), None
    else:
        raise GhostedError(f"{folder} holds a {raw.get('model_type')!r} model that ghosted_hf did not make (its "
                           "config.json has no ghost_provenance): there is nothing to inspect.")
    print(render_text(summarize(config), tensors, top_scores=run.top))
    return 0
