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
    """True for a ghosted model whose remote code is byte for byte ghosted_hf's own (safe to trust)."""
    config = _fetch(ref, "config.json", revision)
    if config is None or json.loads(config.read_text()).get("model_type") != "ghosted":
        return False
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
    trust = trust_remote_code or is_own_ghosted_model(ref, revision)
    common: dict[str, Any] = {"revision": revision, "trust_remote_code": trust}
    try:
        model = AutoModelForCausalLM.from_pretrained(ref, dtype=DTYPES[dtype], device_map=device_map, **common)
    except (ValueError, ImportError) as error:  # transformers' and the remote code's refusals of a checkpoint
        raise GhostedError(f"{ref} cannot be loaded: {error}") from error
    return model.eval(), AutoTokenizer.from_pretrained(ref, **common)
