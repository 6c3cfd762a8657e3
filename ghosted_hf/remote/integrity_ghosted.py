"""What makes a ghosted checkpoint trustworthy: every operator finite in its storage dtype and the very bytes whose
sha256 config.json records (hashes refreshed on every save), and a loaded checkpoint refused, naming each problem, where
it does not match its config. Copied next to the weights with the model code; imports only torch and the standard
library."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .format_ghosted import (GHOST_MODULE, OPERATOR_DTYPES, decoder_paths, ghost_records, ghost_tensor_keys,
                             operator_sha256, required_format_version)


def operator_value_problems(model: nn.Module, require_hashes: bool = False) -> list[str]:
    """What is wrong with the operators' values: non-finite in the storage dtype, not the bytes whose
    sha256 config.json records, or (with `require_hashes`, as for a loaded checkpoint) no sha256 recorded
    at all. Empty when they are sound."""
    problems = []
    storage = model.config.operator_dtype
    paths = decoder_paths(model.config)
    recorded = {key: b.get(field) for b in ghost_records(model.config)
                for field, key in ghost_tensor_keys(b, paths).items()}
    for name, operator in model.ghost_operators().items():
        if operator.device.type == "meta":  # offloaded (device_map with disk or CPU offload): read it back
            operator = _offloaded_value(model, name)
            if operator is None:
                problems.append(f"operator {name} is offloaded where it cannot be read back to verify it")
                continue
        # In the storage dtype: a value finite in a wider checkpoint dtype (1e300) may not be once stored.
        stored = operator.detach().to(getattr(torch, storage))
        if not (torch.isfinite(operator).all() and torch.isfinite(stored).all()):
            problems.append(f"operator {name} holds NaN or Inf values (as {storage})")
        elif not recorded.get(name):
            if require_hashes:
                problems.append(f"operator {name} has no sha256 in config.json, so it cannot be verified "
                                "(re-save the model with save_pretrained, or pass verify_operator_hashes=False "
                                "to load it unverified)")
        elif operator_sha256(stored, storage) != recorded[name]:
            problems.append(
                f"operator {name} does not match the sha256 recorded for it in config.json "
                "(the tensor was altered, or config.json comes from another save)"
            )
    return problems


def refresh_integrity(model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """Make `config.operator_dtype` and each boundary's `sha256` describe the tensors about to be saved."""
    operators = model.ghost_operators()
    if state_dict is not None:
        operators = {name: state_dict.get(name, operator) for name, operator in operators.items()}
    dtypes = {str(op.dtype).removeprefix("torch.") for op in operators.values()}
    if len(dtypes) > 1 or not dtypes <= set(OPERATOR_DTYPES):
        found = ", ".join(f"{name}: {str(op.dtype).removeprefix('torch.')}" for name, op in operators.items())
        raise ValueError(
            f"Cannot save ghost operators as {found}: they must all be one of {', '.join(OPERATOR_DTYPES)}. "
            "Cast them back first, e.g. `for op in model.ghost_operators().values(): op.data = op.data.float()`."
        )
    if dtypes:
        model.config.operator_dtype = dtypes.pop()
    def hashed(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        records = [dict(record) for record in records]
        for record in records:
            for field, name in ghost_tensor_keys(record, decoder_paths(model.config)).items():
                operator = operators[name]
                if operator.device.type == "meta":  # offloaded: hash the value its hook reads back
                    operator = _offloaded_value(model, name)
                    if operator is None:
                        raise ValueError(f"Cannot save {name}: it is offloaded where it cannot be read back. "
                                         "Load the model without offloading the operators to save it.")
                record[field] = operator_sha256(operator, model.config.operator_dtype)
        return records

    model.config.ghost_boundaries = hashed(model.config.ghost_boundaries)
    model.config.ghost_subblocks = hashed(model.config.ghost_subblocks)
    model.config.ghost_format_version = required_format_version(model.config.ghost_boundaries,
                                                               model.config.ghost_subblocks, model.config.ghost_layout)


def check_loaded(model: nn.Module, info: dict[str, Any], verify: bool, ignore_mismatched: bool) -> None:
    """Refuse a loaded checkpoint that does not match its config.json: a ghost tensor or base weight missing, an
    unexpected ghost tensor, a tensor of the wrong shape, or an operator whose value is not sound or not the bytes
    recorded; each named (`info`: from_pretrained's loading info). Nothing is ever filled in instead."""
    problems = []
    missing = sorted(info.get("missing_keys", ()))  # a base weight too: it would be left randomly initialised
    if [k for k in missing if f".{GHOST_MODULE}." in k]:
        problems.append(f"operator tensors missing from the checkpoint: {[k for k in missing if f'.{GHOST_MODULE}.' in k]}")
    if [k for k in missing if f".{GHOST_MODULE}." not in k]:
        problems.append(f"weights missing from the checkpoint: {[k for k in missing if f'.{GHOST_MODULE}.' not in k]}")
    unexpected = sorted(k for k in info.get("unexpected_keys", ()) if f".{GHOST_MODULE}." in k)
    if unexpected:
        problems.append(f"operator tensors in the checkpoint that the config has no boundary for: {unexpected}")
    mismatched = [
        _describe_mismatch(entry)
        for entry in info.get("mismatched_keys", ())
        if f".{GHOST_MODULE}." in _mismatch_key(entry) or not ignore_mismatched
    ]
    if mismatched:
        problems.append(f"tensors of the wrong shape: {mismatched}")
    problems += operator_value_problems(model, require_hashes=verify)
    if problems:
        base_missing = [k for k in missing if f".{GHOST_MODULE}." not in k]
        stored = info.get("unexpected_keys", ())
        # The same layers stored in another layout (experts one by one where the model fuses them, other
        # module names): a conversion this transformers applies to the family's own models, not to a nested one.
        relayout = bool(base_missing) and all(
            any(u.startswith(".".join(k.split(".")[:3]) + ".") for u in stored) for k in base_missing)
        raise ValueError(
            "This ghosted checkpoint does not match its config.json: "
            + "; ".join(problems)
            + (". The checkpoint holds these modules in the layout the family's checkpoints use, which this "
               "transformers converts for the family's own models only: load it with a transformers that "
               "converts nested models too (4.57, or 5.10 and later)" if relayout else
               ". Re-export it with save_pretrained from the model that produced it; an operator is never "
               "replaced by identity or random values.")
        )


def _mismatch_key(entry: Any) -> str:
    # `output_loading_info` lists a shape mismatch as (key, checkpoint shape, model shape) in 5.x, as the bare
    # key in 4.x.
    return entry if isinstance(entry, str) else entry[0]


def _describe_mismatch(entry: Any) -> str:
    if not isinstance(entry, str) and len(entry) == 3:
        key, saved, expected = entry
        return f"{key} (checkpoint {tuple(saved)}, config {tuple(expected)})"
    return f"{_mismatch_key(entry)} (checkpoint shape differs from the config's)"




def _offloaded_value(model: nn.Module, name: str) -> torch.Tensor | None:
    """The value of the offloaded ghost tensor `name`, through the weights map accelerate's hook on its module
    reads from (None when there is no such map)."""
    module_name, _, param = name.rpartition(".")
    weights = getattr(getattr(model.get_submodule(module_name), "_hf_hook", None), "weights_map", None)
    try:
        return weights[param] if weights is not None else None
    except KeyError:
        return None
