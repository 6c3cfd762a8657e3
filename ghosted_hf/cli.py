"""`ghosted` command line. Every subcommand's options are dataclass fields (the Python API's
`PruneOptions` and `HealOptions` included), so flags, defaults and checks are defined once."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import assets
from .checkpoint import made_as
from .errors import GhostedError
from .files import check_output, relation, staged_folder, verify_folder
from .network import check_timeout
from .loading import DTYPES, load_model
from .options import PruneOptions, add_arguments, from_namespace, option

logger = logging.getLogger("ghosted_hf")

MODEL_HELP = (f"Local folder, Hub id or packaged model ({', '.join(assets.PACKAGED_MODELS)}) of a causal LM of a "
              f"supported family (docs/architectures.md); None: the packaged {assets.DEFAULT_MODEL}.")
TEXT_HELP = ("a text file (documents separated by blank lines), a .jsonl/.json/.parquet/.arrow/.csv file, a datasets "
             "folder or a Hub dataset id (--text-column, --split, --streaming)")
CALIBRATION_HELP = f"Calibration text: {TEXT_HELP} (None: the packaged Wikipedia calibration articles)."
TRUST_HELP = ("Run Python code that the model folder or repository carries (its model's, tokenizer's or custom_generate/ "
              "code). Never needed for ghosted models (ghosted_hf's own classes load them) or for families transformers "
              "ships; without it no file of the folder is imported.")


@dataclass(kw_only=True)
class LoadArgs:
    """How a command loads its model: dtype, Hub revision, remote-code trust."""

    dtype: str = option("float32", "Dtype to load the model in.", tuple(DTYPES))
    revision: str | None = option(None, "Branch, tag or commit of a Hub model id.")
    trust_remote_code: bool = option(False, TRUST_HELP)


@dataclass(kw_only=True)
class MemoryArgs:
    """Memory limits of calibration: layer-by-layer passes and where their activations live."""

    layerwise: bool = option(False, "Calibrate one decoder layer at a time, read from the safetensors files (for models "
                                    "larger than memory; a local folder only).")
    max_memory: str | None = option(None, "Memory the model may use (e.g. 16GiB). When its weights in --dtype exceed "
                                          "it, calibration runs layer by layer as with --layerwise (a warning says "
                                          "so); the build afterwards still loads the pruned model whole.")
    activations_dir: str | None = option(None, "Keep the layer-wise pass's activations in files in this folder instead "
                                               "of host memory.")


@dataclass(kw_only=True)
class OutputArgs:
    """What every command that writes shares."""

    overwrite: bool = option(False, "Replace an existing --output (never one of the command's inputs).")


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


@dataclass(kw_only=True)
class StatsCollectArgs(LoadArgs, MemoryArgs, OutputArgs):
    """Arguments of `ghosted stats collect` besides the `PruneOptions`."""

    model: str | None = option(None, MODEL_HELP, positional=True)
    calibration: str | None = option(None, CALIBRATION_HELP)
    shard: str = option("0/1", "Which shard I/N of the calibration batches to collect (every N-th batch from batch I).")
    output: str | None = option(None, "New statistics file to write (safetensors).", required=True)
    device: str | None = option(None, "device_map for loading (e.g. cpu, cuda, auto).")


@dataclass(kw_only=True)
class StatsMergeArgs(OutputArgs):
    """Arguments of `ghosted stats merge`."""

    files: list[str] = option(help="The statistics shards to merge (all N of one run, each once).")
    output: str | None = option(None, "New statistics file to write (safetensors).", required=True)


@dataclass(kw_only=True)
class DemoArgs(OutputArgs):
    """Arguments of `ghosted demo` besides the `PruneOptions`."""

    model: str | None = option(None, "A packaged model (" + ", ".join(assets.PACKAGED_MODELS) + "), folder or Hub id "
                               "instead of the packaged default.")
    output: str | None = option(None, "New folder to save the ghosted model to (None: "
                                      "ghosted-demo-output/<model>-ghosted).")
    eval_windows: int = option(16, "Held-out 512-token windows for perplexity.")


@dataclass(kw_only=True)
class EvalArgs(LoadArgs):
    """Arguments of `ghosted eval`."""

    folder: str | None = option(None, "Saved model folder or Hub id (None: the packaged model).", positional=True)
    text: str | None = option(None, "Held-out text file (None: the packaged evaluation articles).")
    seq_len: int = option(512, "Perplexity window length.")
    windows: int = option(16, "Number of non-overlapping windows.")
    tasks: list[str] | None = option(None, "Zero-shot tasks (arc_easy arc_challenge hellaswag piqa winogrande boolq "
                                           "openbookqa).")
    limit: int | None = option(None, "First N validation examples of each zero-shot task (None: 100; needs --tasks).")
    lambada: int | None = option(None, "Also score the first N LAMBADA (OpenAI) items: last-word accuracy and "
                                       "perplexity (5153: all).")


@dataclass(kw_only=True)
class PushArgs:
    """Arguments of `ghosted push`."""

    folder: str = option(help="Saved ghosted model folder (with its card).")
    repo_id: str = option(help="Hub repository, e.g. you/my-ghosted-model.")
    private: bool = option(False, "Create the repository as private.")
    revision: str | None = option(None, "Branch to push to (created if needed).")
    timeout: float = option(60.0, "Seconds to wait for an answer from the Hub before giving up with an error.")


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


@dataclass(kw_only=True)
class ExportArgs(LoadArgs, OutputArgs):
    """Arguments of `ghosted export-stock` besides the `ExportOptions`."""

    folder: str = option(help="Saved ghosted model folder or Hub id.")
    output: str | None = option(None, "New folder for the stock checkpoint.", required=True)
    calibration: str | None = option(None, CALIBRATION_HELP)


@dataclass(kw_only=True)
class GgufArgs(LoadArgs, OutputArgs):
    """Arguments of `ghosted export-gguf`."""

    folder: str = option(help="Saved ghosted model folder or Hub id whose boundaries are all `normed` (or plain).")
    output: str = option(help="The GGUF file to write.")
    llama_cpp: str = option(None, "The llama.cpp source folder (its convert_hf_to_gguf.py converts the pruned base).",
                            required=True)
    outtype: str = option("f16", "GGUF type of the weights (quantize the file afterwards with llama-quantize).",
                          ("f32", "f16"))
    timeout: float = option(3600.0, "Seconds llama.cpp's converter may run.")


@dataclass(kw_only=True)
class InspectArgs:
    """Arguments of `ghosted inspect`."""

    folder: str = option(help="Saved ghosted model folder, or a stock checkpoint ghosted_hf made.")
    top: int = option(8, "Selection scores to show.")


def cmd_prune(args: argparse.Namespace) -> int:
    """`ghosted prune`: prune, print the summary, save with a card (rank 0 only under torchrun)."""
    from .card import save_with_card
    from .distributed import is_main_process
    from .loading import load_config
    from .recipe import check_request, ghost_prune
    from .summary import render_text, summarize

    run, options = from_namespace(PruneArgs, args), from_namespace(PruneOptions, args)
    if not run.dry_run:
        if run.output is None:
            raise GhostedError("--output DIR is required (or --dry-run to write nothing).")
        check_output(run.output, (run.model, run.calibration, run.statistics), overwrite=run.overwrite)
    calibration = calibration_text(run.calibration, options, statistics=run.statistics)
    config = load_config(run.model, trust_remote_code=run.trust_remote_code, revision=run.revision)
    check_request(config, options)
    model, tokenizer = load_for_calibration(run, config)  # only once everything the config can tell was checked
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


def write_statistics(stats, path: Path) -> None:
    """Write on the main process only (`CalibrationStatistics.save` writes all or nothing)."""
    from .distributed import is_main_process

    if is_main_process():
        stats.save(path)


def cmd_stats_collect(args: argparse.Namespace) -> int:
    """`ghosted stats collect`: the statistics of one shard, written atomically."""
    from .distributed import is_main_process
    from .recipe import calibrate
    from .statistics import ShardSpec

    run, options = from_namespace(StatsCollectArgs, args), from_namespace(PruneOptions, args)
    shard = ShardSpec.parse(run.shard)
    path = check_output(run.output, (run.model, run.calibration), overwrite=run.overwrite, file=True)
    calibration = calibration_text(run.calibration, options)
    model, tokenizer = load_for_calibration(run)
    stats = calibrate(model, tokenizer, calibration, options, shard=shard)
    write_statistics(stats, path)
    if is_main_process():
        print(f"Wrote shard {shard} ({stats.tokens} tokens, {len(stats.tensors)} statistics) to {path}")
    return 0


def cmd_stats_merge(args: argparse.Namespace) -> int:
    """`ghosted stats merge`: all shards of one run summed into one statistics file."""
    from .statistics import CalibrationStatistics

    run = from_namespace(StatsMergeArgs, args)
    path = check_output(run.output, tuple(run.files), overwrite=run.overwrite, file=True)
    merged = CalibrationStatistics.merge(run.files)
    write_statistics(merged, path)
    print(f"Merged {len(run.files)} shards ({merged.tokens} tokens) into {path}")
    return 0


def calibration_text(path: str | None, options: Any, statistics: str | None = None):
    """The calibration data, its first document read here so that a missing, unreadable or empty one fails before
    the model loads; else the packaged corpus (none when precomputed statistics are given)."""
    from .text import read_documents

    if path is not None:
        documents = read_documents(path, split=options.split, text_column=options.text_column,
                                   streaming=options.streaming)
        if next(iter(documents.texts), None) is None:
            raise GhostedError(f"The calibration text ({documents.name}) is empty: provide at least a few paragraphs "
                               "of text.")
        return path
    return None if statistics is not None else assets.wikipedia_split("calibration")


def load_for_calibration(run, config: Any = None) -> tuple:
    """(model, tokenizer): a `LayerwisePass` with --layerwise, or when the weights exceed --max-memory. `config`:
    the model's, when `load_config` already read and checked it."""
    from transformers import AutoTokenizer

    from .statistics.layerwise import LayerwisePass, model_bytes, parse_memory
    from .loading import resolve

    limit = parse_memory(run.max_memory) if run.max_memory is not None else None
    folder = Path(resolve(run.model))
    layerwise = run.layerwise
    if not layerwise and limit is not None and folder.is_dir():
        layerwise = model_bytes(folder, DTYPES[run.dtype]) > limit
        if layerwise:
            logger.warning("The weights do not fit --max-memory %s: calibrating layer by layer.", run.max_memory)
    if not layerwise:
        return load_model(run.model, dtype=run.dtype, device_map=rank_device(run.device),
                          trust_remote_code=run.trust_remote_code, revision=run.revision, config=config)
    if not folder.is_dir():
        raise GhostedError(f"Layer-by-layer calibration reads a local model folder; {run.model} is not one (download it "
                           "first, e.g. huggingface-cli download).")
    # The build after calibration still loads the model (layer surgery needs every kept weight in memory).
    model = LayerwisePass(folder, DTYPES[run.dtype], offload_folder=run.activations_dir)
    return model, AutoTokenizer.from_pretrained(folder, trust_remote_code=False)


