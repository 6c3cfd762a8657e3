"""Push a saved ghosted model (weights, remote code, card) to the Hugging Face Hub with huggingface_hub.

Pulling needs no code of ours: ``AutoModelForCausalLM.from_pretrained(repo_id, trust_remote_code=True,
revision=...)``, where `revision` pins both the weights and the remote code.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from huggingface_hub import HfApi, get_token
from huggingface_hub.errors import EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

from .card import save_with_card
from .errors import GhostedError

logger = logging.getLogger(__name__)

REMOTE_FILES = ("configuration_ghosted.py", "modeling_ghosted.py")


def check_ghosted_folder(folder: Path) -> dict[str, Any]:
    """The folder's config, or a ValueError saying why it is not a complete ghosted model."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise GhostedError(f"{folder} is not a saved model folder (no config.json).")
    config = json.loads(config_path.read_text())
    if config.get("model_type") != "ghosted":
        raise GhostedError(f"{folder} holds a {config.get('model_type')!r} model, not a ghosted one; push it with "
                         "huggingface_hub directly.")
    missing = [f for f in (*REMOTE_FILES, "model.safetensors", "README.md") if not (folder / f).is_file()]
    if missing:
        raise GhostedError(f"{folder} lacks {missing}; save it with ghosted_hf.save_with_card(model, folder).")
    if "auto_map" not in config:
        raise GhostedError(f"{folder}/config.json has no auto_map: it would not load with trust_remote_code.")
    return config


def _remote_model_type(api: HfApi, repo_id: str, revision: str | None) -> str | None:
    """model_type of the config.json already in the repo, or None for a new or empty repo."""
    try:
        path = api.hf_hub_download(repo_id, "config.json", revision=revision)
    except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError):
        return None
    return json.loads(Path(path).read_text()).get("model_type")


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
) -> str:
    """Upload a ghosted model (a `GhostedForCausalLM` or a folder saved with `save_with_card`) to `repo_id`
    at branch `revision` (created if needed); returns the commit URL. `endpoint` selects another Hub
    deployment (default: $HF_ENDPOINT or huggingface.co)."""
    token = token or get_token()
    if not token:
        raise GhostedError("No Hugging Face token: run `hf auth login`, set HF_TOKEN, or pass token=...")
    api = HfApi(endpoint=endpoint, token=token)
    with tempfile.TemporaryDirectory() as staging:
        if isinstance(model_or_folder, (str, Path)):
            folder = Path(model_or_folder)
        else:
            folder = save_with_card(model_or_folder, staging, tokenizer=tokenizer, repo_id=repo_id)
        check_ghosted_folder(folder)
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        existing = _remote_model_type(api, repo_id, revision)
        if existing not in (None, "ghosted") and not overwrite_other_model:
            raise GhostedError(f"{repo_id} already holds a {existing!r} model; choose another repo id or pass "
                             "overwrite_other_model=True.")
        if revision is not None:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, revision=revision,
                                 commit_message=commit_message)
    logger.info("Pushed %s to %s", folder, info.commit_url)
    return info.commit_url
