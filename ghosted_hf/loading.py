"""Loading models and tokenizers for the command line: local folders or Hub ids (at a `revision`),
running remote code only when the user chose to trust it."""

from __future__ import annotations

import json
import logging
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from . import assets
from .errors import GhostedError, MissingFileError
from .files import REMOTE_FILES

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def own_remote_code() -> dict[str, bytes]:
    """ghosted_hf's remote-code files, as they are copied next to saved weights."""
    package = resources.files("ghosted_hf.remote")
    return {name: (package / name).read_bytes() for name in REMOTE_FILES}


def _fetch(ref: str, filename: str, revision: str | None) -> Path | None:
    """A file of a local folder or Hub repo (through the HF cache), None when it has none."""
    folder = Path(ref)
    if folder.is_dir():
        return folder / filename if (folder / filename).is_file() else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(ref, filename, revision=revision))
    except EntryNotFoundError:
        return None


def is_own_ghosted_model(ref: str, revision: str | None = None) -> bool:
    """True when the only code loading `ref`'s model would run is ghosted_hf's own remote code, byte for byte:
    a ghosted config whose every `auto_map` entry names one of those two files, both identical to ours. Trust
    is per code file: this says nothing about other code in the folder (a tokenizer's, say)."""
    config = _fetch(ref, "config.json", revision)
    if config is None:
        return False
    values = json.loads(config.read_text())
    if values.get("model_type") != "ghosted":
        return False
    own = {name.removesuffix(".py") for name in REMOTE_FILES}
    entries = list((values.get("auto_map") or {}).values())
    references = [e for entry in entries for e in (entry if isinstance(entry, list) else [entry]) if e]
    if not references or any("--" in r or r.rsplit(".", 1)[0] not in own for r in references):
        return False  # code from another repository ("repo--module.Class") or another file of the folder
    for name, content in own_remote_code().items():
        path = _fetch(ref, name, revision)
        if path is None or path.read_bytes() != content:
            return False
    return True


def resolve(ref: str | None) -> str:
    """The packaged default model's folder for None, else a local folder or Hub id that exists."""
    resolved = assets.resolve_model(ref)
    path = Path(resolved)
    if path.exists() or ref is None:
        if path.is_file():
            raise GhostedError(f"{path} is a file; pass the model's folder (holding config.json) or a Hub id.")
        if not (path / "config.json").is_file():
            raise MissingFileError(f"{path} holds no config.json: it is not a saved model folder.")
        return resolved
    if resolved.startswith((".", "/", "~")) or resolved.count("/") > 1 or not assets.HUB_ID.match(resolved):
        raise MissingFileError(f"Model folder {resolved} does not exist (and it is not a Hub id such as org/name).")
    return resolved


def load_model(ref: str | None, *, dtype: str = "float32", device_map: str | None = None,
               trust_remote_code: bool = False, revision: str | None = None) -> tuple[Any, Any]:
    """(model in eval mode, tokenizer) from a folder or Hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = resolve(ref)
    # Our own remote code is trusted for the model, byte for byte; nothing else runs without --trust-remote-code,
    # the tokenizer's code included.
    trust = trust_remote_code or is_own_ghosted_model(ref, revision)
    try:
        model = AutoModelForCausalLM.from_pretrained(ref, dtype=DTYPES[dtype], device_map=device_map,
                                                     revision=revision, trust_remote_code=trust)
        tokenizer = AutoTokenizer.from_pretrained(ref, revision=revision, trust_remote_code=trust_remote_code)
    except (ValueError, ImportError) as error:  # transformers' and the remote code's refusals of a checkpoint
        raise GhostedError(f"{ref} cannot be loaded: {error}") from error
    return model.eval(), tokenizer