def rank_device(device: str | None) -> str | None:
    """Under torchrun (or mpirun) with `--device cuda`, each process takes its own GPU (its local rank)."""
    from .distributed import init_distributed, launcher_process

    if device == "cuda" and init_distributed():
        return f"cuda:{launcher_process()[2]}"
    return device


def cmd_demo(args: argparse.Namespace) -> int:
    """`ghosted demo`: the main job on the packaged model and corpus."""
    from .demo import demo_output, format_rows, run_demo

    run, options = from_namespace(DemoArgs, args), from_namespace(PruneOptions, args)
    own = run.output is None  # the demo's own default folder: a second run replaces what the first saved there
    run.output = run.output or demo_output(run.model)
    check_output(run.output, (run.model,), overwrite=run.overwrite or own)
    if own and Path(run.output).exists():
        logger.warning("Replacing the previous demo output in %s.", Path(run.output).resolve())
    rows = run_demo(run.output, options, model=run.model, eval_windows=run.eval_windows)
    config = json.loads((Path(run.output) / "config.json").read_text())
    print()
    print(format_rows(rows, config["removed_layers"], f"{run.eval_windows} windows of 512 tokens"))
    print(f"\nSaved the ghosted model to {Path(run.output).resolve()} "
          f"(load it with AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)).")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """`ghosted eval`: held-out perplexity and, optionally, zero-shot tasks."""
    from .data import tokenize_texts
    from .evaluate import check_zero_shot, lambada, lambada_items, perplexity, zero_shot

    run = from_namespace(EvalArgs, args)
    if run.limit is not None and not run.tasks:
        raise GhostedError("--limit applies to zero-shot tasks: pass --tasks too.")
    if run.tasks:
        check_zero_shot(run.tasks)  # before the perplexity run, not after it
    if run.lambada:
        lambada_items(1)
    model, tokenizer = load_model(run.folder, dtype=run.dtype, trust_remote_code=run.trust_remote_code,
                                  revision=run.revision)
    text = run.text if run.text is not None else assets.wikipedia_split("evaluation")
    held_out = tokenize_texts(tokenizer, text, run.seq_len, run.windows, batch_size=4)
    results: dict = {"perplexity": perplexity(model, held_out.batches), "perplexity_tokens": held_out.num_tokens}
    if run.tasks:
        results["zero_shot"] = zero_shot(model, tokenizer, run.tasks, limit=100 if run.limit is None else run.limit)
    if run.lambada:
        results["lambada"] = lambada(model, tokenizer, limit=run.lambada)
    print(json.dumps(results, indent=2))
    return 0


