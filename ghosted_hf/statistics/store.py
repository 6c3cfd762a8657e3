"""The statistics container, its file format, and the merge of shards.

A file is a safetensors file of float64 tensors named by their entries (``gram.3``, ``cross.3.7``) with metadata:
format, version, depth, hidden size, tokens, rotation of rotated sums, every tensor's sha256, and the origin (model,
data, plan, shard) that merge and `ghost_prune(statistics=...)` check. Version 2 adds ``integrity``, one sha256 over
every other field: none can be changed, added or removed unseen.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ..errors import GhostedError, MissingFileError
from ..utils.diskio import atomic_write
from ..utils.inputs import note_read
from ..utils.hashing import json_sha256, tensor_sha256
from .declarations import (ABS, ANGULAR, COSINE, CROSS, ENERGY, GRAM, MLP_GRAM, MLP_SOURCE, MLP_TARGET, NORMED_CROSS,
                           NORMED_GRAM, NORMED_SOURCE, ROTATED_ABS, Entry, parse_key)
from .plan import StatisticsPlan

FORMAT = "ghosted-statistics"
FORMAT_VERSION = "2"
ROTATION_KINDS = re.compile(r"none|hadamard|random-orthogonal\(seed=-?\d+\)")


@dataclass(frozen=True)
class ShardSpec:
    """Shard `index` of `count`: every count-th calibration batch, starting at batch `index`."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise GhostedError(f"Shard {self.index}/{self.count} does not exist: use I/N with 0 <= I < N (e.g. 0/3, 1/3, "
                               "2/3).")

    @classmethod
    def parse(cls, text: str) -> ShardSpec:
        index, slash, count = str(text).partition("/")
        if not slash or not index.strip().isdigit() or not count.strip().isdigit():
            raise GhostedError(f"Shard {text!r} is not of the form I/N (e.g. 0/3 for the first of three shards).")
        return cls(int(index), int(count))

    def take(self, items: list) -> list:
        return items[self.index::self.count]

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


