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
import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

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

    # The tensor whose presence shows that an entry was collected.
    PRIMARY = {"grams": "gram", "pairs": "cross", "cosines": "cos", "abs_sums": "abs", "rotated_abs_sums": "rabs",
               "mlp_terms": "mlp_target"}

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
            s for pairs in (self.pairs, self.cosines, self.mlp_terms) for s, _ in pairs}

    def target_inputs(self) -> set[int]:
        return {e for pairs in (self.pairs, self.cosines, self.mlp_terms) for _, e in pairs}

    def mlp_layers(self) -> set[int]:
        return {s - 1 for s, _ in self.mlp_terms}

    def deepest(self) -> int:
        """Input index of the deepest hidden state the plan reads (the pass stops there)."""
        return max(self.source_inputs() | self.target_inputs() | {i + 1 for i in self.mlp_layers()})


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

    def with_tensors(self, other: CalibrationStatistics) -> CalibrationStatistics:
        """These statistics updated with `other`'s (same calibration tokens; `other` wins on shared keys)."""
        if other.tokens != self.tokens or other.depth != self.depth:
            raise GhostedError(
                f"Cannot combine statistics of {self.tokens} and {other.tokens} tokens: they come from different "
                "calibration data (pass the same text, sequence length and number of sequences)."
            )
        rotation_kind = other.rotation_kind if other.rotation_kind != "none" else self.rotation_kind
        return dataclasses.replace(self, tensors={**self.tensors, **other.tensors}, rotation_kind=rotation_kind)

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
            "rotation_kind": self.rotation_kind,
        }
        save_file({k: v.detach().cpu().contiguous() for k, v in self.tensors.items()}, str(path), metadata=metadata)

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu") -> CalibrationStatistics:
        if not Path(path).is_file():
            raise MissingFileError(f"Statistics file {path} does not exist.")
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
        if meta.get("format") != STATS_FORMAT:
            raise GhostedError(f"{path} is not a ghosted_hf statistics file (format {meta.get('format')!r}).")
        return cls(
            tensors=load_file(str(path), device=str(device)), depth=int(meta.get("depth", meta.get("num_layers"))),
            hidden_size=int(meta["hidden_size"]), tokens=int(meta["tokens"]), weighting=meta["weighting"],
            skip_first_tokens=int(meta["skip_first_tokens"]), rotation_kind=meta.get("rotation_kind", "none"),
        )


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
            except _StopForward:
                pass
    finally:
        for handle in handles:
            handle.remove()
    return captured


