"""Loading models and tokenizers for the command line: local folders or Hub ids (at a `revision`),
running remote code only when the user chose to trust it."""

from __future__ import annotations

import difflib
import logging
from pathlib import Path
from typing import Any

import torch

from .. import assets
from ..architectures import is_multimodal
from ..errors import GhostedError, MissingFileError, one_line
from ..utils.inputs import note_read
from ..utils.network import HUB_TIMEOUT_S
from .checkpoint import check_folder

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve(ref: str | None, what: str = "model") -> str:
    """The packaged default model's folder for None, else a local folder or Hub id that exists; noted as read by the
    running command (a Hub id: its local cache), `what` it is in messages."""
    resolved = assets.resolve_model(ref)
    path = Path(resolved)
    if path.exists() or ref is None:
        if path.is_file():
            raise GhostedError(f"{path} is a file; pass the model's folder (holding config.json) or a Hub id.")
        if not (path / "config.json").is_file():
            raise MissingFileError(f"{path} holds no config.json: it is not a saved model folder.")
        note_read(path, what)
    elif "/" not in resolved:  # not a path, not an org/name Hub id: a packaged model's name, mistyped?
        close = difflib.get_close_matches(resolved.lower(), assets.PACKAGED_MODELS, n=1, cutoff=0.5)
        raise MissingFileError(f"There is no packaged model named {resolved!r}" + (f" (did you mean {close[0]!r}?)"
                               if close else "") + f"; the packaged models are {', '.join(assets.PACKAGED_MODELS)}. "
                               "Or pass a model folder, or a Hub id such as org/name.")
    elif resolved.startswith((".", "/", "~")) or resolved.count("/") > 1 or not assets.HUB_ID.match(resolved):
        raise MissingFileError(f"Model folder {resolved} does not exist (and it is not a Hub id such as org/name).")
    else:
        from huggingface_hub import constants

        note_read(Path(constants.HF_HUB_CACHE) / f"models--{resolved.replace('/', '--')}", f"cache of {what}")
    return resolved


def load_config(ref: str | None, *, trust_remote_code: bool = False, revision: str | None = None) -> Any:
    """The config of a folder or Hub id, read before any weight: a local folder's config is checked against its
    weight files first; a Hub id gets one bounded request (offline, the local cache answers); what transformers
    raises about a field is the file's fault, not a bug here."""
    from transformers import AutoConfig

    ref = resolve(ref)
    if Path(ref).is_dir():
        check_folder(ref)  # a config that does not describe its weights is refused before a model is built
    else:
        check_hub_model(ref, revision, HUB_TIMEOUT_S)
    try:
        return AutoConfig.from_pretrained(ref, revision=revision, trust_remote_code=bool(trust_remote_code))
    except ImportError:
        raise
    except OSError as error:  # transformers' "not found / cannot connect", offline and not in the cache included
        raise GhostedError(f"{ref} is not a local folder and cannot be read from the Hub or its local cache "
                           f"({' '.join(str(error).split())[:200]}); download it (hf download {ref} --local-dir DIR) "
                           "and pass the folder instead.") from None
    except Exception as error:  # transformers' config classes' own errors about a field
        raise GhostedError(f"The config.json of {ref} cannot be read by transformers: "
                           f"{one_line(error)}") from None


