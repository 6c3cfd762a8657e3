"""Loading models and tokenizers for the command line: local folders or Hub ids (at a `revision`),
running remote code only when the user chose to trust it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from . import assets
from .checkpoint import check_folder
from .errors import GhostedError, MissingFileError

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    from huggingface_hub.errors import StrictDataclassError  # transformers' configs validate their fields with it
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    ref = resolve(ref)
    if Path(ref).is_dir():
        check_folder(ref)  # a config that does not describe its weights is refused before a model is built
    # No Python file of the folder runs unless the user trusts it: not the model's (ghosted_hf's own classes are
    # registered with the Auto classes, so a ghosted model needs none), not a tokenizer's, not custom_generate/.
    # Always a bool: None makes transformers prompt on stdin for code it has no local class for.
    try:  # the config alone first: what transformers raises about a field is the file's fault, not a bug here
        AutoConfig.from_pretrained(ref, revision=revision, trust_remote_code=bool(trust_remote_code))
    except (OSError, ImportError):
        raise
    except Exception as error:
        raise GhostedError(f"The config.json of {ref} cannot be read by transformers: "
                           f"{' '.join(str(error).split())[:300] or type(error).__name__}") from None
    try:
        model = AutoModelForCausalLM.from_pretrained(ref, dtype=DTYPES[dtype], device_map=device_map,
                                                     revision=revision, trust_remote_code=bool(trust_remote_code))
        tokenizer = AutoTokenizer.from_pretrained(ref, revision=revision,
                                                  trust_remote_code=bool(trust_remote_code))
    except (ValueError, ImportError, StrictDataclassError) as error:  # transformers' and the remote code's refusals
        raise GhostedError(f"{ref} cannot be loaded: {' '.join(str(error).split())[:500]}") from error
    return model.eval(), tokenizer
