"""One truncated forward pass with hooks -> streaming float64 sufficient statistics.

Index convention: `i` in 0..L-1 is the hidden state entering decoder layer `i` (dense numbering); `i == L`
is the hidden state entering the final norm. A boundary that removes layers s..e-1 maps X_s to X_e.

Only per-batch activations are held, so memory does not grow with the number of calibration tokens;
the pass stops right after the deepest hidden state any statistic needs.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from .hadamard import rotation

logger = logging.getLogger(__name__)

WEIGHTINGS = ("none", "rms")
STATS_FORMAT = "ghosted-stats-v1"


@dataclass(frozen=True)
class StatisticsPlan:
    """Which statistics one pass accumulates (indices in dense numbering)."""

    grams: frozenset[int] = frozenset()  # X_i^T X_i
    pairs: frozenset[tuple[int, int]] = frozenset()  # X_s^T X_e and sum ||x_e||^2 (weighted by the source)
    cosines: frozenset[tuple[int, int]] = frozenset()  # sum cos(x_s, x_e) and angular distance
    abs_sums: frozenset[int] = frozenset()  # sum |x_i| per channel (LinearPatch-diag)
    rotated_abs_sums: frozenset[int] = frozenset()  # sum |x_i H| per channel (LinearPatch-rotate)
    mlp_blocks: frozenset[tuple[int, int]] = frozenset()  # ReplaceMe: MLP output of layer s-1 against X_s, X_e
    weighting: str = "none"
    skip_first_tokens: int = 0

    def __post_init__(self) -> None:
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"Unknown token weighting {self.weighting!r}; choose one of {WEIGHTINGS}.")
        if any(s < 1 for s, _ in self.mlp_blocks):
            raise ValueError("replaceme-ls needs a kept layer before the removed block; it cannot remove layer 0.")

    def source_inputs(self) -> set[int]:
        return set(self.grams) | set(self.abs_sums) | set(self.rotated_abs_sums) | {s for s, _ in self.pairs} | {
            s for s, _ in self.cosines} | {s for s, _ in self.mlp_blocks}

    def target_inputs(self) -> set[int]:
        return {e for _, e in self.pairs} | {e for _, e in self.cosines} | {e for _, e in self.mlp_blocks}

    def mlp_layers(self) -> set[int]:
        return {s - 1 for s, _ in self.mlp_blocks}

    def missing_from(self, stats: CalibrationStatistics | None) -> StatisticsPlan | None:
        """The part of this plan that `stats` does not hold yet (None when nothing is missing)."""
        have = stats.tensors if stats is not None else {}
        if stats is not None and (stats.weighting, stats.skip_first_tokens) != (self.weighting, self.skip_first_tokens):
            raise ValueError(
                f"The statistics were collected with weighting={stats.weighting!r}, skip_first_tokens="
                f"{stats.skip_first_tokens}; the options ask for {self.weighting!r}, {self.skip_first_tokens}."
            )
        missing = StatisticsPlan(
            grams=frozenset(i for i in self.grams if f"gram.{i}" not in have),
            pairs=frozenset(p for p in self.pairs if f"cross.{p[0]}.{p[1]}" not in have),
            cosines=frozenset(p for p in self.cosines if f"cos.{p[0]}.{p[1]}" not in have),
            abs_sums=frozenset(i for i in self.abs_sums if f"abs.{i}" not in have),
            rotated_abs_sums=frozenset(i for i in self.rotated_abs_sums if f"rabs.{i}" not in have),
            mlp_blocks=frozenset(p for p in self.mlp_blocks if f"mlp_target.{p[0]}.{p[1]}" not in have),
            weighting=self.weighting,
            skip_first_tokens=self.skip_first_tokens,
        )
        return missing if missing.source_inputs() | missing.target_inputs() else None

    def merged(self, other: StatisticsPlan) -> StatisticsPlan:
        if (self.weighting, self.skip_first_tokens) != (other.weighting, other.skip_first_tokens):
            raise ValueError("Cannot merge plans with different token weighting or skipped tokens.")
        return StatisticsPlan(
            self.grams | other.grams, self.pairs | other.pairs, self.cosines | other.cosines,
            self.abs_sums | other.abs_sums, self.rotated_abs_sums | other.rotated_abs_sums,
            self.mlp_blocks | other.mlp_blocks, self.weighting, self.skip_first_tokens,
        )


@dataclass
class CalibrationStatistics:
    """Float64 sums over calibration tokens, keyed like `gram.3`, `cross.3.7`, `cos.3.7`."""

    tensors: dict[str, torch.Tensor]
    num_layers: int
    hidden_size: int
    tokens: int
    weighting: str
    skip_first_tokens: int
    rotation_kind: str = "none"
    passes: list[dict[str, Any]] = field(default_factory=list)

    def _get(self, key: str, what: str) -> torch.Tensor:
        if key not in self.tensors:
            raise KeyError(f"These statistics hold no {what} ({key}); collect them with a plan that includes it.")
        return self.tensors[key]

    def gram(self, i: int) -> torch.Tensor:
        return self._get(f"gram.{i}", f"Gram matrix of the input of layer {i}")

    def cross(self, s: int, e: int) -> torch.Tensor:
        return self._get(f"cross.{s}.{e}", f"cross term X_{s}^T X_{e}")

    def energy(self, s: int, e: int) -> float:
        return float(self._get(f"energy.{s}.{e}", f"target energy of ({s}, {e})"))

    def has_pair(self, s: int, e: int) -> bool:
        return f"cross.{s}.{e}" in self.tensors and f"gram.{s}" in self.tensors

    def mean_cosine(self, s: int, e: int) -> float:
        return float(self._get(f"cos.{s}.{e}", f"cosine of ({s}, {e})")) / self.tokens

    def mean_angular(self, s: int, e: int) -> float:
        return float(self._get(f"ang.{s}.{e}", f"angular distance of ({s}, {e})")) / self.tokens

    def abs_mean(self, i: int) -> torch.Tensor:
        return self._get(f"abs.{i}", f"mean |x| of the input of layer {i}") / self.tokens

    def rotated_abs_mean(self, i: int) -> torch.Tensor:
        return self._get(f"rabs.{i}", f"rotated mean |x| of the input of layer {i}") / self.tokens

    def mlp_terms(self, s: int, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(M^T M, M^T X_s, M^T X_e) for the MLP output M of layer s-1."""
        what = f"ReplaceMe terms of ({s}, {e})"
        return (self._get(f"mlp_gram.{s}", what), self._get(f"mlp_source.{s}", what),
                self._get(f"mlp_target.{s}.{e}", what))

    def with_tensors(self, other: CalibrationStatistics) -> CalibrationStatistics:
        """These statistics updated with `other`'s (same calibration tokens; `other` wins on shared keys)."""
        if other.tokens != self.tokens or other.num_layers != self.num_layers:
            raise ValueError(
                f"Cannot combine statistics of {self.tokens} and {other.tokens} tokens: they come from different "
                "calibration data (pass the same text, sequence length and number of sequences)."
            )
        return CalibrationStatistics(
            tensors={**self.tensors, **other.tensors}, num_layers=self.num_layers, hidden_size=self.hidden_size,
            tokens=self.tokens, weighting=self.weighting, skip_first_tokens=self.skip_first_tokens,
            rotation_kind=other.rotation_kind if other.rotation_kind != "none" else self.rotation_kind,
            passes=self.passes + other.passes,
        )

    def save(self, path: str | Path) -> None:
        """Write to a safetensors file, to try other selections or operators without another pass."""
        metadata = {
            "format": STATS_FORMAT, "num_layers": str(self.num_layers), "hidden_size": str(self.hidden_size),
            "tokens": str(self.tokens), "weighting": self.weighting, "skip_first_tokens": str(self.skip_first_tokens),
            "rotation_kind": self.rotation_kind,
        }
        save_file({k: v.detach().cpu().contiguous() for k, v in self.tensors.items()}, str(path), metadata=metadata)

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu") -> CalibrationStatistics:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
        if meta.get("format") != STATS_FORMAT:
            raise ValueError(f"{path} is not a ghosted_hf statistics file (format {meta.get('format')!r}).")
        return cls(
            tensors=load_file(str(path), device=str(device)), num_layers=int(meta["num_layers"]),
            hidden_size=int(meta["hidden_size"]), tokens=int(meta["tokens"]), weighting=meta["weighting"],
            skip_first_tokens=int(meta["skip_first_tokens"]), rotation_kind=meta.get("rotation_kind", "none"),
        )


