"""What statistics were made from: a model's fingerprint (config and weight hashes), checked before
statistics collected elsewhere are used on a model."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..assets import file_sha256
from ..errors import GhostedError
from .store import CalibrationStatistics


def config_sha256(config: Any) -> str:
    """Hash of a model config without what does not change the model (paths, versions, dtype, attention kernel)."""
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    ignored = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache", "_attn_implementation",
               "_attn_implementation_autoset", "output_attentions", "output_hidden_states", "return_dict"}
    kept = {k: v for k, v in raw.items() if k not in ignored}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()


def weight_hashes(folder: str | Path) -> dict[str, str]:
    """sha256 of every safetensors weight file of a model folder."""
    return {p.name: file_sha256(p) for p in sorted(Path(folder).glob("*.safetensors"))}


def model_fingerprint(model: nn.Module | None = None, folder: str | Path | None = None,
                      config: Any = None) -> dict[str, Any]:
    """The config hash and the weight files' hashes (the in-memory weights' hash for a model without a folder)."""
    config = config if config is not None else model.config
    if folder is None:
        candidate = getattr(config, "_name_or_path", "") or ""
        folder = candidate if candidate and Path(candidate).is_dir() and any(Path(candidate).glob("*.safetensors")) \
            else None
    if folder is not None:
        weights = weight_hashes(folder)
    else:
        digest = hashlib.sha256()
        for name, tensor in sorted(model.state_dict().items()):
            if tensor.device.type != "meta":
                digest.update(name.encode())
                digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        weights = {"in-memory": digest.hexdigest()}
    return {"config_sha256": config_sha256(config), "weights_sha256": weights}


def check_same_model(stats: CalibrationStatistics, fingerprint: dict[str, Any], what: str = "the statistics") -> None:
    """Refuse statistics that do not say which model they come from, or that come from another one (another
    config, depth or weights; the weights are compared where both sides record them)."""
    recorded = stats.origin.get("model") or {}
    if not recorded.get("config_sha256"):
        raise GhostedError(f"{what} do not record the model they were collected on: collect them with "
                           "ghosted_hf.calibrate or `ghosted stats collect` (or collect_statistics), which record it.")
    if recorded.get("config_sha256") != fingerprint["config_sha256"]:
        raise GhostedError(f"{what} were collected on a model with another config (config hash "
                           f"{recorded.get('config_sha256', '?')[:12]} vs {fingerprint['config_sha256'][:12]}): collect "
                           "statistics on this model, or pass the model they were collected on.")
    if "weights_sha256" in recorded and recorded["weights_sha256"] != fingerprint["weights_sha256"]:
        raise GhostedError(f"{what} were collected on the same architecture but other weights "
                           f"({recorded.get('weights_sha256')} vs {fingerprint['weights_sha256']}): collect statistics "
                           "on this model's weights.")
