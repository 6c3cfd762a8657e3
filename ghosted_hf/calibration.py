"""One truncated forward pass with hooks -> streaming float64 sufficient statistics.

Index convention: `i` in 0..depth-1 is the hidden state entering decoder layer `i` (dense numbering);
`i == depth` is the hidden state entering the final norm. A boundary that removes layers s..e-1 maps X_s
to X_e.

Only per-batch activations are held, so memory does not grow with the number of calibration tokens;
the pass stops right after the deepest hidden state any statistic needs. The engine knows statistics,
not operator kinds or criteria: those declare which statistics they need as a `StatisticsPlan`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import time
import traceback
from collections.abc import Iterable, Mapping, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from .assets import file_sha256
from .data import TokenBatches
from .errors import GhostedError, MissingFileError, NonFiniteError
from .hadamard import rotation

logger = logging.getLogger(__name__)

WEIGHTINGS = ("none", "rms")
STATS_FORMAT = "ghosted-stats-v1"


def stat_key(name: str, *index: int) -> str:
    """The tensor name of one statistic, e.g. ``stat_key("cross", 3, 7) == "cross.3.7"``."""
    return ".".join((name, *map(str, index)))


@dataclass(frozen=True)
class StatisticsPlan:
    """Which statistics one pass accumulates (indices in dense numbering). Plans combine with ``|``."""

    grams: frozenset[int] = frozenset()  # gram.i = X_i^T X_i
    pairs: frozenset[tuple[int, int]] = frozenset()  # cross.s.e = X_s^T X_e, energy.s.e = sum ||x_e||^2
    cosines: frozenset[tuple[int, int]] = frozenset()  # cos.s.e / ang.s.e = sum cos(x_s, x_e) / arccos(.)/pi
    abs_sums: frozenset[int] = frozenset()  # abs.i = sum |x_i| per channel
    rotated_abs_sums: frozenset[int] = frozenset()  # rabs.i = sum |x_i H| per channel (Hadamard H)
    mlp_terms: frozenset[tuple[int, int]] = frozenset()  # M = MLP output of layer s-1: M^T M, M^T X_s, M^T X_e
    sums: frozenset[tuple[int, int]] = frozenset()  # sum.s = sum of x_s, count.s = tokens, sum_target.s.e = sum of x_e

    # The tensor whose presence shows that an entry was collected.
    PRIMARY = {"grams": "gram", "pairs": "cross", "cosines": "cos", "abs_sums": "abs", "rotated_abs_sums": "rabs",
               "mlp_terms": "mlp_target", "sums": "sum_target"}

    def __post_init__(self) -> None:
        if any(s < 1 for s, _ in self.mlp_terms):
            raise GhostedError("MLP terms need a layer before the source index: s must be >= 1.")

    def _entries(self) -> Iterable[tuple[str, Any]]:
        for f in dataclasses.fields(self):
            for item in getattr(self, f.name):
                yield f.name, item

    def __or__(self, other: StatisticsPlan) -> StatisticsPlan:
        return StatisticsPlan(**{f.name: getattr(self, f.name) | getattr(other, f.name) for f in dataclasses.fields(self)})

    def __bool__(self) -> bool:
        return any(True for _ in self._entries())

    @classmethod
    def union(cls, plans: Iterable[StatisticsPlan]) -> StatisticsPlan:
        merged = cls()
        for plan in plans:
            merged = merged | plan
        return merged

    def _keep(self, test) -> StatisticsPlan:
        return StatisticsPlan(**{f.name: frozenset(i for i in getattr(self, f.name) if test(f.name, i))
                                 for f in dataclasses.fields(self)})

    def missing_from(self, stats: CalibrationStatistics | None) -> StatisticsPlan:
        """The part of this plan that `stats` does not hold (empty when nothing is missing)."""
        have = stats.tensors if stats is not None else {}
        index = lambda item: item if isinstance(item, tuple) else (item,)  # noqa: E731
        return self._keep(lambda name, item: stat_key(self.PRIMARY[name], *index(item)) not in have)

    def split_at(self, s: int) -> tuple[StatisticsPlan, StatisticsPlan]:
        """(entries that read X_s as their source, the rest): sequential fitting takes the first part from
        the pruned and patched model and the rest (targets such as abs.e) from the dense model."""
        reads = lambda name, item: (item[0] if isinstance(item, tuple) else item) == s  # noqa: E731
        return self._keep(reads), self._keep(lambda name, item: not reads(name, item))

    def source_inputs(self) -> set[int]:
        return set(self.grams) | set(self.abs_sums) | set(self.rotated_abs_sums) | {
            s for pairs in (self.pairs, self.cosines, self.mlp_terms, self.sums) for s, _ in pairs}

    def target_inputs(self) -> set[int]:
        return {e for pairs in (self.pairs, self.cosines, self.mlp_terms, self.sums) for _, e in pairs}

    def mlp_layers(self) -> set[int]:
        return {s - 1 for s, _ in self.mlp_terms}

    def deepest(self) -> int:
        """Input index of the deepest hidden state the plan reads (the pass stops there)."""
        return max(self.source_inputs() | self.target_inputs() | {i + 1 for i in self.mlp_layers()})

    def to_json(self) -> str:
        """A canonical text form (sorted), recorded in statistics files so that merge can compare plans."""
        return json.dumps({f.name: sorted(list(i) if isinstance(i, tuple) else i for i in getattr(self, f.name))
                           for f in dataclasses.fields(self)}, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> StatisticsPlan:
        raw = json.loads(text)
        return cls(**{k: frozenset(tuple(i) if isinstance(i, list) else i for i in v) for k, v in raw.items()})


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


# ---------------------------------------------------------------- torch.distributed


# (rank, world size, local rank) as torchrun (and accelerate's GPU launcher) or an MPI launcher (accelerate's
# multi-CPU launcher runs mpirun: Open MPI, MPICH / Intel MPI, MVAPICH) describe them.
LAUNCHER_VARIABLES = (("RANK", "WORLD_SIZE", "LOCAL_RANK"),
                      ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
                      ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
                      ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK"))


def launcher_process(environ: Mapping[str, str] | None = None) -> tuple[int, int, int]:
    """(rank, world size, local rank) that the launcher gave this process; (0, 1, 0) when none did."""
    environ = os.environ if environ is None else environ
    for rank, world, local in LAUNCHER_VARIABLES:
        if environ.get(world):
            return int(environ.get(rank, "0")), int(environ[world]), int(environ.get(local, "0"))
    return 0, 1, 0


def init_distributed() -> bool:
    """Join the process group that torchrun / accelerate launch (its torchrun or mpirun launchers) describe
    in the environment (NCCL with CUDA, gloo otherwise); True when running with more than one process."""
    import torch.distributed as dist

    if not dist.is_available():
        return False
    if dist.is_initialized():
        return dist.get_world_size() > 1
    rank, world, local_rank = launcher_process()
    if world <= 1:
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise GhostedError(f"Process {rank} of {world}: MASTER_ADDR and MASTER_PORT are not set, so the processes cannot "
                           "find each other; start them with torchrun or accelerate launch (which set them).")
    logger.info("Joining process group: rank %d of %d (%s).", rank, world, backend)
    dist.init_process_group(backend, rank=rank, world_size=world)
    return True


def process_rank() -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) without torch.distributed."""
    import torch.distributed as dist

    if init_distributed():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main_process() -> bool:
    """Only the main process (rank 0) writes files."""
    return process_rank()[0] == 0