class _StopForward(Exception):
    """Raised by the hook on the deepest needed hidden state: the rest of the model is not run."""


def decoder_parts(model: nn.Module) -> tuple[nn.ModuleList, nn.Module]:
    """The decoder layers and final norm of a Llama-style causal LM (dense or ghosted)."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "norm"):
        raise ValueError(f"Expected a causal LM with `model.layers` and `model.norm`, got {type(model).__name__}.")
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


def _where(i: int, num_layers: int) -> str:
    return "the final norm" if i == num_layers else f"layer {i}"


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
    num_layers = len(layers)
    deepest = max(inputs | {i + 1 for i in mlp_layers})
    captured: dict[Any, torch.Tensor] = {}

    def rows(hidden: torch.Tensor, where: str) -> torch.Tensor:
        kept = hidden[keep.to(hidden.device)]
        if not torch.isfinite(kept).all():
            raise FloatingPointError(
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
            where = f"the input of {_where(i, num_layers)}" + (f" (the output of layer {i - 1})" if i else "")
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
            target = layers[i] if i < num_layers else norm
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

    def __init__(self, plan: StatisticsPlan, hidden_size: int, device: str | torch.device = "cpu") -> None:
        self.plan, self.hidden_size, self.device = plan, hidden_size, torch.device(device)
        self.sums: dict[str, torch.Tensor] = {}
        self.tokens = 0
        self.rotation, self.rotation_kind = (None, "none")
        if plan.rotated_abs_sums:
            h, self.rotation_kind = rotation(hidden_size)
            self.rotation = h.to(device)

    def result(self, num_layers: int, cost: dict[str, Any] | None = None) -> CalibrationStatistics:
        if self.tokens == 0:
            raise ValueError("The calibration batches contain no real token (all positions are padding or skipped).")
        return CalibrationStatistics(
            tensors=self.sums, num_layers=num_layers, hidden_size=self.hidden_size, tokens=self.tokens,
            weighting=self.plan.weighting, skip_first_tokens=self.plan.skip_first_tokens,
            rotation_kind=self.rotation_kind, passes=[cost] if cost else [],
        )

    def add(self, key: str, value: torch.Tensor) -> None:
        if key in self.sums:
            self.sums[key] += value
        else:
            self.sums[key] = value.clone()

    def weights(self, x: torch.Tensor) -> torch.Tensor:
        if self.plan.weighting == "rms":
            return x.shape[1] / x.square().sum(dim=1).clamp_min(torch.finfo(torch.float64).tiny)
        return torch.ones(x.shape[0], dtype=torch.float64, device=x.device)

    def update(self, captured: Mapping[Any, torch.Tensor]) -> None:
        plan = self.plan
        x = {k: v.to(device=self.device, dtype=torch.float64) for k, v in captured.items()}
        w = {i: self.weights(x[i]) for i in plan.grams | {s for s, _ in plan.pairs}}
        self.tokens += next(iter(x.values())).shape[0]
        for i in plan.grams:
            self.add(f"gram.{i}", (x[i] * w[i][:, None]).T @ x[i])
        for i in plan.abs_sums:
            self.add(f"abs.{i}", x[i].abs().sum(dim=0))
        for i in plan.rotated_abs_sums:
            self.add(f"rabs.{i}", (x[i] @ self.rotation).abs().sum(dim=0))
        for s, e in plan.pairs:
            self.add(f"cross.{s}.{e}", (x[s] * w[s][:, None]).T @ x[e])
            self.add(f"energy.{s}.{e}", (w[s] * x[e].square().sum(dim=1)).sum().reshape(1))
        for s, e in plan.cosines:
            norms = (x[s].norm(dim=1) * x[e].norm(dim=1)).clamp_min(torch.finfo(torch.float64).tiny)
            cos = ((x[s] * x[e]).sum(dim=1) / norms).clamp(-1.0, 1.0)
            self.add(f"cos.{s}.{e}", cos.sum().reshape(1))
            self.add(f"ang.{s}.{e}", (torch.arccos(cos) / math.pi).sum().reshape(1))
        for s in {s for s, _ in plan.mlp_blocks}:
            m = x[("mlp", s - 1)]
            self.add(f"mlp_gram.{s}", m.T @ m)
            self.add(f"mlp_source.{s}", m.T @ x[s])
        for s, e in plan.mlp_blocks:
            self.add(f"mlp_target.{s}.{e}", x[("mlp", s - 1)].T @ x[e])


def collect_statistics(
    model: nn.Module,
    batches: Iterable[Mapping[str, torch.Tensor]],
    plan: StatisticsPlan,
    *,
    device: str | torch.device | None = None,
    source: tuple[nn.Module, Mapping[int, int]] | None = None,
    progress: bool = True,
    description: str = "Calibration statistics",
) -> CalibrationStatistics:
    """Accumulate `plan` over `batches` with one truncated pass of `model` per batch.

    With `source=(patched_model, index_map)`, source-side hidden states (grams, the first index of every
    pair) come from `patched_model` (whose layer `index_map[i]` plays dense layer `i`), targets from `model`:
    this is how operators are fitted sequentially on an already pruned and patched model.
    """
    layers, _ = decoder_parts(model)
    num_layers = len(layers)
    hidden_size = model.get_input_embeddings().weight.shape[1]
    device = torch.device(device) if device is not None else input_device(model)
    accumulator = StatisticsAccumulator(plan, hidden_size, device)
    source_side = plan.source_inputs() if source is not None else set()
    target_side = (plan.source_inputs() | plan.target_inputs()) - source_side
    batches = list(batches)
    forwards, started = 0, time.perf_counter()
    for batch in tqdm(batches, desc=description, disable=not progress, leave=False):
        keep = token_mask(batch["attention_mask"], plan.skip_first_tokens)
        if not keep.any():
            continue
        captured = {}
        if target_side or plan.mlp_layers():
            captured.update(capture_hidden_states(model, batch, target_side, plan.mlp_layers(), keep, device))
            forwards += 1
        if source is not None:
            patched, index_map = source
            got = capture_hidden_states(patched, batch, {index_map[i] for i in source_side}, set(), keep, device)
            captured.update({i: got[index_map[i]] for i in source_side})
            forwards += 1
        accumulator.update(captured)
    deepest = max(plan.source_inputs() | plan.target_inputs() | {i + 1 for i in plan.mlp_layers()})
    cost = {"batches": len(batches), "forwards": forwards, "deepest_layer_input": deepest,
            "sequential": source is not None, "seconds": round(time.perf_counter() - started, 3)}
    return accumulator.result(num_layers, cost)