@dataclass
class CalibrationStatistics:
    """Float64 sums over calibration tokens, keyed by entry (see `declarations`)."""

    tensors: dict[str, torch.Tensor]
    depth: int
    hidden_size: int
    tokens: int
    rotation_kind: str = "none"  # the Hadamard construction of ROTATED_ABS sums, "none" without them
    # What the sums were made from: "model" (model_fingerprint), "data" (token hash), "plan" (StatisticsPlan
    # JSON), "shard" ("I/N"); merge compares them.
    origin: dict[str, Any] = dataclasses.field(default_factory=dict)

    # ------------------------------------------------------------ reading

    def __getitem__(self, entry: Entry) -> torch.Tensor:
        if entry.key not in self.tensors:
            raise GhostedError(f"These statistics hold no {entry.statistic.what} ({entry.key}); collect them with a "
                               "plan that includes it.")
        return self.tensors[entry.key]

    def holds(self, *entries: Entry) -> bool:
        return all(e.key in self.tensors for e in entries)

    def gram(self, i: int) -> torch.Tensor:
        return self[GRAM(i)]

    def cross(self, s: int, e: int) -> torch.Tensor:
        return self[CROSS(s, e)]

    def energy(self, s: int, e: int) -> float:
        return float(self[ENERGY(s, e)])

    def has_pair(self, s: int, e: int) -> bool:
        """Whether the least-squares statistics of (s, e) are here (the fit figures need them)."""
        return self.holds(GRAM(s), CROSS(s, e), ENERGY(s, e))

    def mlp_terms(self, s: int, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(M^T M, M^T X_s, M^T X_e) for the MLP output M of layer s-1."""
        return self[MLP_GRAM(s)], self[MLP_SOURCE(s)], self[MLP_TARGET(s, e)]

    def normed_terms(self, s: int, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(N^T N, N^T X_s, N^T X_e) for the normalised stream N = n(X_s)."""
        return self[NORMED_GRAM(s)], self[NORMED_SOURCE(s)], self[NORMED_CROSS(s, e)]

    def mean_cosine(self, s: int, e: int) -> float:
        return float(self[COSINE(s, e)]) / self.tokens

    def mean_angular(self, s: int, e: int) -> float:
        return float(self[ANGULAR(s, e)]) / self.tokens

    def abs_mean(self, i: int) -> torch.Tensor:
        return self[ABS(i)] / self.tokens

    def rotated_abs_mean(self, i: int) -> torch.Tensor:
        return self[ROTATED_ABS(i)] / self.tokens

    def extended(self, values: Mapping[Entry, torch.Tensor]) -> CalibrationStatistics:
        """A copy holding `values` too (statistics derived exactly from these, e.g. those of a target X W)."""
        return dataclasses.replace(self, tensors={**self.tensors, **{e.key: v for e, v in values.items()}})

    def with_tensors(self, other: CalibrationStatistics) -> CalibrationStatistics:
        """These statistics updated with `other`'s (same calibration tokens; `other` wins on shared keys)."""
        if other.tokens != self.tokens or other.depth != self.depth:
            raise GhostedError(
                f"Cannot combine statistics of {self.tokens} and {other.tokens} tokens: they come from different "
                "calibration data (pass the same text, sequence length and number of sequences)."
            )
        rotation_kind = other.rotation_kind if other.rotation_kind != "none" else self.rotation_kind
        origin = {**other.origin, **self.origin}  # the model's full fingerprint, where these hold it, stays
        if "plan" in self.origin and "plan" in other.origin:
            origin["plan"] = (StatisticsPlan.from_json(self.origin["plan"])
                              | StatisticsPlan.from_json(other.origin["plan"])).to_json()
        precisions = {o["partial_sums"] for o in (self.origin, other.origin) if "partial_sums" in o}
        if len(precisions) > 1:  # sums formed in both precisions: say so, not one of them
            origin["partial_sums"] = " and ".join(sorted(precisions))
        return dataclasses.replace(self, tensors={**self.tensors, **other.tensors}, rotation_kind=rotation_kind,
                                   origin=origin)

    # ------------------------------------------------------------ files

    def save(self, path: str | Path) -> None:
        """Write to a safetensors file (all or nothing), to try other selections or operators without another
        pass."""
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.tensors.items()}
        metadata = {
            "format": FORMAT, "version": FORMAT_VERSION, "depth": str(self.depth),
            "hidden_size": str(self.hidden_size), "tokens": str(self.tokens), "rotation_kind": self.rotation_kind,
            "origin": json.dumps(self.origin, sort_keys=True),
            "sha256": json.dumps({k: tensor_sha256(v) for k, v in tensors.items()}, sort_keys=True),
        }
        metadata["integrity"] = metadata_sha256(metadata)
        atomic_write(path, lambda staged: save_file(tensors, str(staged), metadata=metadata))

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu") -> CalibrationStatistics:
        """Read a file written by `save`, every tensor checked against the shape and hash it claims."""
        header, hashes = _read_header(path)
        tensors = load_file(str(path), device=str(device))
        for key, tensor in tensors.items():
            expected = parse_key(key).statistic.shape(header.hidden_size)
            if tuple(tensor.shape) != expected or tensor.dtype != torch.float64:
                raise GhostedError(f"{path}: tensor {key} is {tensor.dtype} {tuple(tensor.shape)}, not float64 "
                                   f"{expected}: the file is damaged or was not written by ghosted_hf.")
            if tensor_sha256(tensor) != hashes.get(key):
                raise GhostedError(f"{path}: tensor {key} does not match the sha256 recorded for it: the file was "
                                   "altered or damaged; collect the statistics again.")
            check_sums(key, tensor, path)
        return dataclasses.replace(header, tensors=tensors)

    @classmethod
    def load_header(cls, path: str | Path) -> CalibrationStatistics:
        """The file's metadata and tensor names, without the tensors (their values are None)."""
        return _read_header(path)[0]

    # ------------------------------------------------------------ shards

    @classmethod
    def merge(cls, shards: Iterable[CalibrationStatistics | str | Path]) -> CalibrationStatistics:
        """The sums of shards 0/N .. N-1/N of one calibration set: the statistics of the whole set. Files are
        checked from their headers first, then read and summed one at a time (memory: two shards' tensors)."""
        shards = list(shards)
        names = [str(s) if isinstance(s, (str, Path)) else f"shard #{k}" for k, s in enumerate(shards)]
        headers = [cls.load_header(s) if isinstance(s, (str, Path)) else s for s in shards]
        count = check_shards(headers, names)
        loaded = (cls.load(shard) if isinstance(shard, (str, Path)) else shard for shard in shards)
        first = next(loaded)
        merged = dataclasses.replace(first, tensors={k: v.double().clone() for k, v in first.tensors.items()})
        merged.origin = {k: v for k, v in first.origin.items() if k != "shard"} | {"merged_shards": count}
        for shard in loaded:
            for key, value in shard.tensors.items():
                merged.tensors[key] += value
            merged.tokens += shard.tokens
        return merged


