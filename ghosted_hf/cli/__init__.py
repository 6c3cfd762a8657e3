"""`ghosted` command line: one module per command. Every subcommand's options are dataclass fields (the Python API's
`PruneOptions` and `HealOptions` included), so flags, defaults and checks are defined once."""

from __future__ import annotations

import argparse
import logging
import sys
import traceback

from ..errors import GhostedError, one_line
from ..options import PruneOptions, add_arguments
from ..utils.inputs import command_paths
from .demo import DemoArgs, cmd_demo
from .evaluate import EvalArgs, cmd_eval
from .export import DecilmArgs, ExportArgs, GgufArgs, cmd_export_decilm, cmd_export_gguf, cmd_export_stock
from .heal import HealArgs, cmd_heal
from .inspect import InspectArgs, cmd_inspect
from .prune import PruneArgs, cmd_prune
from .push import PushArgs, cmd_push
from .stats import StatsCollectArgs, StatsMergeArgs, cmd_stats_collect, cmd_stats_merge


def build_parser() -> argparse.ArgumentParser:
    """The `ghosted` parser: one subcommand per job, its flags generated from the option dataclasses."""
    from ..options import ExportOptions
    from ..pipelines.healing import HealOptions

    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="ghosted", description="Layer pruning with closed-form Ghosted Layers recovery.",
                                     formatter_class=formatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="Log progress details.")
    stats = [  # `ghosted stats ACTION`
        ("collect", "Collect the statistics `prune` with these options needs, over one shard I/N of the calibration "
                    "batches.", [StatsCollectArgs, PruneOptions], cmd_stats_collect),
        ("merge", "Sum shards 0/N .. N-1/N into the statistics of the whole calibration set (for prune --statistics).",
         [StatsMergeArgs], cmd_stats_merge),
    ]
    subcommands = [
        ("prune", "Remove layers from a model and fit the recovery operators.", [PruneArgs, PruneOptions], cmd_prune),
        ("demo", "The main job: prune a packaged model (SmolLM2-135M; --model gemma3-270m), save it, and compare "
                 "dense / plainly pruned / ghosted perplexity, speed and samples.", [DemoArgs, PruneOptions], cmd_demo),
        ("eval", "Perplexity on held-out text and, optionally, zero-shot tasks.", [EvalArgs], cmd_eval),
        ("push", "Upload a saved ghosted model folder (with its card) to the Hub.", [PushArgs], cmd_push),
        ("heal", "LoRA-heal a pruned model (ghosted or stock export) on transformers' Trainer and save it merged.",
         [HealArgs, HealOptions], cmd_heal),
        ("export-stock", "Turn a ghosted model into the best stock checkpoint of its family: each operator refitted "
                         "as a scaled rotation (and an MLP output transform) folded into the weights.",
         [ExportArgs, ExportOptions], cmd_export_stock),
        ("export-gguf", "Write a ghosted model whose boundaries are `normed` as one llama.cpp GGUF: each boundary a "
                        "DeciLM linear-attention block, the base converted by llama.cpp's own converter.",
         [GgufArgs], cmd_export_gguf),
        ("export-decilm", "Write a ghosted model whose boundaries are `normed` (or plain), with any replaced "
                          "sub-blocks, as a Nemotron-NAS (DeciLM) checkpoint: removed layers as no-op blocks, each "
                          "map a linear attention, read by llama.cpp's converter, mlx-lm and TensorRT-LLM.",
         [DecilmArgs], cmd_export_decilm),
        ("inspect", "Print what a saved ghosted model (or stock checkpoint ghosted_hf made) contains and how it was "
                    "made.", [InspectArgs], cmd_inspect),
        ("stats", "Calibration statistics in shards, for machines that share no network.", stats, None),
    ]

    def add(parsers: argparse._SubParsersAction, commands: list) -> None:
        for name, help, groups, handler in commands:
            sub = parsers.add_parser(name, help=help, description=help, formatter_class=formatter)
            if handler is None:  # a command with actions: `groups` lists them
                add(sub.add_subparsers(dest="action", required=True), groups)
                continue
            for group in groups:
                add_arguments(sub, group)
            defaults = {name: value for group in groups for name, value in getattr(group, "cli_defaults", {}).items()}
            for action in sub._actions:
                if action.dest in defaults:
                    action.default, meaning = defaults[action.dest]
                    action.help = f"{action.help} {meaning}"
            sub.set_defaults(handler=handler)

    add(parser.add_subparsers(dest="command", required=True), subcommands)
    return parser


def attached_values(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`--remove -5%` as `--remove=-5%`: a value that starts with a dash and is no flag of any command is the option's
    value, so that the option's own check names what is wrong with it (argparse would say "expected one argument")."""
    flags: dict[str, bool] = {}  # every flag of every command -> whether it takes a value
    pending = [parser]
    while pending:
        for action in pending.pop()._actions:
            if isinstance(action, argparse._SubParsersAction):
                pending.extend(action.choices.values())
            for flag in action.option_strings:
                flags[flag] = action.nargs != 0
    out: list[str] = []
    for token in argv:
        if out and flags.get(out[-1]) and token.startswith("-") and token.split("=")[0] not in flags:
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def configure_logging(verbose: bool) -> None:
    """ghosted_hf's own messages on stderr. Not a root handler: huggingface_hub and transformers print theirs
    themselves, and a root handler repeated each of their lines."""
    package = logging.getLogger("ghosted_hf")
    package.setLevel(logging.INFO if verbose else logging.WARNING)
    if not any(isinstance(h, _StderrHandler) for h in package.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        package.addHandler(handler)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record is emitted (`main` may run again with stderr replaced)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def main(argv: list[str] | None = None) -> int:
    """Run one command; bad input ends in one line (exit 2), a bug in a traceback with a hint to report it (exit 1)."""
    parser = build_parser()
    args = parser.parse_args(attached_values(parser, sys.argv[1:] if argv is None else list(argv)))
    configure_logging(args.verbose)
    command = args.command + (f" {args.action}" if getattr(args, "action", None) else "")
    completed = False
    try:
        with command_paths():  # every path the command reads is kept from its outputs
            status = args.handler(args)
        completed = True
        return status
    except (GhostedError, OSError) as error:
        # Bad input (ours, or files and Hub ids that do not exist or cannot be read): one line.
        message = one_line(error, None)
        print(f"ghosted {command}: error: {message}", file=sys.stderr)
        return 2
    except Exception:
        # Anything else is a bug, not bad input: the whole traceback, and where to send it.
        traceback.print_exc()
        print(f"ghosted {command}: internal error (a bug in ghosted_hf, not a problem with your input). Please report "
              "it to the ghosted_hf issue tracker with the traceback above and the command you ran.", file=sys.stderr)
        return 1
    finally:
        from ..utils.distributed import leave_process_group

        leave_process_group(completed)
