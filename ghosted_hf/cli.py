"""`ghosted` command line: prune (with the options of `ghost_prune`) and inspect."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

from . import assets
from .options import add_prune_arguments, options_from_namespace
from .report import summarize

logger = logging.getLogger("ghosted_hf")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model_and_tokenizer(model_id: str, dtype: str, device: str | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_id, dtype=DTYPES[dtype], device_map=device)
    return model.eval(), AutoTokenizer.from_pretrained(model_id)


def cmd_prune(args: argparse.Namespace) -> int:
    from .card import save_with_card
    from .recipe import ghost_prune
    from .surgery import export_plain

    options = options_from_namespace(args)
    if not args.dry_run and args.output is None:
        raise SystemExit("ghosted prune: --output DIR is required (or --dry-run to only print the plan).")
    if args.output is not None and Path(args.output).exists() and any(Path(args.output).iterdir()) and not args.dry_run:
        raise SystemExit(f"ghosted prune: {args.output} exists and is not empty; choose a new --output folder.")
    model, tokenizer = load_model_and_tokenizer(assets.resolve_model(args.model), args.dtype, args.device)
    calibration = args.calibration
    if calibration is None and args.statistics is None:
        calibration = assets.wikipedia_split("calibration")  # the packaged default corpus
    ghosted = ghost_prune(model, tokenizer, calibration, options, statistics=args.statistics)
    print(summarize(ghosted.config))
    if args.dry_run:
        print("\n--dry-run: nothing written.")
        return 0
    if options.operator == "replaceme-ls":
        export_plain(ghosted).save_pretrained(args.output)  # fused: a plain checkpoint, no remote code
        tokenizer.save_pretrained(args.output)
    else:
        save_with_card(ghosted, args.output, tokenizer)
    print(f"\nSaved to {args.output}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import format_rows, run_demo

    options = options_from_namespace(args)
    rows = run_demo(args.output, options, model=args.model, eval_windows=args.eval_windows)
    config = json.loads((Path(args.output) / "config.json").read_text())
    print()
    print(format_rows(rows, config["removed_layers"], f"{args.eval_windows} windows of 512 tokens"))
    print(f"\nSaved the ghosted model to {args.output} "
          f"(load it with AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)).")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .data import tokenize_texts
    from .evaluate import perplexity, zero_shot

    folder = assets.resolve_model(args.folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[args.dtype], trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = args.text if args.text is not None else assets.wikipedia_split("evaluation")
    held_out = tokenize_texts(tokenizer, text, args.seq_len, args.windows, batch_size=4)
    results: dict = {"perplexity": perplexity(model, held_out.batches), "perplexity_tokens": held_out.num_tokens}
    if args.tasks:
        results["zero_shot"] = zero_shot(model, tokenizer, args.tasks, limit=args.limit)
    print(json.dumps(results, indent=2))
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    from .hub import push_to_hub

    url = push_to_hub(args.folder, args.repo_id, private=args.private, revision=args.revision)
    print(f"Pushed {args.folder} to {url}")
    print(f'Load it with AutoModelForCausalLM.from_pretrained("{args.repo_id}", trust_remote_code=True'
          + (f', revision="{args.revision}")' if args.revision else ")"))
    return 0


def cmd_heal(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .card import save_with_card
    from .healing import heal, merge

    model = AutoModelForCausalLM.from_pretrained(args.folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.folder)
    teacher = None
    if args.teacher:
        teacher = AutoModelForCausalLM.from_pretrained(assets.resolve_model(args.teacher), dtype=torch.float32).eval()
    data = args.data if args.data is not None else assets.wikipedia_split("calibration")
    peft_model, losses = heal(model, tokenizer, data, teacher=teacher, scope=args.scope,
                              train_operators=args.train_operators, rank=args.rank, steps=args.steps, lr=args.lr,
                              seq_len=args.seq_len, batch_size=args.batch_size)
    print(f"loss: first 5 steps {sum(losses[:5]) / 5:.4f}, last 5 steps {sum(losses[-5:]) / 5:.4f}")
    if args.adapter_only:
        peft_model.save_pretrained(args.output)
        print(f"Saved the adapter to {args.output} (load with PeftModel.from_pretrained(base, path)).")
    else:
        save_with_card(merge(peft_model), args.output, tokenizer)
        print(f"Saved the merged model to {args.output}.")
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
    prune.add_argument("model", nargs="?", default=None,
                       help=f"Local folder or Hub id of a Llama / Qwen2 / Qwen3 causal LM (default: {assets.DEFAULT_MODEL}).")
    prune.add_argument("--calibration", help="Calibration text file, documents separated by blank lines "
                       "(default: the packaged Wikipedia calibration articles).")
    prune.add_argument("--output", help="Folder to write the pruned model to.")
    prune.add_argument("--dry-run", action="store_true", help="Print scores, chosen layers and fit figures; write nothing.")
    prune.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="Dtype to load the model in.")
    prune.add_argument("--device", default=None, help="device_map for loading (e.g. cpu, cuda, auto).")
    prune.add_argument("--statistics", default=None, help="Precomputed statistics (safetensors) to reuse.")
    add_prune_arguments(prune)
    prune.set_defaults(handler=cmd_prune)

    demo = commands.add_parser("demo", help="The main job: prune the packaged SmolLM2-135M, save it, and compare "
                               "dense / plainly pruned / ghosted perplexity, speed and samples.")
    demo.add_argument("--model", default=None, help="Model folder or Hub id instead of the packaged default.")
    demo.add_argument("--output", default="ghosted-smollm2-135m", help="Folder to save the ghosted model to.")
    demo.add_argument("--eval-windows", type=int, default=16, help="Held-out 512-token windows for perplexity.")
    add_prune_arguments(demo)
    demo.set_defaults(handler=cmd_demo)

    evaluate = commands.add_parser("eval", help="Perplexity on held-out text and, optionally, zero-shot tasks.")
    evaluate.add_argument("folder", nargs="?", default=None, help="Saved model folder or Hub id (default: the packaged model).")
    evaluate.add_argument("--text", default=None, help="Held-out text file (default: the packaged evaluation articles).")
    evaluate.add_argument("--seq-len", type=int, default=512, help="Perplexity window length.")
    evaluate.add_argument("--windows", type=int, default=16, help="Number of non-overlapping windows.")
    evaluate.add_argument("--tasks", nargs="*", default=[], help="Zero-shot tasks (arc_easy arc_challenge hellaswag "
                          "piqa winogrande boolq openbookqa).")
    evaluate.add_argument("--limit", type=int, default=100, help="First N validation examples of each task.")
    evaluate.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    evaluate.set_defaults(handler=cmd_eval)

    push = commands.add_parser("push", help="Upload a saved ghosted model folder (with its card) to the Hub.")
    push.add_argument("folder")
    push.add_argument("repo_id")
    push.add_argument("--private", action="store_true", help="Create the repository as private.")
    push.add_argument("--revision", default=None, help="Branch to push to (created if needed).")
    push.set_defaults(handler=cmd_push)

    heal_parser = commands.add_parser("heal", help="LoRA-heal a ghosted model with PEFT and save it merged.")
    heal_parser.add_argument("folder", help="Saved ghosted model folder.")
    heal_parser.add_argument("--data", default=None, help="Training text file (default: packaged calibration articles).")
    heal_parser.add_argument("--output", required=True)
    heal_parser.add_argument("--teacher", default=None, help="Dense model to distill from (default: LM loss).")
    heal_parser.add_argument("--scope", default="boundary", choices=["boundary", "all-linear"])
    heal_parser.add_argument("--train-operators", action="store_true", help="Also train the ghost operators.")
    heal_parser.add_argument("--rank", type=int, default=8)
    heal_parser.add_argument("--steps", type=int, default=50)
    heal_parser.add_argument("--lr", type=float, default=2e-4)
    heal_parser.add_argument("--seq-len", type=int, default=256)
    heal_parser.add_argument("--batch-size", type=int, default=4)
    heal_parser.add_argument("--adapter-only", action="store_true", help="Save only the PEFT adapter.")
    heal_parser.set_defaults(handler=cmd_heal)

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
    except (ValueError, FileNotFoundError, ImportError) as error:
        print(f"ghosted {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
