"""What several commands share: help texts, the loading, memory and output arguments, the calibration text and the
model loaded for calibration."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import assets
from ..errors import GhostedError
from ..loading import DTYPES, load_model
from ..options import option

logger = logging.getLogger(__name__)


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


def calibration_text(path: str | None, options: Any, statistics: str | None = None):
    """The calibration data, its first document read here so that a missing, unreadable or empty one fails before
    the model loads; else the packaged corpus (none when precomputed statistics are given)."""
    from ..text import read_documents

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

    from ..statistics.layerwise import LayerwisePass, model_bytes, parse_memory
    from ..loading import resolve

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
    from ..distributed import init_distributed, launcher_process

    if device == "cuda" and init_distributed():
        return f"cuda:{launcher_process()[2]}"
    return device