def cmd_push(args: argparse.Namespace) -> int:
    """`ghosted push`: verify a saved folder and upload it to the Hub."""
    from .hub import push_to_hub

    run = from_namespace(PushArgs, args)
    pushed = push_to_hub(run.folder, run.repo_id, private=run.private, revision=run.revision, timeout=run.timeout)
    print(f"Pushed {run.folder} to {run.repo_id} in commit {pushed.commit} ({pushed.commit_url})")
    print(f'Load it with AutoModelForCausalLM.from_pretrained("{run.repo_id}", revision="{pushed.commit}", '
          "trust_remote_code=True)")
    return 0


def cmd_heal(args: argparse.Namespace) -> int:
    """`ghosted heal`: LoRA-heal a pruned model and save it merged (or the adapter alone); rank 0 writes."""
    import torch

    from .card import save_with_card
    from .distributed import is_main_process
    from .healing import HealOptions, base_model_reference, heal, merge

    run, options = from_namespace(HealArgs, args), from_namespace(HealOptions, args)
    check_output(run.output, (run.folder, run.data, run.eval_data, run.teacher, run.checkpoints),
                 overwrite=run.overwrite)
    needs_folder = options.save_every or run.resume or options.report_to != "none"
    checkpoints = run.checkpoints or (f"{run.output.rstrip('/')}.checkpoints" if needs_folder else None)
    for folder, what in ((run.output, "the output folder"), (run.folder, "the model folder")):
        if checkpoints is not None and relation(checkpoints, folder) in ("is", "lies inside"):
            raise GhostedError(f"--checkpoints {checkpoints} {relation(checkpoints, folder)} {what} {folder}: "
                               "checkpoints would be written into a model; name a folder outside it.")
    model, tokenizer = load_model(run.folder, dtype=run.dtype, trust_remote_code=run.trust_remote_code,
                                  revision=run.revision)
    teacher = None
    if run.teacher != "none":
        reference = base_model_reference(model) if run.teacher == "base" else run.teacher
        teacher, _ = load_model(reference, dtype=run.teacher_dtype or run.dtype, trust_remote_code=run.trust_remote_code)
        if torch.cuda.is_available():
            teacher.to(f"cuda:{torch.cuda.current_device()}")
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