def check_hub_model(ref: str, revision: str | None, timeout: float) -> None:
    """One bounded request for a Hub model before transformers starts its own (which retry for minutes when the
    endpoint does not answer); offline, the local cache answers instead."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    if constants.HF_HUB_OFFLINE:
        return
    try:
        HfApi().model_info(ref, revision=revision, timeout=timeout)
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise GhostedError(f"There is no model {ref!r}{f' at revision {revision}' if revision else ''} at "
                           f"{constants.ENDPOINT} (or it is private: log in with `hf auth login`); pass a local "
                           "folder instead.") from None
    except Exception as error:  # the HTTP client's own error types (timeouts, refused connections, HTTP statuses)
        raise GhostedError(f"Cannot read the Hub model {ref!r}: {constants.ENDPOINT} could not be reached or did not "
                           f"answer within {timeout:g} s ({type(error).__name__}); check the network, HF_ENDPOINT and "
                           "HF_HUB_OFFLINE, or pass a local folder instead.") from None


# transformers 5.2x kernelizes every model it loads when the `kernels` package (one of its dependencies) is there:
# moved to a GPU, the model then downloads and runs kernels from the Hub at its next train()/eval() - code the user
# never trusted, and offline a ValueError in the middle of healing (seen on an H200). ghosted_hf's loads run the
# model's own code only.
NO_HUB_KERNELS = {"use_kernels": False}


def load_model(ref: str | None, *, dtype: str = "float32", device_map: str | None = None,
               trust_remote_code: bool = False, revision: str | None = None, config: Any = None) -> tuple[Any, Any]:
    """(model in eval mode, tokenizer) from a folder or Hub id, its config checked first (`load_config`; pass
    `config` when the caller already has it from there, so that the checks and the Hub probe run once). A multimodal
    checkpoint loads whole (`AutoModelForImageTextToText`: its vision tower and projector travel with the pruned
    language decoder), with its processor in the tokenizer's place."""
    from huggingface_hub.errors import StrictDataclassError  # transformers' configs validate their fields with it
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    ref = resolve(ref)
    # No Python file of the folder runs unless the user trusts it: not the model's (ghosted_hf's own classes are
    # registered with the Auto classes, so a ghosted model needs none), not a tokenizer's, not custom_generate/.
    # Always a bool: None makes transformers prompt on stdin for code it has no local class for.
    trust = bool(trust_remote_code)
    if config is None:
        config = load_config(ref, trust_remote_code=trust, revision=revision)
    whole = is_multimodal(config) and type(config) in AutoModelForImageTextToText._model_mapping
    try:
        model = (AutoModelForImageTextToText if whole else AutoModelForCausalLM).from_pretrained(
            ref, config=config, dtype=DTYPES[dtype], device_map=device_map, revision=revision, trust_remote_code=trust,
            **NO_HUB_KERNELS)
        tokenizer = _processor(ref, revision, trust) if whole else None
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(ref, revision=revision, trust_remote_code=trust)
    except (ValueError, ImportError, StrictDataclassError) as error:  # transformers' and the remote code's refusals
        raise GhostedError(f"{ref} cannot be loaded: {' '.join(str(error).split())[:500]}") from error
    if is_multimodal(config) and not is_multimodal(model.config):
        logger.warning("%s is a multimodal checkpoint (%s); AutoModelForCausalLM loads its language model alone: the "
                       "vision tower and projector are dropped, and what is pruned and saved is a text-only %s model.",
                       ref, config.model_type, model.config.model_type)
    return model.eval(), tokenizer


def _processor(ref: str, revision: str | None, trust: bool) -> Any:
    """A multimodal checkpoint's processor (text and images), or None where it has none (its tokenizer alone)."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(ref, revision=revision, trust_remote_code=trust)
    except OSError:  # no image processor saved
        logger.warning("%s has no processor (no preprocessor_config.json): the pruned model is saved with its "
                       "tokenizer alone.", ref)
        return None


def load_for_calibration(model: str | None, *, dtype: str = "float32", device: str | None = None,
                         max_memory: str | None = None, layerwise: bool = False, activations_dir: str | None = None,
                         trust_remote_code: bool = False, revision: str | None = None, config: Any = None) -> tuple:
    """(model, tokenizer) to calibrate on: a `LayerwisePass` with `layerwise`, or when the weights exceed
    `max_memory` (e.g. "8GiB"), else the loaded model (under torchrun with device "cuda", each process on its own
    GPU). `config`: the model's, when `load_config` already read and checked it."""
    from transformers import AutoTokenizer

    from ..statistics.layerwise import LayerwisePass, model_bytes, parse_memory

    limit = parse_memory(max_memory) if max_memory is not None else None
    folder = Path(resolve(model))
    if not layerwise and limit is not None and folder.is_dir():
        layerwise = model_bytes(folder, DTYPES[dtype]) > limit
        if layerwise:
            logger.warning("The weights do not fit max_memory %s: calibrating layer by layer.", max_memory)
    if not layerwise:
        return load_model(model, dtype=dtype, device_map=rank_device(device), trust_remote_code=trust_remote_code,
                          revision=revision, config=config)
    if not folder.is_dir():
        raise GhostedError(f"Layer-by-layer calibration reads a local model folder; {model} is not one (download it "
                           "first, e.g. hf download).")
    # The build after calibration still loads the model (layer surgery needs every kept weight in memory).
    return LayerwisePass(folder, DTYPES[dtype], offload_folder=activations_dir), \
        AutoTokenizer.from_pretrained(folder, trust_remote_code=False)


def rank_device(device: str | None) -> str | None:
    """Under torchrun (or mpirun) with device "cuda", each process takes its own GPU (its local rank)."""
    from ..utils.distributed import init_distributed, launcher_process

    if device == "cuda" and init_distributed():
        return f"cuda:{launcher_process()[2]}"
    return device