def metadata_sha256(metadata: Mapping[str, str]) -> str:
    """One hash over every metadata field but itself (the tensors' sha256 map is one of them)."""
    return json_sha256({k: v for k, v in metadata.items() if k != "integrity"})


def _read_header(path: str | Path) -> tuple[CalibrationStatistics, dict[str, str]]:
    note_read(path, "statistics file")
    if not Path(path).is_file():
        raise MissingFileError(f"Statistics file {path} does not exist (or is not a file).")
    try:
        with safe_open(str(path), framework="pt") as handle:
            meta, keys = handle.metadata() or {}, list(handle.keys())
    except (SafetensorError, OSError) as error:
        raise GhostedError(f"{path} is not a readable safetensors file ({error}): pass a file written by "
                           "`ghosted stats collect` or CalibrationStatistics.save.") from None
    if meta.get("format") != FORMAT or meta.get("version") != FORMAT_VERSION:
        raise GhostedError(f"{path} is not a ghosted_hf statistics file of version {FORMAT_VERSION} (format "
                           f"{meta.get('format')!r}, version {meta.get('version')!r}): collect the statistics again.")
    if meta.get("integrity") != metadata_sha256(meta):
        raise GhostedError(f"{path}: the metadata does not match its integrity hash: a field was changed, added or "
                           "removed after the file was written; collect the statistics again.")

    def field(name: str, parse: Callable[[str], Any], valid: Callable[[Any], bool], what: str) -> Any:
        try:
            value = parse(meta[name])
        except (KeyError, ValueError, TypeError, RecursionError):
            value = None
        if value is None or not valid(value):
            raise GhostedError(f"{path}: metadata field {name!r} should hold {what}, and holds {meta.get(name)!r}: the "
                               "file is damaged; collect the statistics again.")
        return value

    positive_int = (int, lambda v: v >= 1, "a positive integer")
    depth, hidden_size, tokens = (field(name, *positive_int) for name in ("depth", "hidden_size", "tokens"))
    rotation_kind = field("rotation_kind", str, ROTATION_KINDS.fullmatch, "none, hadamard or random-orthogonal(seed=N)")
    origin = field("origin", json.loads, lambda v: isinstance(v, dict), "a JSON object")
    hashes = field("sha256", json.loads, lambda v: isinstance(v, dict) and all(isinstance(h, str) for h in v.values()),
                   "a JSON object of tensor sha256s")
    if "shard" in origin:
        field("origin", lambda text: ShardSpec.parse(json.loads(text)["shard"]), bool, "a shard of the form I/N")
    for key in keys:
        try:
            entry = parse_key(key)
        except GhostedError as error:
            raise GhostedError(f"{path}: {error}") from None
        if max(entry.index, default=0) > depth:
            raise GhostedError(f"{path}: tensor {key} names a layer beyond the depth {depth} the file records: the "
                               "file is damaged; collect the statistics again.")
    missing = sorted(set(keys) - set(hashes))
    if missing:
        raise GhostedError(f"{path}: no sha256 recorded for {missing}: the file was altered; collect it again.")
    return CalibrationStatistics(tensors=dict.fromkeys(keys), depth=depth, hidden_size=hidden_size, tokens=tokens,
                                 rotation_kind=rotation_kind, origin=origin), hashes


