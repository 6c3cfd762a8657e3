"""`ghosted export-stock`, `ghosted export-gguf` and `ghosted export-decilm`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..errors import GhostedError
from ..io.files import check_output
from ..model.checkpoint import made_as
from ..options import from_namespace, option
from ..utils.network import check_timeout
from .common import CALIBRATION_HELP, LoadArgs, OutputArgs, calibration_text


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
class DecilmArgs(LoadArgs, OutputArgs):
    """Arguments of `ghosted export-decilm`."""

    folder: str = option(help="Saved ghosted model folder or Hub id whose boundaries are all `normed` (or plain), "
                              "with any replaced sub-blocks.")
    output: str | None = option(None, "New folder for the Nemotron-NAS (DeciLM) checkpoint.", required=True)
    tensor_names: str = option("nemotron", "The linear attentions' tensor names: as NVIDIA's published checkpoints "
                                           "(llama.cpp's converter, TensorRT-LLM), or as mlx-lm 0.32 loads them.",
                               ("nemotron", "mlx-lm"))


def cmd_export_stock(args: argparse.Namespace) -> int:
    """`ghosted export-stock`: refit a ghosted model's operators as foldable ones and save a stock checkpoint."""
    from ..io.card import save_with_card
    from ..io.summary import render_text, summarize
    from ..options import ExportOptions
    from ..pipelines.export import export_stock

    run, options = from_namespace(ExportArgs, args), from_namespace(ExportOptions, args)
    check_output(run.output, (run.folder, run.calibration), overwrite=run.overwrite)
    model, tokenizer = run.load(run.folder)
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
    from ..pipelines.gguf import converter_files, export_gguf

    run = from_namespace(GgufArgs, args)
    output = check_output(run.output, (run.folder, *converter_files(run.llama_cpp)), overwrite=run.overwrite, file=True)
    check_timeout(run.timeout)  # before the model loads
    model, tokenizer = run.load(run.folder)
    export_gguf(model, tokenizer, output, run.llama_cpp, run.outtype, run.timeout)
    print(f"Wrote {output} (llama.cpp architecture deci; run it with llama-cli / llama-server, quantize it with "
          "llama-quantize).")
    return 0


def cmd_export_decilm(args: argparse.Namespace) -> int:
    """`ghosted export-decilm`: a normed or sub-block ghosted model as a Nemotron-NAS (DeciLM) checkpoint."""
    from ..pipelines.decilm import export_decilm

    run = from_namespace(DecilmArgs, args)
    output = check_output(run.output, (run.folder,), overwrite=run.overwrite)
    model, tokenizer = run.load(run.folder)
    export_decilm(model, tokenizer, output, run.tensor_names)
    readers = "mlx-lm" if run.tensor_names == "mlx-lm" else "llama.cpp's convert_hf_to_gguf.py, TensorRT-LLM"
    print(f"Wrote {output} (Nemotron-NAS / DeciLM: {readers}, and transformers with trust_remote_code=True).")
    return 0
