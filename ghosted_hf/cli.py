"""`ghosted` command line: prune (with the options of `ghost_prune`) and inspect."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

from .options import add_prune_arguments, options_from_namespace
from .report import summarize

logger = logging.getLogger("ghosted_hf")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model_and_tokenizer(model_id: str, dtype: str, device: str | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_id, dtype=DTYPES[dtype], device_map=device)
    return model.eval(), AutoTokenizer.from_pretrained(model_id)


def cmd_prune(args: argparse.Namespace) -> int:
    from .recipe import ghost_prune
    from .surgery import export_plain

    options = options_from_namespace(args)
    if not args.dry_run and args.output is None:
        raise SystemExit("ghosted prune: --output DIR is required (or --dry-run to only print the plan).")
    if args.output is not None and Path(args.output).exists() and any(Path(args.output).iterdir()) and not args.dry_run:
        raise SystemExit(f"ghosted prune: {args.output} exists and is not empty; choose a new --output folder.")
    model, tokenizer = load_model_and_tokenizer(args.model, args.dtype, args.device)
    ghosted = ghost_prune(model, tokenizer, args.calibration, options, statistics=args.statistics)
    print(summarize(ghosted.config))
    if args.dry_run:
        print("\n--dry-run: nothing written.")
        return 0
    if options.operator == "replaceme-ls":
        export_plain(ghosted).save_pretrained(args.output)  # fused: a plain checkpoint, no remote code
    else:
        ghosted.save_pretrained(args.output)
    tokenizer.save_pretrained(args.output)
    print(f"\nSaved to {args.output}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from safetensors import safe_open

    from .remote.configuration_ghosted import GhostedConfig

    folder = Path(args.folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise SystemExit(f"ghosted inspect: {folder} has no config.json.")
    raw = json.loads(config_path.read_text())
    if raw.get("model_type") != "ghosted":
        raise SystemExit(f"ghosted inspect: {folder} holds a {raw.get('model_type')!r} model, not a ghosted one.")
    config = GhostedConfig.from_pretrained(folder)
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            tensors.update({k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys() if ".ghost." in k})
    print(summarize(config, tensors, top_scores=args.top))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ghosted", description="Layer pruning with closed-form Ghosted Layers recovery.")
    parser.add_argument("-v", "--verbose", action="store_true", help="Log progress details.")
    commands = parser.add_subparsers(dest="command", required=True)

    prune = commands.add_parser("prune", help="Remove layers from a model and fit the recovery operators.")
    prune.add_argument("model", help="Local folder or Hub id of a Llama / Qwen2 / Qwen3 causal LM.")
    prune.add_argument("--calibration", help="Calibration text file (documents separated by blank lines).")
    prune.add_argument("--output", help="Folder to write the pruned model to.")
    prune.add_argument("--dry-run", action="store_true", help="Print scores, chosen layers and fit figures; write nothing.")
    prune.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="Dtype to load the model in.")
    prune.add_argument("--device", default=None, help="device_map for loading (e.g. cpu, cuda, auto).")
    prune.add_argument("--statistics", default=None, help="Precomputed statistics (safetensors) to reuse.")
    add_prune_arguments(prune)
    prune.set_defaults(handler=cmd_prune)

    inspect = commands.add_parser("inspect", help="Print what a saved ghosted model contains.")
    inspect.add_argument("folder")
    inspect.add_argument("--top", type=int, default=8, help="Selection scores to show.")
    inspect.set_defaults(handler=cmd_inspect)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"ghosted {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
