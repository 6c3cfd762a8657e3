"""Options, defined once as dataclasses: the Python API validates them and the CLI flags are generated
from them (type, default, choices, help), so the two cannot drift."""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .errors import GhostedError, UnknownOptionError
from .fitting.operators import OPERATOR_KINDS, Folded
from .fitting.selection import CRITERIA
from .fitting.units import UNITS, unit
from .remote.format_ghosted import OPERATOR_DTYPES
from .statistics.accumulate import DEFAULT_PARTIAL_SUMS, PARTIAL_SUMS

FITTINGS = ("sequential", "independent")

T = TypeVar("T")


def option(default: Any = dataclasses.MISSING, help: str = "",
           choices: tuple[str, ...] | Callable[[], tuple[str, ...]] | None = None, *, positional: bool = False,
           required: bool = False, renamed_from: str | None = None) -> Any:
    """A dataclass field that is also a command-line option: a `--flag`, or a positional argument when it has no
    default or `positional=True`; `required=True` makes the flag mandatory on the command line. `choices` may be
    a callable, read when used (registries grow). `renamed_from`: the option's former name, still accepted (with a
    FutureWarning) by `build` and as a flag."""
    return field(default=default, metadata={"option": True, "help": help, "choices": choices, "positional": positional,
                                            "required": required, "renamed_from": renamed_from})


def option_fields(cls: Any) -> list[dataclasses.Field]:
    """The fields declared with `option` (an options class may extend a dataclass it does not own, such as
    `TrainingArguments`: its own fields are settable from Python, not flags)."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("option")]


def same_as(cls: type, name: str) -> Any:
    """A field defined as `cls`'s `name` is (default, help, choices): options that mean the same in two
    dataclasses are written once and cannot drift."""
    original = cls.__dataclass_fields__[name]
    return field(default=original.default, metadata=original.metadata)


def _choices(f: dataclasses.Field) -> tuple[str, ...] | None:
    choices = f.metadata.get("choices")
    return tuple(choices()) if callable(choices) else choices


def _base_type(annotation: Any) -> tuple[Any, bool]:
    """(the type without `| None`, whether None is allowed)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(annotation))
    return annotation, False


def _coerce(name: str, value: Any, annotation: Any) -> Any:
    """`value` checked against the field type; ints accept integer-valued numpy/torch scalars."""
    kind, optional = _base_type(annotation)
    if value is None:
        if optional:
            return None
        raise GhostedError(f"{name} must be given (got None).")
    if typing.get_origin(kind) is list:
        if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
            raise GhostedError(f"{name} must be a list, got {value!r}.")
        return [_coerce(name, v, typing.get_args(kind)[0]) for v in value]
    if kind is bool:
        if not isinstance(value, bool):
            raise GhostedError(f"{name} must be True or False, got {value!r}.")
        return value
    if kind is int:
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            raise GhostedError(f"{name} must be an integer, got {value!r} ({type(value).__name__}).")
        return int(value.__index__())
    if kind is float:
        if isinstance(value, (bool, str)) or not hasattr(value, "__float__"):
            raise GhostedError(f"{name} must be a number, got {value!r} ({type(value).__name__}).")
        value = float(value)
        if not math.isfinite(value):
            raise GhostedError(f"{name} must be a finite number, got {value}.")
        return value
    if kind is str and not isinstance(value, str):
        raise GhostedError(f"{name} must be a string, got {value!r} ({type(value).__name__}).")
    return value


class Options:
    """Base of option dataclasses: typed, checked against `choices`, built from keyword overrides."""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in option_fields(self):
            value = _coerce(f.name, getattr(self, f.name), hints[f.name])
            choices = _choices(f)
            if choices and value is not None and value not in choices:
                raise GhostedError(f"Unknown {f.name} {value!r}; choose one of: {', '.join(choices)}.")
            object.__setattr__(self, f.name, value)
        self.check()

    def check(self) -> None:
        """Rules that span several fields."""

    @classmethod
    def build(cls: type[T], options: T | None = None, **overrides: Any) -> T:
        """`options` (or the defaults) with `overrides` applied; unknown names are refused, former names renamed."""
        for f in option_fields(cls):
            old = f.metadata.get("renamed_from")
            if old in overrides:
                warnings.warn(f"The option {old} is now {f.name}; {old} will be removed in 2.0.", FutureWarning,
                              stacklevel=3)
                overrides[f.name] = overrides.pop(old)
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise UnknownOptionError(f"Unknown option(s) {unknown}; valid options: {sorted(known)}.")
        base = {name: getattr(options, name) for name in known} if options is not None else {}
        return cls(**{**base, **overrides})

    def to_dict(self) -> dict[str, Any]:
        """The options as plain values (recorded in the provenance)."""
        return dataclasses.asdict(self)


