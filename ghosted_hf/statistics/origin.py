"""What statistics were made from: a model's fingerprint (config and weight hashes), checked before
statistics collected elsewhere are used on a model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import GhostedError
from ..utils.hashing import json_sha256, tensors_sha256
from .store import CalibrationStatistics


def config_sha256(config: Any) -> str:
    """Hash of a model config without what does not change the model (paths, versions, dtype, attention kernel)."""
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    ignored = {"_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache", "_attn_implementation",
               "_attn_implementation_autoset", "output_attentions", "output_hidden_states", "return_dict"}
    return json_sha256({k: v for k, v in raw.items() if k not in ignored})


def folder_tensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a model folder's safetensors files, one at a time."""
    from safetensors import safe_open

    from ..model.checkpoint import weight_map

    for file in sorted(set(weight_map(folder).values())):
        with safe_open(str(folder / file), framework="pt") as handle:
            for key in handle.keys():
                yield key, handle.get_tensor(key)


def model_fingerprint(model: nn.Module | None = None, folder: str | Path | None = None,
                      config: Any = None) -> dict[str, Any]:
    """The config hash and the weights' hash: of the folder's tensors when the model was loaded from one (what the
    files hold, before any dtype the load chose), else of the model's state dict."""
    config = config if config is not None else model.config
    if folder is None and (name := getattr(config, "_name_or_path", "")) and any(Path(name).glob("*.safetensors")):
        folder = name
    if folder is not None:
        weights = {"tensors": tensors_sha256(folder_tensors(Path(folder)))}
    else:
        weights = {"in-memory": tensors_sha256((name, tensor) for name, tensor in model.state_dict().items()
                                               if tensor.device.type != "meta")}
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