def all_reduce_statistics(stats: CalibrationStatistics) -> CalibrationStatistics:
    """Sum the statistics (and token counts) of every process; every process gets the same sums."""
    import torch.distributed as dist

    if process_rank()[1] == 1:
        return stats
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    tokens = torch.tensor([stats.tokens], dtype=torch.float64, device=device)
    dist.all_reduce(tokens)
    summed = {}
    for key in sorted(stats.tensors):  # the same order on every process
        tensor = stats.tensors[key]
        buffer = tensor.to(device=device, dtype=torch.float64).contiguous()
        dist.all_reduce(buffer)
        summed[key] = buffer.to(tensor.device)
    return dataclasses.replace(stats, tensors=summed, tokens=int(tokens.item()))


# ---------------------------------------------------------------- what statistics were made from


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


def check_same_model(stats: CalibrationStatistics, fingerprint: dict[str, Any], source: str = "the statistics") -> None:
    """Refuse statistics recorded from another model (config or weight files differ)."""
    recorded = stats.origin.get("model")
    if not recorded:
        return
    if recorded.get("config_sha256") != fingerprint["config_sha256"]:
        raise GhostedError(f"{source} were collected on a model with another config (config hash "
                           f"{recorded.get('config_sha256', '?')[:12]} vs {fingerprint['config_sha256'][:12]}): collect "
                           "statistics on this model, or pass the model they were collected on.")
    if recorded.get("weights_sha256") != fingerprint["weights_sha256"]:
        raise GhostedError(f"{source} were collected on the same architecture but other weights "
                           f"({recorded.get('weights_sha256')} vs {fingerprint['weights_sha256']}): collect statistics "
                           "on this model's weights.")