def positive(options: Options, *names: str) -> None:
    """Refuse a zero or negative value of any of the integer options `names`."""
    for name in names:
        if getattr(options, name) < 1:
            raise GhostedError(f"{name} must be positive, got {getattr(options, name)}.")


@dataclass
class PruneOptions(Options):
    """What `ghost_prune` removes and how it recovers: criterion, operator kind, fitting and calibration."""

    num_layers: int = option(8, "Number of decoder layers to remove (ignored with --criterion manual, --remove and "
                                "--num-parameters).")
    unit: str = option("layer", "What is removed: " + "; ".join(f"{u.name}: {u.help}" for u in UNITS.values()) + ".",
                       lambda: tuple(UNITS))
    remove: str | None = option(None, "How much to remove as a share of the decoder layers' parameters, net of the "
                                "operators and maps added: '25%' or 0.25. Instead of --num-layers.")
    num_parameters: int | None = option(None, "How many decoder parameters to remove, net of the operators and maps "
                                        "added. Instead of --num-layers.")
    remove_kv: str | None = option(None, "How much of the KV cache to remove, as a share of its bytes per token: '50%' "
                                   "or 0.5 (whole layers, or attention sub-blocks with unit 'subblock' or 'mixed', "
                                   "chosen by their damage per cache byte freed). Instead of --num-layers.")
    subblocks: list[str] | None = option(None, "Sub-blocks to replace with unit 'subblock' or 'mixed' and criterion "
                                         "'manual', as LAYER.KIND in dense numbering (12.attention 3.mlp).")
    criterion: str = option("ghost-aware", "How to choose the layers to remove.", lambda: tuple(CRITERIA))
    layers: list[int] | None = option(None, "Layer indices to remove with criterion 'manual' (dense numbering).")
    operator: str = option("ghost", "Operator kind that recovers each boundary.", lambda: tuple(OPERATOR_KINDS))
    fitting: str = option(
        "sequential",
        "With several boundaries: fit each on the model already pruned and patched before it (sequential), "
        "or all on the dense model (independent, as in the paper).",
        FITTINGS,
    )
    ridge: float = option(1e-6, "Ridge eps relative to the mean diagonal of the Gram matrix X^T X.")
    seq_len: int = option(512, "Calibration sequence length in tokens.")
    num_sequences: int = option(128, "Number of calibration sequences.")
    text_column: str = option("text", "Column of a dataset (data file, datasets folder, Hub id) that holds the text.")
    split: str | None = option(None, "Dataset split (None: 'train', or a folder's only split).")
    streaming: bool = option(False, "Stream a Hub or file dataset: read only the documents needed.")
    batch_size: int = option(4, "Calibration sequences per forward pass.")
    operator_dtype: str = option("float32", "Storage dtype of the operators.", OPERATOR_DTYPES)
    stats_device: str | None = option(None, "Device that accumulates the float64 statistics (None: the model's first).")
    partial_sums: str = option(DEFAULT_PARTIAL_SUMS, "Precision each chunk of tokens' products is formed in before it is added "
                               "to the float64 statistics (float32 runs at the float32 rate and chose the same layers and perplexities as "
                               "float64 on both packaged models; float64: the reference; docs/benchmarks.md).",
                               PARTIAL_SUMS)
    map_rank: str = option("full", "Rank of each sub-block's map with units 'subblock' and 'mixed': full (C x C), "
                           "auto (per sub-block the smallest rank keeping 99% of the output energy its full map explains; "
                           "the choice prices each map at its rank) or a rank such as 64 (2 C r values in place of C^2).")
    damage_sequences: int = option(16, "Calibration sequences on which units 'subblock' and 'mixed' measure each candidate's "
                                   "damage (one forward over them per candidate).")
    joint_rounds: int = option(1, "Rounds in which units 'subblock' and 'mixed' meet the budget, each round's share "
                               "chosen by damages measured beside the picks of the rounds before it (1: each "
                               "candidate's damage alone on the dense model; each round costs one more damage pass "
                               "per candidate left).")

    @property
    def budgets(self) -> list[str]:
        """The budgets given (remove, num_parameters, remove_kv): what sets how much goes, instead of num_layers."""
        return [name for name in ("remove", "num_parameters", "remove_kv") if getattr(self, name) is not None]

    @property
    def budgeted(self) -> bool:
        return bool(self.budgets)

    def check(self) -> None:
        takes_layers = CRITERIA[self.criterion].takes_layers
        unit(self.unit).check(self)
        if self.layers and not takes_layers:
            raise GhostedError(f"layers=[...] is only used with criterion='manual', not {self.criterion!r}.")
        budgets = self.budgets
        if takes_layers and budgets:
            raise GhostedError("criterion 'manual' is given what to remove: a budget (remove, num_parameters, "
                               "remove_kv) is for the criteria that choose.")
        if len(budgets) > 1:
            raise GhostedError(f"Give one budget: {' and '.join(budgets)} were given, not both.")
        for name in ("remove", "remove_kv"):
            if getattr(self, name) is not None:
                budget_share(getattr(self, name), name)
        if self.num_parameters is not None:
            positive(self, "num_parameters")
        positive(self, "damage_sequences")
        positive(self, "joint_rounds")
        check_calibration(self)