class StatisticsAccumulator:
    """Streaming float64 sums of a plan over batches of captured hidden states ({index: (N, C) tensor})."""

    def __init__(self, plan: StatisticsPlan, hidden_size: int, device: str | torch.device = "cpu",
                 weighting: str = "none") -> None:
        if weighting not in WEIGHTINGS:
            raise GhostedError(f"Unknown token weighting {weighting!r}; choose one of: {', '.join(WEIGHTINGS)}.")
        self.plan, self.hidden_size, self.device, self.weighting = plan, hidden_size, torch.device(device), weighting
        self.sums: dict[str, torch.Tensor] = {}
        self.tokens = 0
        self.rotation, self.rotation_kind = (None, "none")
        if plan.rotated_abs_sums:
            h, self.rotation_kind = rotation(hidden_size)
            self.rotation = h.to(device)

    def result(self, depth: int, skip_first_tokens: int = 0) -> CalibrationStatistics:
        if self.tokens == 0:
            raise GhostedError("The calibration batches contain no real token (all positions are padding or skipped).")
        return CalibrationStatistics(
            tensors=self.sums, depth=depth, hidden_size=self.hidden_size, tokens=self.tokens,
            weighting=self.weighting, skip_first_tokens=skip_first_tokens, rotation_kind=self.rotation_kind,
        )

    def add(self, value: torch.Tensor, name: str, *index: int) -> None:
        key = stat_key(name, *index)
        if key in self.sums:
            self.sums[key] += value
        else:
            self.sums[key] = value.clone()

    def weights(self, x: torch.Tensor) -> torch.Tensor:
        if self.weighting == "rms":
            return x.shape[1] / x.square().sum(dim=1).clamp_min(torch.finfo(torch.float64).tiny)
        return torch.ones(x.shape[0], dtype=torch.float64, device=x.device)

    def update(self, captured: Mapping[Any, torch.Tensor]) -> None:
        plan = self.plan
        x = {k: v.to(device=self.device, dtype=torch.float64) for k, v in captured.items()}
        w = {i: self.weights(x[i]) for i in plan.grams | {s for s, _ in plan.pairs}}
        self.tokens += next(iter(x.values())).shape[0]
        for i in plan.grams:
            self.add((x[i] * w[i][:, None]).T @ x[i], "gram", i)
        for i in plan.abs_sums:
            self.add(x[i].abs().sum(dim=0), "abs", i)
        for i in plan.rotated_abs_sums:
            self.add((x[i] @ self.rotation).abs().sum(dim=0), "rabs", i)
        for s, e in plan.pairs:
            self.add((x[s] * w[s][:, None]).T @ x[e], "cross", s, e)
            self.add((w[s] * x[e].square().sum(dim=1)).sum().reshape(1), "energy", s, e)
        for s, e in plan.cosines:
            norms = (x[s].norm(dim=1) * x[e].norm(dim=1)).clamp_min(torch.finfo(torch.float64).tiny)
            cos = ((x[s] * x[e]).sum(dim=1) / norms).clamp(-1.0, 1.0)
            self.add(cos.sum().reshape(1), "cos", s, e)
            self.add((torch.arccos(cos) / math.pi).sum().reshape(1), "ang", s, e)
        for s in {s for s, _ in plan.mlp_terms}:
            m = x[("mlp", s - 1)]
            self.add(m.T @ m, "mlp_gram", s)
            self.add(m.T @ x[s], "mlp_source", s)
        for s, e in plan.mlp_terms:
            self.add(x[("mlp", s - 1)].T @ x[e], "mlp_target", s, e)


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
    layers, _ = decoder_parts(model)
    hidden_size = model.get_input_embeddings().weight.shape[1]
    device = torch.device(device) if device is not None else input_device(model)
    accumulator = StatisticsAccumulator(plan, hidden_size, device, weighting)
    # With a patched source model, everything read at or before the boundary (inputs X_s, MLP outputs) comes
    # from it and only the targets from `model`.
    source_side = plan.source_inputs() if source is not None else set()
    source_mlp = plan.mlp_layers() if source is not None else set()
    target_side = (plan.source_inputs() | plan.target_inputs()) - source_side
    target_mlp = plan.mlp_layers() - source_mlp
    models = [model] + ([source[0]] if source is not None else [])
    modes = [m.training for m in models]
    try:
        for m in models:
            m.eval()
        for batch in tqdm(list(batches), desc=description, disable=not progress, leave=False):
            keep = token_mask(batch["attention_mask"], skip_first_tokens)
            if not keep.any():
                continue
            captured = {}
            if target_side or target_mlp:
                captured.update(capture_hidden_states(model, batch, target_side, target_mlp, keep, device))
            if source is not None:
                patched, index_map = source
                got = capture_hidden_states(patched, batch, {index_map[i] for i in source_side},
                                            {index_map[i] for i in source_mlp}, keep, device)
                captured.update({i: got[index_map[i]] for i in source_side})
                captured.update({("mlp", i): got[("mlp", index_map[i])] for i in source_mlp})
            accumulator.update(captured)
    finally:
        for m, mode in zip(models, modes):
            m.train(mode)
    return accumulator.result(len(layers), skip_first_tokens)


class Calibrator:
    """Statistics passes over one calibration set: gathers what is missing, keeps what was gathered and
    records what each pass cost (for the provenance)."""

    def __init__(self, model: nn.Module, data: TokenBatches | None, statistics: CalibrationStatistics | None = None,
                 *, weighting: str = "none", skip_first_tokens: int = 0,
                 device: str | torch.device | None = None) -> None:
        if statistics is not None:
            statistics.check_objective(weighting, skip_first_tokens)
        self.model, self.data, self.statistics = model, data, statistics
        self.weighting, self.skip_first_tokens, self.device = weighting, skip_first_tokens, device
        self.passes: list[dict[str, Any]] = []

    @property
    def data_description(self) -> dict[str, Any]:
        return self.data.describe() if self.data is not None else {}

    def ensure(self, plan: StatisticsPlan, purpose: str) -> CalibrationStatistics:
        """Statistics holding at least `plan`, running one pass for whatever is missing."""
        missing = plan.missing_from(self.statistics)
        if missing:
            if self.data is None:
                raise GhostedError(f"The given statistics lack what {purpose} needs, and no calibration text was given.")
            fresh = self.collect(missing, purpose)
            self.statistics = fresh if self.statistics is None else self.statistics.with_tensors(fresh)
        return self.statistics

    def collect(self, plan: StatisticsPlan, purpose: str,
                source: tuple[nn.Module, Mapping[int, int]] | None = None) -> CalibrationStatistics:
        """One pass for `plan` (see `collect_statistics` for `source`); not merged into the kept statistics."""
        started = time.perf_counter()
        batches = self.data.batches
        stats = collect_statistics(self.model, batches, plan, weighting=self.weighting,
                                   skip_first_tokens=self.skip_first_tokens, device=self.device, source=source,
                                   description=f"Calibration pass: {purpose}")
        models_run = 1 if source is None else 1 + bool(plan.target_inputs())
        self.passes.append({"purpose": purpose, "batches": len(batches), "forwards": len(batches) * models_run,
                            "deepest_layer_input": plan.deepest(), "sequential": source is not None,
                            "seconds": round(time.perf_counter() - started, 3)})
        return stats
