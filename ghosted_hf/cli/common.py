"""What several commands share: help texts, the loading, memory and output arguments, the calibration text and the
model loaded for calibration."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import assets
from ..model.loading import DTYPES, load_model
from ..options import option

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

    def load(self, reference: str | None) -> tuple[Any, Any]:
        """The model and tokenizer at `reference`, loaded as these arguments say."""
        return load_model(reference, dtype=self.dtype, trust_remote_code=self.trust_remote_code, revision=self.revision)


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


def check_same_outputs(**values: Any) -> None:
    """Under torchrun or accelerate launch, every process must be given the same outputs: only the main process
    writes, so another process's `--output` would be ignored without a word (one process: nothing to compare)."""
    from ..utils.distributed import check_agreement
    from ..utils.hashing import json_sha256

    check_agreement({f"--{name.replace('_', '-')}": json_sha256(value) for name, value in values.items()})


def calibration_text(path: str | None, options: Any, statistics: str | None = None):
    """The calibration data, its first document read here so that a missing, unreadable or empty one fails before
    the model loads; else the packaged corpus (none when precomputed statistics are given)."""
    from ..text.documents import empty_text, read_documents

    if path is not None:
        documents = read_documents(path, split=options.split, text_column=options.text_column,
                                   streaming=options.streaming)
        if next(iter(documents.texts), None) is None:
            raise empty_text("Calibration text", documents.name)
        return path
    return None if statistics is not None else assets.wikipedia_split("calibration")