def check_sums(key: str, tensor: torch.Tensor, path: str | Path) -> None:
    """What every sum of calibration tokens satisfies: finite, and a Gram matrix symmetric with a nonnegative
    diagonal and no entry beyond the Cauchy-Schwarz bound sqrt(G_ii G_jj) (necessary for positive
    semidefiniteness, checked in O(C^2) rather than an eigendecomposition)."""
    if not bool(torch.isfinite(tensor).all()):
        raise GhostedError(f"{path}: tensor {key} holds NaN or Inf: collect the statistics again.")
    if parse_key(key).statistic not in (GRAM, MLP_GRAM, NORMED_GRAM):
        return
    diagonal = torch.diagonal(tensor)
    bound = torch.sqrt(diagonal.clamp(min=0)[:, None] * diagonal.clamp(min=0)[None, :])
    scale = float(diagonal.abs().max()) if diagonal.numel() else 0.0
    tolerance = 1e-9 * scale + math.ulp(1.0)
    if (bool((diagonal < 0).any()) or float((tensor - tensor.T).abs().max()) > tolerance
            or bool((tensor.abs() > bound + tolerance).any())):
        raise GhostedError(f"{path}: tensor {key} is not a Gram matrix (not symmetric, a negative diagonal, or an "
                           "entry beyond sqrt(G_ii G_jj)): the file is damaged; collect the statistics again.")


def check_shards(shards: list[CalibrationStatistics], names: list[str]) -> int:
    """Refuse shards that are not all N shards of one run (model, data, plan, options); returns N."""
    if not shards:
        raise GhostedError("No statistics shards to merge: pass the files written by `ghosted stats collect --shard`.")
    for name, shard in zip(names, shards):
        if "shard" not in shard.origin:
            raise GhostedError(f"{name} is not a statistics shard (no shard index recorded): merge only files "
                               "written by `ghosted stats collect --shard I/N`.")
    specs = [ShardSpec.parse(s.origin["shard"]) for s in shards]
    first, first_name = shards[0], names[0]
    agree: list[tuple[str, Callable[[CalibrationStatistics], Any]]] = [
        ("model", lambda x: x.origin.get("model")), ("calibration data", lambda x: x.origin.get("data")),
        ("statistics plan", lambda x: x.origin.get("plan")), ("depth and hidden size", lambda x: (x.depth, x.hidden_size)),
        ("number of shards", lambda x: ShardSpec.parse(x.origin["shard"]).count)]
    seen: dict[int, str] = {}
    for name, shard, spec in zip(names, shards, specs):
        for what, get in agree:
            if get(shard) != get(first):
                raise GhostedError(f"{name} (shard {spec}) and {first_name} were collected with a different {what}: "
                                   "merge only shards of one `ghosted stats collect` run (same model, calibration "
                                   "file, options and N).")
        if set(shard.tensors) != set(first.tensors):
            raise GhostedError(f"{name} and {first_name} hold different statistics; recollect them with one plan.")
        if spec.index in seen:
            raise GhostedError(f"Shard {spec} is given twice ({seen[spec.index]} and {name}): pass each shard once.")
        seen[spec.index] = name
    count = specs[0].count
    missing = [f"{i}/{count}" for i in range(count) if i not in seen]
    if missing:
        raise GhostedError(f"Shard(s) {', '.join(missing)} missing: merge needs all {count} shards of the run.")
    return count