@dataclass
class CalibrationStatistics:
    """Float64 sums over calibration tokens, named by `stat_key` (``gram.3``, ``cross.3.7``, ...)."""

    tensors: dict[str, torch.Tensor]
    depth: int
    hidden_size: int
    tokens: int
    weighting: str = "none"
    skip_first_tokens: int = 0
    rotation_kind: str = "none"
    # What the sums were made from: "model" (model_fingerprint), "data" (token hash), "plan" (StatisticsPlan
    # JSON), "shard" ("I/N"); merge compares them.
    origin: dict[str, Any] = dataclasses.field(default_factory=dict)

    def _get(self, what: str, name: str, *index: int) -> torch.Tensor:
        key = stat_key(name, *index)
        if key not in self.tensors:
            raise GhostedError(f"These statistics hold no {what} ({key}); collect them with a plan that includes it.")
        return self.tensors[key]

    def gram(self, i: int) -> torch.Tensor:
        return self._get(f"Gram matrix of the input of layer {i}", "gram", i)

    def cross(self, s: int, e: int) -> torch.Tensor:
        return self._get(f"cross term X_{s}^T X_{e}", "cross", s, e)

    def energy(self, s: int, e: int) -> float:
        return float(self._get(f"target energy of ({s}, {e})", "energy", s, e))

    def has_pair(self, s: int, e: int) -> bool:
        return stat_key("cross", s, e) in self.tensors and stat_key("gram", s) in self.tensors

    def mean_cosine(self, s: int, e: int) -> float:
        return float(self._get(f"cosine of ({s}, {e})", "cos", s, e)) / self.tokens

    def mean_angular(self, s: int, e: int) -> float:
        return float(self._get(f"angular distance of ({s}, {e})", "ang", s, e)) / self.tokens

    def abs_mean(self, i: int) -> torch.Tensor:
        return self._get(f"mean |x| of the input of layer {i}", "abs", i) / self.tokens

    def rotated_abs_mean(self, i: int) -> torch.Tensor:
        return self._get(f"rotated mean |x| of the input of layer {i}", "rabs", i) / self.tokens

    def mlp_terms(self, s: int, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(M^T M, M^T X_s, M^T X_e) for the MLP output M of layer s-1."""
        what = f"MLP terms of ({s}, {e})"
        return (self._get(what, "mlp_gram", s), self._get(what, "mlp_source", s),
                self._get(what, "mlp_target", s, e))

    def sums(self, s: int, e: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(sum of x_s, sum of x_e, token count), each token weighted as in the Gram matrix: the affine fit's
        extra row and column."""
        what = f"token sums of ({s}, {e})"
        return (self._get(what, "sum", s), self._get(what, "sum_target", s, e),
                float(self._get(what, "count", s)))

    def with_tensors(self, other: CalibrationStatistics) -> CalibrationStatistics:
        """These statistics updated with `other`'s (same calibration tokens; `other` wins on shared keys)."""
        if other.tokens != self.tokens or other.depth != self.depth:
            raise GhostedError(
                f"Cannot combine statistics of {self.tokens} and {other.tokens} tokens: they come from different "
                "calibration data (pass the same text, sequence length and number of sequences)."
            )
        rotation_kind = other.rotation_kind if other.rotation_kind != "none" else self.rotation_kind
        origin = {**self.origin, **other.origin}
        if "plan" in self.origin and "plan" in other.origin:
            origin["plan"] = (StatisticsPlan.from_json(self.origin["plan"])
                              | StatisticsPlan.from_json(other.origin["plan"])).to_json()
        return dataclasses.replace(self, tensors={**self.tensors, **other.tensors}, rotation_kind=rotation_kind,
                                   origin=origin)

    def check_objective(self, weighting: str, skip_first_tokens: int) -> None:
        if (self.weighting, self.skip_first_tokens) != (weighting, skip_first_tokens):
            raise GhostedError(
                f"The statistics were collected with weighting={self.weighting!r}, skip_first_tokens="
                f"{self.skip_first_tokens}; the options ask for {weighting!r}, {skip_first_tokens}."
            )

    def save(self, path: str | Path) -> None:
        """Write to a safetensors file, to try other selections or operators without another pass."""
        metadata = {
            "format": STATS_FORMAT, "depth": str(self.depth), "hidden_size": str(self.hidden_size),
            "tokens": str(self.tokens), "weighting": self.weighting, "skip_first_tokens": str(self.skip_first_tokens),
            "rotation_kind": self.rotation_kind, "origin": json.dumps(self.origin, sort_keys=True),
        }
        save_file({k: v.detach().cpu().contiguous() for k, v in self.tensors.items()}, str(path), metadata=metadata)

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu") -> CalibrationStatistics:
        return dataclasses.replace(cls.load_header(path), tensors=load_file(str(path), device=str(device)))

    @classmethod
    def load_header(cls, path: str | Path) -> CalibrationStatistics:
        """The file's metadata and tensor names, without the tensors (their values are None)."""
        if not Path(path).is_file():
            raise MissingFileError(f"Statistics file {path} does not exist.")
        with safe_open(str(path), framework="pt") as handle:
            meta, keys = handle.metadata() or {}, list(handle.keys())
        if meta.get("format") != STATS_FORMAT:
            raise GhostedError(f"{path} is not a ghosted_hf statistics file (format {meta.get('format')!r}).")
        return cls(tensors=dict.fromkeys(keys), depth=int(meta.get("depth", meta.get("num_layers"))),
                   hidden_size=int(meta["hidden_size"]),
                   tokens=int(meta["tokens"]), weighting=meta["weighting"],
                   skip_first_tokens=int(meta["skip_first_tokens"]), rotation_kind=meta.get("rotation_kind", "none"),
                   origin=json.loads(meta.get("origin", "{}")))  # absent in files written before shards existed

    @classmethod
    def merge_files(cls, paths: list[str | Path]) -> CalibrationStatistics:
        """`merge` of shard files, checked from their headers first, then summed one file at a time (memory:
        two shards' tensors, whatever N)."""
        names = [str(p) for p in paths]
        cls.merge([cls.load_header(p) for p in paths], names)
        merged = None
        for path in paths:
            shard = cls.load(path)
            if merged is None:
                merged = dataclasses.replace(shard, tensors={k: v.double() for k, v in shard.tensors.items()})
            else:
                for key, value in shard.tensors.items():
                    merged.tensors[key] += value
                merged.tokens += shard.tokens
                if merged.rotation_kind == "none":
                    merged.rotation_kind = shard.rotation_kind
            del shard
        merged.origin = {k: v for k, v in merged.origin.items() if k != "shard"} | {"merged_shards": len(paths)}
        return merged

    @classmethod
    def merge(cls, shards: list[CalibrationStatistics], names: list[str] | None = None) -> CalibrationStatistics:
        """The sums of shards 0/N .. N-1/N of one calibration set: the statistics of the whole set."""
        names = names or [f"shard #{k}" for k in range(len(shards))]
        if not shards:
            raise GhostedError("No statistics shards to merge: pass the files written by `ghosted stats collect --shard`.")
        for name, shard in zip(names, shards):
            if "shard" not in shard.origin:
                raise GhostedError(f"{name} is not a statistics shard (no shard index recorded): merge only files "
                                   "written by `ghosted stats collect --shard I/N`.")
        specs = [ShardSpec.parse(s.origin["shard"]) for s in shards]
        first, first_name = shards[0], names[0]
        for name, shard, spec in zip(names, shards, specs):
            for what, get in (("model", lambda x: x.origin.get("model")), ("calibration data", lambda x: x.origin.get("data")),
                              ("statistics plan", lambda x: x.origin.get("plan")),
                              ("objective (weighting, skip_first_tokens)", lambda x: (x.weighting, x.skip_first_tokens)),
                              ("depth and hidden size", lambda x: (x.depth, x.hidden_size)),
                              ("number of shards", lambda x: ShardSpec.parse(x.origin["shard"]).count)):
                if get(shard) != get(first):
                    raise GhostedError(f"{name} (shard {spec}) and {first_name} were collected with a different {what}: "
                                       "merge only shards of one `ghosted stats collect` run (same model, calibration "
                                       "file, options and N).")
            if set(shard.tensors) != set(first.tensors):
                raise GhostedError(f"{name} and {first_name} hold different statistics; recollect them with one plan.")
        seen: dict[int, str] = {}
        for name, spec in zip(names, specs):
            if spec.index in seen:
                raise GhostedError(f"Shard {spec} is given twice ({seen[spec.index]} and {name}): pass each shard once.")
            seen[spec.index] = name
        count = specs[0].count
        missing = [f"{i}/{count}" for i in range(count) if i not in seen]
        if missing:
            raise GhostedError(f"Shard(s) {', '.join(missing)} missing: merge needs all {count} shards of the run.")
        if any(t is None for t in first.tensors.values()):  # headers only (merge_files): checked, not summed
            return first
        tensors = {k: sum((s.tensors[k].double() for s in shards[1:]), first.tensors[k].double().clone())
                   for k in first.tensors}
        origin = {k: v for k, v in first.origin.items() if k != "shard"} | {"merged_shards": count}
        rotation_kind = next((s.rotation_kind for s in shards if s.rotation_kind != "none"), "none")
        return dataclasses.replace(first, tensors=tensors, tokens=sum(s.tokens for s in shards), origin=origin,
                                   rotation_kind=rotation_kind)


class _StopForward(Exception):
    """Raised by the hook on the deepest needed hidden state: the rest of the model is not run."""


def decoder_parts(model: nn.Module) -> tuple[nn.ModuleList, nn.Module]:
    """The decoder layers and final norm of a Llama-style causal LM (dense or ghosted)."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "norm"):
        raise GhostedError(f"Expected a causal LM with `model.layers` and `model.norm`, got {type(model).__name__}.")
    return inner.layers, inner.norm


def input_device(model: nn.Module) -> torch.device:
    weight = model.get_input_embeddings().weight
    return torch.device("cpu") if weight.device.type == "meta" else weight.device


def token_mask(attention_mask: torch.Tensor, skip_first_tokens: int) -> torch.Tensor:
    """Real tokens, minus the first `skip_first_tokens` real positions of each sequence."""
    mask = attention_mask.bool()
    if skip_first_tokens:
        mask &= (attention_mask.cumsum(dim=1) - 1) >= skip_first_tokens
    return mask


def _where(i: int, depth: int) -> str:
    return "the final norm" if i == depth else f"layer {i}"


def capture_hidden_states(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    inputs: set[int],
    mlp_layers: set[int],
    keep: torch.Tensor,
    device: torch.device,
) -> dict[Any, torch.Tensor]:
    """Run `model` on `batch` up to the deepest requested point; return the kept tokens (N, C) of the
    input of each layer in `inputs` and of the MLP output (key ("mlp", i)) of each layer in `mlp_layers`."""
    layers, norm = decoder_parts(model)
    depth = len(layers)
    deepest = max(inputs | {i + 1 for i in mlp_layers})
    captured: dict[Any, torch.Tensor] = {}

    def rows(hidden: torch.Tensor, where: str) -> torch.Tensor:
        kept = hidden[keep.to(hidden.device)]
        if not torch.isfinite(kept).all():
            raise NonFiniteError(
                f"Non-finite activations (NaN/Inf) first appear at {where} on calibration data, in {hidden.dtype}. "
                "Load the model in float32 or bfloat16 (float16 overflows in many LLMs) and check its weights."
            )
        return kept

    def store(key: Any, hidden: torch.Tensor, where: str) -> None:
        captured[key] = rows(hidden, where).to(device)

    def pre_hook(i: int):
        # On every layer up to the deepest, so that a NaN is reported where it first appears.
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            where = f"the input of {_where(i, depth)}" + (f" (the output of layer {i - 1})" if i else "")
            if i in inputs:
                store(i, hidden, where)
            else:
                rows(hidden, where)
            if i == deepest:
                raise _StopForward
        return hook

    def mlp_hook(i: int):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            store(("mlp", i), output, f"the MLP output of layer {i}")
        return hook

    handles = []
    try:
        for i in range(deepest + 1):
            target = layers[i] if i < depth else norm
            handles.append(target.register_forward_pre_hook(pre_hook(i), with_kwargs=True))
        for i in mlp_layers:
            handles.append(layers[i].mlp.register_forward_hook(mlp_hook(i)))
        first = input_device(model)
        with torch.no_grad():
            try:
                model(**{k: v.to(first) for k, v in batch.items()}, use_cache=False)
            except _StopForward as stop:
                # The traceback's frames hold this batch's activations in reference cycles (the hook
                # closures and transformers' wrappers) that only the cyclic GC frees, seldom, since a few large
                # tensors are few objects: peak memory grew with the number of batches. Free them now.
                traceback.clear_frames(stop.__traceback__)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def _malloc_trim() -> Any:
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_TRIM = _malloc_trim()


def release_freed_memory() -> None:
    """Give the pages of freed blocks back to the OS (glibc). A batch's activations are freed between blocks
    that stay allocated, so without this the heap fragments and peak memory creeps up batch after batch."""
    if _TRIM is not None:
        _TRIM(0)


class _LazyFloat64(dict):
    """float64 copies of `source`'s tensors, made on first read."""

    def __init__(self, source: Mapping[Any, torch.Tensor], device: torch.device) -> None:
        super().__init__()
        self.source, self.device = source, device

    def __missing__(self, key: Any) -> torch.Tensor:
        value = self[key] = self.source[key].to(device=self.device, dtype=torch.float64)
        return value


class StatisticsAccumulator:
    """Streaming float64 sums of a plan over batches of captured hidden states ({index: (N, C) tensor})."""

    def __init__(self, plan: StatisticsPlan, hidden_size: int, device: str | torch.device = "cpu",
                 weighting: str = "none") -> None:
        if weighting not in WEIGHTINGS:
            raise GhostedError(f"Unknown token weighting {weighting!r}; choose one of: {', '.join(WEIGHTINGS)}.")
        self.plan, self.hidden_size, self.device, self.weighting = plan, hidden_size, torch.device(device), weighting
        self.tokens = 0
        self.rotation, self.rotation_kind = (None, "none")
        if plan.rotated_abs_sums:
            h, self.rotation_kind = rotation(hidden_size)
            self.rotation = h.to(device)
        # Every sum exists from the start (zeros): a process or shard with no batch still has all keys to reduce.
        c, f64 = hidden_size, dict(dtype=torch.float64, device=self.device)
        shapes = {**{stat_key("gram", i): (c, c) for i in plan.grams},
                  **{stat_key("abs", i): (c,) for i in plan.abs_sums},
                  **{stat_key("rabs", i): (c,) for i in plan.rotated_abs_sums},
                  **{stat_key(n, s, e): shape for s, e in plan.pairs for n, shape in (("cross", (c, c)), ("energy", (1,)))},
                  **{stat_key(n, s, e): (1,) for s, e in plan.cosines for n in ("cos", "ang")},
                  **{stat_key(n, s): (c, c) for s, _ in plan.mlp_terms for n in ("mlp_gram", "mlp_source")},
                  **{stat_key("mlp_target", s, e): (c, c) for s, e in plan.mlp_terms},
                  **{stat_key(n, s): shape for s, _ in plan.sums for n, shape in (("sum", (c,)), ("count", (1,)))},
                  **{stat_key("sum_target", s, e): (c,) for s, e in plan.sums}}
        self.sums: dict[str, torch.Tensor] = {k: torch.zeros(shape, **f64) for k, shape in shapes.items()}

    def result(self, depth: int, skip_first_tokens: int = 0, allow_empty: bool = False) -> CalibrationStatistics:
        if self.tokens == 0 and not allow_empty:
            raise GhostedError("The calibration batches contain no real token (all positions are padding or skipped).")
        return CalibrationStatistics(
            tensors=self.sums, depth=depth, hidden_size=self.hidden_size, tokens=self.tokens,
            weighting=self.weighting, skip_first_tokens=skip_first_tokens, rotation_kind=self.rotation_kind,
        )

    def add(self, value: torch.Tensor, name: str, *index: int) -> None:
        self.sums[stat_key(name, *index)] += value

    def weights(self, x: torch.Tensor) -> torch.Tensor:
        if self.weighting == "rms":
            return x.shape[1] / x.square().sum(dim=1).clamp_min(torch.finfo(torch.float64).tiny)
        return torch.ones(x.shape[0], dtype=torch.float64, device=x.device)

    def update(self, captured: Mapping[Any, torch.Tensor], ending_at: int | None = None) -> None:
        """Add one batch. With `ending_at`, only the sums whose deepest input index is `ending_at` (the
        layer-wise pass adds each sum as soon as its inputs exist); the caller counts the tokens then."""
        if ending_at is None:
            self.tokens += next(iter(captured.values())).shape[0]
        # Fixed-size row chunks: the float64 copies are small and of one size for every batch, so the
        # allocator reuses the same blocks instead of fragmenting (peak memory no longer grows with tokens).
        rows = next(iter(captured.values())).shape[0]
        for start in range(0, rows, self.CHUNK):
            self._update({k: v[start:start + self.CHUNK] for k, v in captured.items()}, ending_at)

    CHUNK = 256

    def _update(self, captured: Mapping[Any, torch.Tensor], ending_at: int | None) -> None:
        plan = self.plan
        # Each input converted once, when first read. (No class or closure over `captured` here: a reference
        # cycle would keep every batch's activations alive until the cyclic GC happens to run.)
        x = _LazyFloat64(captured, self.device)
        # A target kept apart from the source of the same index (see collect_statistics: s == e, sequentially).
        target = lambda e: x[("target", e)] if ("target", e) in captured else x[e]  # noqa: E731
        now = (lambda i: True) if ending_at is None else (lambda i: i == ending_at)  # noqa: E731
        w: dict[int, torch.Tensor] = {}

        def weighted(i: int) -> torch.Tensor:
            """x_i scaled by its token weights (x_i itself when unweighted: no temporary)."""
            return x[i] if self.weighting == "none" else x[i] * weight(i)[:, None]

        def weight(i: int) -> torch.Tensor:
            if i not in w:
                w[i] = self.weights(x[i])
            return w[i]

        # addmm_ into the sums: no (C, C) temporary per product.
        for i in filter(now, plan.grams):
            self.sums[stat_key("gram", i)].addmm_(weighted(i).T, x[i])
        for i in filter(now, plan.abs_sums):
            self.add(x[i].abs().sum(dim=0), "abs", i)
        for i in filter(now, plan.rotated_abs_sums):
            self.add((x[i] @ self.rotation).abs().sum(dim=0), "rabs", i)
        for s, e in (p for p in plan.pairs if now(p[1])):
            self.sums[stat_key("cross", s, e)].addmm_(weighted(s).T, target(e))
            self.add((weight(s) * target(e).square().sum(dim=1)).sum().reshape(1), "energy", s, e)
        for s, e in (p for p in plan.cosines if now(p[1])):
            norms = (x[s].norm(dim=1) * target(e).norm(dim=1)).clamp_min(torch.finfo(torch.float64).tiny)
            cos = ((x[s] * target(e)).sum(dim=1) / norms).clamp(-1.0, 1.0)
            self.add(cos.sum().reshape(1), "cos", s, e)
            self.add((torch.arccos(cos) / math.pi).sum().reshape(1), "ang", s, e)
        for s in filter(now, {s for s, _ in plan.mlp_terms}):
            m = x[("mlp", s - 1)]
            self.sums[stat_key("mlp_gram", s)].addmm_(m.T, m)
            self.sums[stat_key("mlp_source", s)].addmm_(m.T, x[s])
        for s, e in (p for p in plan.mlp_terms if now(p[1])):
            self.sums[stat_key("mlp_target", s, e)].addmm_(x[("mlp", s - 1)].T, target(e))
        for s in filter(now, {s for s, _ in plan.sums}):
            self.add(weighted(s).sum(dim=0), "sum", s)
            self.add(weight(s).sum().reshape(1), "count", s)
        for s, e in (p for p in plan.sums if now(p[1])):
            self.add(weight(s) @ target(e), "sum_target", s, e)


def _capture_batch(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    plan: StatisticsPlan,
    keep: torch.Tensor,
    device: torch.device,
    source: tuple[nn.Module, Mapping[int, int]] | None,
) -> dict[Any, torch.Tensor]:
    """The hidden states one batch gives `plan`. With a patched `source`, everything read at or before the
    boundary (inputs X_s, MLP outputs) comes from it and only the targets from `model`; a target at an index the
    patched model provides as a source too (s == e: an operator at the final norm's input) still comes from
    `model`, under ("target", e)."""
    source_side = plan.source_inputs() if source is not None else set()
    source_mlp = plan.mlp_layers() if source is not None else set()
    target_side = (plan.source_inputs() | plan.target_inputs()) - source_side
    shadowed = plan.target_inputs() & source_side
    target_mlp = plan.mlp_layers() - source_mlp
    captured: dict[Any, torch.Tensor] = {}
    if target_side or target_mlp or shadowed:
        got = capture_hidden_states(model, batch, target_side | shadowed, target_mlp, keep, device)
        captured.update({("target", i) if i in shadowed else i: v for i, v in got.items()})
    if source is not None:
        patched, index_map = source
        got = capture_hidden_states(patched, batch, {index_map[i] for i in source_side},
                                    {index_map[i] for i in source_mlp}, keep, device)
        captured.update({i: got[index_map[i]] for i in source_side})
        captured.update({("mlp", i): got[("mlp", index_map[i])] for i in source_mlp})
    return captured


def collect_statistics(
    model: nn.Module,
    batches: Iterable[Mapping[str, torch.Tensor]],
    plan: StatisticsPlan,
    *,
    weighting: str = "none",
    skip_first_tokens: int = 0,
    device: str | torch.device | None = None,
    source: tuple[nn.Module, Mapping[int, int]] | None = None,
    progress: bool = True,
    description: str = "Calibration pass",
    allow_empty: bool = False,
) -> CalibrationStatistics:
    """Accumulate `plan` over `batches` with one truncated pass of `model` per batch.

    `weighting` ("none" or "rms": each token divided by its RMS) and `skip_first_tokens` (leave the first
    real positions of every sequence out) define the least-squares objective. With
    `source=(patched_model, index_map)`, source-side hidden states (grams, the first index of every pair, MLP
    outputs) come from `patched_model` (whose layer `index_map[i]` plays dense layer `i`), targets from `model`:
    this is how operators are fitted sequentially on an already pruned and patched model.
    The models run in eval mode (dropout off) and get their own mode back afterwards.
    """
    if not plan:
        raise GhostedError("The statistics plan is empty: nothing to collect.")
    if hasattr(model, "layerwise_statistics"):  # layerwise.LayerwiseModel: one decoder layer in memory at a time
        return model.layerwise_statistics(list(batches), plan, weighting=weighting, skip_first_tokens=skip_first_tokens,
                                          device=device, source=source, progress=progress, description=description,
                                          allow_empty=allow_empty)
    layers, _ = decoder_parts(model)
    hidden_size = model.get_input_embeddings().weight.shape[1]
    device = torch.device(device) if device is not None else input_device(model)
    accumulator = StatisticsAccumulator(plan, hidden_size, device, weighting)
    models = [model] + ([source[0]] if source is not None else [])
    modes = [m.training for m in models]
    try:
        for m in models:
            m.eval()
        # Iterated as given: a generator of batches streams (no list of every batch is made here).
        total = len(batches) if isinstance(batches, Sized) else None
        for batch in tqdm(batches, total=total, desc=description, disable=not progress, leave=False):
            keep = token_mask(batch["attention_mask"], skip_first_tokens)
            if not keep.any():
                continue
            # Captured in a helper whose locals die with it: a local here would keep this batch's activations
            # alive through the next batch's forward (peak memory of two batches from the second one on).
            accumulator.update(_capture_batch(model, batch, plan, keep, device, source))
            release_freed_memory()
    finally:
        for m, mode in zip(models, modes):
            m.train(mode)
    return accumulator.result(len(layers), skip_first_tokens, allow_empty)


class Calibrator:
    """Statistics passes over one calibration set: gathers what is missing, keeps what was gathered and
    records what each pass cost (for the provenance).

    Each pass reads only this calibrator's share of the batches: shard `shard` of the set, and of that, the
    batches of this process under torch.distributed (rank r of world w takes every w-th batch); the float64
    sums of the processes are all-reduced, so every process fits the same operators."""

    def __init__(self, model: nn.Module, data: TokenBatches | None, statistics: CalibrationStatistics | None = None,
                 *, weighting: str = "none", skip_first_tokens: int = 0,
                 device: str | torch.device | None = None, shard: ShardSpec | None = None) -> None:
        if statistics is not None:
            statistics.check_objective(weighting, skip_first_tokens)
        self.model, self.data, self.statistics = model, data, statistics
        self.weighting, self.skip_first_tokens, self.device = weighting, skip_first_tokens, device
        self.shard = shard or ShardSpec()
        self.rank, self.world = process_rank()
        self.passes: list[dict[str, Any]] = []
        self._data_sha256: str | None = None

    @property
    def data_description(self) -> dict[str, Any]:
        return self.data.describe() if self.data is not None else {}

    def my_batches(self) -> list[dict[str, torch.Tensor]]:
        """This process's share of this shard's batches."""
        return ShardSpec(self.rank, self.world).take(self.shard.take(self.data.batches))

    def ensure(self, plan: StatisticsPlan, purpose: str) -> CalibrationStatistics:
        """Statistics holding at least `plan`, running one pass for whatever is missing."""
        missing = plan.missing_from(self.statistics)
        if missing:
            if self.data is None:
                raise GhostedError(f"The given statistics lack what {purpose} needs, and no calibration text was given: "
                                   "pass the calibration text too, or collect statistics with the same options "
                                   "(with several boundaries, --fitting independent needs no further pass).")
            fresh = self.collect(missing, purpose)
            self.statistics = fresh if self.statistics is None else self.statistics.with_tensors(fresh)
        return self.statistics

    def collect(self, plan: StatisticsPlan, purpose: str, source: tuple[nn.Module, Mapping[int, int]] | None = None,
                model: nn.Module | None = None) -> CalibrationStatistics:
        """One pass for `plan` (see `collect_statistics` for `source`) over `model` (default: the calibrated model;
        another one, e.g. a pruned model alone); not merged into the kept statistics."""
        started = time.perf_counter()
        batches = self.my_batches()
        if not self.shard.take(self.data.batches):
            raise GhostedError(f"Shard {self.shard} holds no batch: the calibration set has only "
                               f"{len(self.data.batches)} batches; use fewer shards or more sequences.")
        stats = collect_statistics(self.model if model is None else model, batches, plan, weighting=self.weighting,
                                   skip_first_tokens=self.skip_first_tokens, device=self.device, source=source,
                                   description=f"Calibration pass: {purpose}", allow_empty=self.world > 1)
        stats = all_reduce_statistics(stats)
        if stats.tokens == 0:
            raise GhostedError("The calibration batches contain no real token (all positions are padding or skipped).")
        if self._data_sha256 is None:
            self._data_sha256 = self.data.token_sha256()
        stats.origin.update(data=self._data_sha256, plan=plan.to_json(), shard=str(self.shard))
        models_run = 1 if source is None else 1 + bool(plan.target_inputs())
        self.passes.append({"purpose": purpose, "batches": len(batches), "forwards": len(batches) * models_run,
                            "processes": self.world, "deepest_layer_input": plan.deepest(),
                            "sequential": source is not None, "seconds": round(time.perf_counter() - started, 3)})
        return stats
