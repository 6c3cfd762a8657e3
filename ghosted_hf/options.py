"""The options of `ghost_prune`, defined once: the Python API validates them and the CLI is generated
from them, so the two cannot drift."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from .calibration import WEIGHTINGS
from .operators import OPERATORS
from .selection import CRITERIA

FITTINGS = ("sequential", "independent")
OPERATOR_DTYPES = ("float32", "bfloat16")


def _option(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class PruneOptions:
    num_layers: int = _option(8, "Number of decoder layers to remove (ignored with --criterion manual).")
    criterion: str = _option("ghost-aware", "How to choose the layers.", CRITERIA)
    layers: list[int] | None = _option(None, "Layer indices to remove with criterion 'manual' (dense numbering).")
    operator: str = _option("ghost", "How to recover each boundary.", OPERATORS)
    fitting: str = _option(
        "sequential",
        "With several boundaries: fit each on the model already pruned and patched before it (sequential), "
        "or all on the dense model (independent, as in the paper).",
        FITTINGS,
    )
    ridge: float = _option(1e-6, "Ridge eps relative to the mean diagonal of X^T X.")
    weighting: str = _option(
        "none", "Token weighting of the least-squares fit: none, or rms (each token divided by its RMS).", WEIGHTINGS
    )
    skip_first_tokens: int = _option(0, "Leave the first N tokens of each sequence (attention sinks) out of the fit.")
    seq_len: int = _option(512, "Calibration sequence length in tokens.")
    num_sequences: int = _option(128, "Number of calibration sequences.")
    batch_size: int = _option(4, "Calibration sequences per forward pass.")
    operator_dtype: str = _option("float32", "Storage dtype of the operators.", OPERATOR_DTYPES)
    stats_device: str | None = _option(None, "Device that accumulates the float64 statistics (default: the model's first).")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            value = getattr(self, f.name)
            if choices and value not in choices:
                raise ValueError(f"Unknown {f.name} {value!r}; choose one of: {', '.join(choices)}.")
        if self.criterion == "manual" and not self.layers:
            raise ValueError("criterion 'manual' needs the layer indices to remove (layers=[...]).")
        if self.layers and self.criterion != "manual":
            raise ValueError("layers=[...] is only used with criterion='manual'.")
        for name in ("seq_len", "num_sequences", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}.")
        if self.ridge < 0 or self.skip_first_tokens < 0:
            raise ValueError("ridge and skip_first_tokens must be >= 0.")

    @classmethod
    def build(cls, options: PruneOptions | None = None, **overrides: Any) -> PruneOptions:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"Unknown option(s) {unknown}; valid options: {sorted(known)}.")
        base = dataclasses.asdict(options) if options is not None else {}
        return cls(**{**base, **overrides})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _base_type(annotation: Any) -> Any:
    if isinstance(annotation, str):
        annotation = eval(annotation, {"list": list, "int": int, "str": str, "float": float, "None": None})
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return _base_type(args[0])
    return annotation


def add_prune_arguments(parser: argparse.ArgumentParser) -> None:
    """One `--flag` per `PruneOptions` field, with its type, default, choices and help."""
    for f in dataclasses.fields(PruneOptions):
        kind = _base_type(f.type)
        flag = "--" + f.name.replace("_", "-")
        kwargs: dict[str, Any] = {"default": f.default, "help": f.metadata["help"], "dest": f.name}
        if typing.get_origin(kind) is list:
            kwargs.update(type=typing.get_args(kind)[0], nargs="+")
        else:
            kwargs["type"] = kind
        if f.metadata.get("choices"):
            kwargs["choices"] = f.metadata["choices"]
        parser.add_argument(flag, **kwargs)


def options_from_namespace(namespace: argparse.Namespace) -> PruneOptions:
    return PruneOptions(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(PruneOptions)})