def cmd_export_stock(args: argparse.Namespace) -> int:
    """`ghosted export-stock`: refit a ghosted model's operators as foldable ones and save a stock checkpoint."""
    from .card import save_with_card
    from .export import export_stock
    from .options import ExportOptions
    from .summary import render_text, summarize

    run, options = from_namespace(ExportArgs, args), from_namespace(ExportOptions, args)
    check_output(run.output, (run.folder, run.calibration), overwrite=run.overwrite)
    model, tokenizer = load_model(run.folder, dtype=run.dtype, trust_remote_code=run.trust_remote_code,
                                  revision=run.revision)
    if made_as(model.config) != "ghosted":
        raise GhostedError(f"{run.folder} holds a {model.config.model_type!r} model, not a ghosted one: it is a stock "
                           "checkpoint already.")
    stock = export_stock(model, tokenizer, calibration_text(run.calibration, options), options)
    print(render_text(summarize(stock.config)))
    save_with_card(stock, run.output, tokenizer)
    print(f"\nSaved the stock checkpoint to {run.output} (loads with AutoModelForCausalLM, no trust_remote_code).")
    return 0


def cmd_export_gguf(args: argparse.Namespace) -> int:
    """`ghosted export-gguf`: a normed ghosted model as one llama.cpp GGUF (DeciLM linear-attention blocks)."""
    from .llamacpp import export_gguf

    run = from_namespace(GgufArgs, args)
    output = check_output(run.output, (run.folder,), overwrite=run.overwrite, file=True)
    check_timeout(run.timeout)  # before the model loads
    model, tokenizer = load_model(run.folder, dtype=run.dtype, trust_remote_code=run.trust_remote_code,
                                  revision=run.revision)
    export_gguf(model, tokenizer, output, run.llama_cpp, run.outtype, run.timeout)
    print(f"Wrote {output} (llama.cpp architecture deci; run it with llama-cli / llama-server, quantize it with "
          "llama-quantize).")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    """`ghosted inspect`: what a saved ghosted folder (or stock checkpoint ghosted_hf made) contains and how it
    was made."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from .remote.configuration_ghosted import GhostedConfig
    from .summary import render_text, summarize

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


def build_parser() -> argparse.ArgumentParser:
    """The `ghosted` parser: one subcommand per job, its flags generated from the option dataclasses."""
    from .healing import HealOptions
    from .options import ExportOptions

    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="ghosted", description="Layer pruning with closed-form Ghosted Layers recovery.",
                                     formatter_class=formatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="Log progress details.")
    commands = parser.add_subparsers(dest="command", required=True)
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
        ("inspect", "Print what a saved ghosted model (or stock checkpoint ghosted_hf made) contains and how it was "
                    "made.", [InspectArgs], cmd_inspect),
    ]
    for name, help, groups, handler in subcommands:
        sub = commands.add_parser(name, help=help, description=help, formatter_class=formatter)
        for group in groups:
            add_arguments(sub, group)
        sub.set_defaults(handler=handler)
    stats_help = "Calibration statistics in shards, for machines that share no network."
    stats = commands.add_parser("stats", help=stats_help, description=stats_help, formatter_class=formatter)
    actions = stats.add_subparsers(dest="action", required=True)
    for name, help, groups, handler in [
        ("collect", "Collect the statistics `prune` with these options needs, over one shard I/N of the calibration "
                    "batches.", [StatsCollectArgs, PruneOptions], cmd_stats_collect),
        ("merge", "Sum shards 0/N .. N-1/N into the statistics of the whole calibration set (for prune --statistics).",
         [StatsMergeArgs], cmd_stats_merge),
    ]:
        sub = actions.add_parser(name, help=help, description=help, formatter_class=formatter)
        for group in groups:
            add_arguments(sub, group)
        sub.set_defaults(handler=handler)
    return parser


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

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    """Run one command; bad input ends in one line (exit 2), a bug in a traceback with a hint to report it (exit 1)."""
    args = build_parser().parse_args(argv)
    configure_logging(args.verbose)
    command = args.command + (f" {args.action}" if getattr(args, "action", None) else "")
    try:
        return args.handler(args)
    except (GhostedError, OSError) as error:
        # Bad input (ours, or files and Hub ids that do not exist or cannot be read): one line.
        message = " ".join(str(error).split()) or type(error).__name__
        print(f"ghosted {command}: error: {message}", file=sys.stderr)
        return 2
    except Exception:
        # Anything else is a bug, not bad input: the whole traceback, and where to send it.
        traceback.print_exc()
        print(f"ghosted {command}: internal error (a bug in ghosted_hf, not a problem with your input). Please report "
              "it to the ghosted_hf issue tracker with the traceback above and the command you ran.", file=sys.stderr)
        return 1
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
