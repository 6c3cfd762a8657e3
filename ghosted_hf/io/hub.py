"""Push a saved ghosted model (weights, remote code, card) to the Hugging Face Hub with huggingface_hub.

A verified private copy of the folder is uploaded in one commit (what changes in the folder meanwhile is not sent),
and a second commit pins the first in the card's code sample. Pulling needs no code of ours (trust_remote_code).
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import HfApi, ModelCard, get_token
from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

from ..errors import GhostedError
from ..model.checkpoint import made_as
from ..remote.configuration_ghosted import GhostedConfig
from ..utils.diskio import check_shape
from ..utils.network import bounded_network, check_timeout
from .card import PLOT_FILE, build_card, save_with_card
from .files import REMOTE_FILES, verify_folder

logger = logging.getLogger(__name__)

@dataclass
class PushResult:
    """What `push_to_hub` made: the commit of the weights and code (the revision to pin), and the card's."""

    commit: str
    commit_url: str
    card_commit: str | None


def check_ghosted_folder(folder: Path) -> dict[str, Any]:
    """The folder's config, or a GhostedError saying why it is not a complete, intact ghosted model."""
    config = verify_folder(folder)
    if made_as(config) != "ghosted":
        raise GhostedError(f"{folder} holds a {config.get('model_type')!r} model, not a ghosted one; push it with "
                           "huggingface_hub directly.")
    if "auto_map" not in config:
        raise GhostedError(f"{folder}/config.json has no auto_map: it would not load with trust_remote_code.")
    check_shape(config["auto_map"], {"AutoConfig": str, "AutoModelForCausalLM": str}, f"{folder}/config.json: auto_map")
    missing = [f for f in (*remote_code_files(folder, config["auto_map"]), "README.md") if not (folder / f).is_file()]
    if missing:
        raise GhostedError(f"{folder} lacks {missing}; save it with ghosted_hf.save_with_card(model, folder).")
    return config


def remote_code_files(folder: Path, auto_map: dict[str, Any]) -> list[str]:
    """The code files loading `folder` with trust_remote_code needs: those its auto_map names and, from each, those
    it imports relatively (as transformers fetches them); a folder saved by an older ghosted_hf has fewer."""
    from transformers.dynamic_module_utils import get_relative_imports

    needed, queue = set(), [f"{entry.split('.')[0]}.py" for entry in auto_map.values() if isinstance(entry, str)]
    while queue:
        name = queue.pop()
        if name in needed:
            continue
        needed.add(name)
        if (folder / name).is_file():
            queue += [f"{module}.py" for module in get_relative_imports(folder / name)]
    return sorted(needed)


# Files a saved ghosted model holds besides its weights: what save_with_card writes (the tokenizer's files too).
MODEL_FOLDER_FILES = ("config.json", "generation_config.json", "README.md", "NOTICE", PLOT_FILE, *REMOTE_FILES,
                      "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                      "chat_template.jinja", "chat_template.json", "vocab.json", "vocab.txt", "merges.txt",
                      "tokenizer.model")


def announce_extra_files(folder: Path) -> list[str]:
    """Refuse a folder holding a symbolic link whose target lies outside it (pushing would upload that file's
    content: a token, say); log every file that will be uploaded beyond the model's own, and return them."""
    root = folder.resolve()
    leaving, extra = [], []
    for parent, dirs, files in os.walk(folder):
        for name in (*dirs, *files):
            path = Path(parent) / name
            relative = str(path.relative_to(folder))
            if path.is_symlink() and not path.resolve().is_relative_to(root):
                leaving.append(f"{relative} -> {os.readlink(path)}")
            elif name in files and relative not in MODEL_FOLDER_FILES and not fnmatch.fnmatch(relative, "model*.safetensors*"):
                extra.append(relative)
    if leaving:
        raise GhostedError(f"{folder} holds symbolic links to files outside it, whose content would be uploaded: "
                           f"{', '.join(leaving)}. Remove them, or copy what they point to into the folder.")
    if extra:
        logger.warning("Uploading %d file(s) besides the model's own: %s", len(extra), ", ".join(sorted(extra)))
    return sorted(extra)