def budget_share(text: str, name: str = "remove") -> float:
    """'25%' or '0.25' as 0.25; refuses anything outside (0, 1)."""
    value = str(text).strip()
    try:
        share = float(value[:-1]) / 100 if value.endswith("%") else float(value)
    except ValueError:
        share = math.nan
    if not 0 < share < 1:
        what = "the KV cache's bytes per token" if name == "remove_kv" else "the decoder's parameters"
        raise GhostedError(f"{name} is a share of {what}, '25%' or 0.25 (above 0, below 100%), got {text!r}.")
    return share


def check_calibration(options: PruneOptions | ExportOptions) -> None:
    """The calibration options `prune` and `export-stock` share, refused alike."""
    positive(options, "seq_len", "num_sequences", "batch_size")
    if options.seq_len < 2:
        raise GhostedError(f"seq_len must be at least 2 (a token and the next), got {options.seq_len}.")
    # The ridge is relative to the mean diagonal of X^T X: at 1 or more it outweighs the average token's energy and
    # pulls every fit towards no correction at all, whatever the text.
    if not 0 <= options.ridge < 1:
        raise GhostedError(f"ridge must be at least 0 and below 1 (relative to the mean diagonal of X^T X; the default "
                           f"is 1e-6), got {options.ridge}.")
    check_device(options.stats_device)


def check_device(name: str | None) -> None:
    """Refuse a device torch does not know, or one this machine does not have, before any work."""
    if name is None:
        return
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as error:
        raise GhostedError(f"stats_device {name!r} is not a device torch knows ({error}); use e.g. cpu, cuda, "
                           "cuda:1.") from None
    if device.type == "meta":
        raise GhostedError(f"stats_device {name!r} holds no values: the sums need a real device (cpu, cuda, ...).")
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise GhostedError(f"stats_device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s).")


@dataclass
class ExportOptions(Options):
    """How `export_stock` refits an existing ghosted model's operators as foldable ones."""

    operator: str = option("folded", "Foldable operator kind that imitates each ghost operator.",
                           lambda: tuple(name for name, kind in OPERATOR_KINDS.items() if isinstance(kind, Folded)))
    ridge: float = same_as(PruneOptions, "ridge")
    seq_len: int = same_as(PruneOptions, "seq_len")
    num_sequences: int = same_as(PruneOptions, "num_sequences")
    batch_size: int = same_as(PruneOptions, "batch_size")
    text_column: str = same_as(PruneOptions, "text_column")
    split: str | None = same_as(PruneOptions, "split")
    streaming: bool = same_as(PruneOptions, "streaming")
    stats_device: str | None = same_as(PruneOptions, "stats_device")
    partial_sums: str = same_as(PruneOptions, "partial_sums")

    def check(self) -> None:
        check_calibration(self)


def add_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One argument per `option` field of dataclass `cls`, with its type, default, choices and help."""
    hints = typing.get_type_hints(cls)
    for f in option_fields(cls):
        kind, _ = _base_type(hints[f.name])
        kwargs: dict[str, Any] = {"help": f.metadata["help"].replace("%", "%%")}  # argparse formats help with %
        if _choices(f):
            kwargs["choices"] = _choices(f)
        if kind is bool:
            kwargs["action"] = "store_true"
        elif typing.get_origin(kind) is list:
            kwargs.update(type=typing.get_args(kind)[0], nargs="+")
        else:
            kwargs["type"] = kind
        if f.default is dataclasses.MISSING:
            parser.add_argument(f.name, **kwargs)
        elif f.metadata.get("positional"):
            parser.add_argument(f.name, nargs="?", default=f.default, **kwargs)
        else:
            old = f.metadata.get("renamed_from")
            flags = ["--" + name.replace("_", "-") for name in (f.name, old) if name]
            parser.add_argument(*flags, dest=f.name, default=f.default, required=f.metadata["required"], **kwargs)


def from_namespace(cls: type[T], namespace: argparse.Namespace) -> T:
    """An instance of dataclass `cls` from the parsed arguments `add_arguments` declared."""
    return cls(**{f.name: getattr(namespace, f.name) for f in option_fields(cls)})