def push_to_hub(
    model_or_folder: Any,
    repo_id: str,
    *,
    tokenizer: Any = None,
    private: bool = False,
    revision: str | None = None,
    token: str | None = None,
    commit_message: str = "Upload ghosted model (ghosted_hf)",
    overwrite_other_model: bool = False,
    endpoint: str | None = None,
    timeout: float = 60.0,
) -> PushResult:
    """Upload a ghosted model (a `GhostedForCausalLM` or a folder saved with `save_with_card`) to `repo_id`
    at branch `revision` (created if needed), exactly as verified. `endpoint` selects another Hub deployment
    (default: $HF_ENDPOINT or huggingface.co); `timeout` bounds every wait for an answer from it (seconds)."""
    token = token or get_token()
    if not token:
        raise GhostedError("No Hugging Face token: run `hf auth login`, set HF_TOKEN, or pass token=...")
    check_timeout(timeout)
    api = HfApi(endpoint=endpoint, token=token)
    with tempfile.TemporaryDirectory() as staging:
        folder = Path(staging) / "model"
        if isinstance(model_or_folder, (str, Path)):
            if not Path(model_or_folder).is_dir():
                raise GhostedError(f"{model_or_folder} is not a folder; save the model with save_with_card first.")
            announce_extra_files(Path(model_or_folder))  # refuses links that leave the folder
            shutil.copytree(model_or_folder, folder)  # the bytes verified below are the bytes sent
        else:
            save_with_card(model_or_folder, folder, tokenizer=tokenizer, repo_id=repo_id)
        try:
            check_ghosted_folder(folder)
        except GhostedError as error:  # name what the user gave, not the staging copy that is gone afterwards
            source = str(model_or_folder) if isinstance(model_or_folder, (str, Path)) else "the model"
            raise GhostedError(str(error).replace(str(folder), source)) from None
        try:
            with bounded_network(timeout):
                return _upload(api, folder, repo_id, private, revision, commit_message, overwrite_other_model)
        except Exception as error:
            # No answer (offline mode, failed connections): httpx and its successors name it TransportError.
            if not isinstance(error, OSError) and all(c.__name__ != "TransportError" for c in type(error).__mro__):
                raise
            raise GhostedError(f"Cannot reach the Hub at {api.endpoint} to push {repo_id}, or it did not answer "
                               f"within {timeout:g} s ({type(error).__name__}: {error}); check the network, "
                               "HF_ENDPOINT and HF_HUB_OFFLINE, then push again.") from None


def _upload(api: HfApi, folder: Path, repo_id: str, private: bool, revision: str | None, commit_message: str,
            overwrite_other_model: bool) -> PushResult:
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    try:
        remote = json.loads(Path(api.hf_hub_download(repo_id, "config.json", revision=revision)).read_text())
    except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError):
        remote = {}  # a new or empty repo
    existing = remote.get("model_type")
    if existing not in (None, "ghosted") and not overwrite_other_model:
        raise GhostedError(f"{repo_id} already holds a {existing!r} model; choose another repo id or pass "
                           "overwrite_other_model=True.")
    if revision is not None:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, revision=revision, commit_message=commit_message)
    pinned = build_card(GhostedConfig.from_pretrained(folder), repo_id=repo_id, revision=info.oid,  # license kept
                        license=ModelCard.load(folder / "README.md").data.license,
                        plot=PLOT_FILE if (folder / PLOT_FILE).is_file() else None)
    card = api.upload_file(path_or_fileobj=str(pinned).encode(), path_in_repo="README.md", repo_id=repo_id,
                           revision=revision, commit_message=f"Model card: pin revision {info.oid}")
    logger.info("Pushed %s to %s", folder, info.commit_url)
    return PushResult(commit=info.oid, commit_url=info.commit_url, card_commit=getattr(card, "oid", None))
