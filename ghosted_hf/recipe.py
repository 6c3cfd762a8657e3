"""`ghost_prune`: calibration text -> statistics -> layer selection -> operators -> a GhostedForCausalLM."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from transformers import PreTrainedModel

from .calibration import CalibrationStatistics, StatisticsPlan, collect_statistics
from .data import CalibrationSource, TokenBatches, tokenize_texts
from .operators import BoundaryFit, fit_boundary
from .options import PruneOptions
from .remote.configuration_ghosted import expected_boundaries
from .remote.modeling_ghosted import GhostedForCausalLM
from .selection import Selection, check_num_layers, select_layers, selection_plan
from .surgery import prune_layers, validate_removal

logger = logging.getLogger(__name__)

METHOD = "Ghosted Layers (arXiv 2605.15491)"


def check_token_budget(tokens: int, hidden_size: int) -> None:
    """The C x C least-squares fit is underdetermined with fewer tokens than channels."""
    if tokens < hidden_size:
        raise ValueError(
            f"The calibration data gave {tokens} usable tokens, but fitting a {hidden_size}x{hidden_size} operator "
            f"needs at least {hidden_size} (the hidden size), and about {10 * hidden_size} for a stable fit. "
            "Add calibration text or raise seq_len / num_sequences."
        )


def boundary_pairs(total: int, removed: list[int]) -> list[tuple[int, int]]:
    """(s, e) per boundary: X_s enters the first removed layer, X_e the next kept layer (e == total: the norm)."""
    return [(b["removed"][0], b["removed"][-1] + 1) for b in expected_boundaries(total, removed)]


def fit_plan(kind: str, s: int, e: int, options: PruneOptions, source: bool = True, target: bool = True) -> StatisticsPlan:
    """Statistics one boundary's operator and its fit figures need; source/target select the sides
    (sequential fitting takes the source side from the patched model)."""
    src, tgt = ({s} if source else set()), ({e} if target else set())
    pair = frozenset({(s, e)}) if source else frozenset()
    return StatisticsPlan(
        grams=frozenset(src),
        pairs=pair,
        abs_sums=frozenset(src | tgt) if kind == "linearpatch-diag" else frozenset(),
        rotated_abs_sums=frozenset(src | tgt) if kind == "linearpatch-rotate" else frozenset(),
        mlp_blocks=pair if kind == "replaceme-ls" else frozenset(),
        weighting=options.weighting,
        skip_first_tokens=options.skip_first_tokens,
    )


def _merge(plans: list[StatisticsPlan], options: PruneOptions) -> StatisticsPlan:
    merged = StatisticsPlan(weighting=options.weighting, skip_first_tokens=options.skip_first_tokens)
    for plan in plans:
        merged = merged.merged(plan)
    return merged


class _Calibrator:
    """Runs statistics passes over one calibration set and keeps what they gathered."""

    def __init__(self, model: nn.Module, data: TokenBatches | None, stats: CalibrationStatistics | None,
                 options: PruneOptions) -> None:
        self.model, self.data, self.stats, self.options = model, data, stats, options
        self.passes: list[dict[str, Any]] = []  # cost of every statistics pass, for the report

    def ensure(self, plan: StatisticsPlan, description: str) -> CalibrationStatistics:
        missing = plan.missing_from(self.stats)
        if missing is not None:
            if self.data is None:
                raise ValueError(f"The given statistics lack what {description} needs, and no calibration text was given.")
            fresh = self.collect(missing, description)
            self.stats = fresh if self.stats is None else self.stats.with_tensors(fresh)
        return self.stats

    def collect(self, plan: StatisticsPlan, description: str, source: tuple[nn.Module, dict[int, int]] | None = None) -> CalibrationStatistics:
        stats = collect_statistics(self.model, self.data.batches, plan, device=self.options.stats_device,
                                   source=source, description=description)
        self.passes.extend({"purpose": description, **p} for p in stats.passes)
        return stats


def fit_operators(calibrator: _Calibrator, removed: list[int], options: PruneOptions) -> list[BoundaryFit]:
    """One fit per boundary; sequential fitting refits each source on the model pruned and patched so far."""
    total = calibrator.model.config.num_hidden_layers
    kind = options.operator
    pairs = boundary_pairs(total, removed)
    sequential = options.fitting == "sequential" and len(pairs) > 1 and kind not in ("none", "replaceme-ls")
    plans = [fit_plan(kind, s, e, options, source=not sequential or k == 0) for k, (s, e) in enumerate(pairs)]
    stats = calibrator.ensure(_merge(plans, options), "fitting the operators")
    fits: list[BoundaryFit] = []
    for k, (s, e) in enumerate(pairs):
        if sequential and k > 0:
            before = [i for i in removed if i < s]
            patched = prune_layers(calibrator.model, before, {f.source: f.operator.float() for f in fits},
                                   operator_kind=kind)
            local = calibrator.collect(fit_plan(kind, s, e, options, target=False),
                                       f"Sequential fit {k + 1}/{len(pairs)}", source=(patched, {s: s - len(before)}))
            fit = fit_boundary(stats.with_tensors(local), kind, s, e, options.ridge)
            fit.figures["fitted_on"] = "pruned and patched model"
        else:
            fit = fit_boundary(stats, kind, s, e, options.ridge)
            fit.figures["fitted_on"] = "dense model"
        fits.append(fit)
    return fits


def fold_into_down_proj(model: GhostedForCausalLM, layer: int, transform: torch.Tensor) -> None:
    """Replace the MLP output m of pruned-model `layer` by m @ T (ReplaceMe's fused export)."""
    down = model.model.layers[layer].mlp.down_proj
    t = transform.to(device=down.weight.device, dtype=torch.float64)
    down.weight = nn.Parameter((t.T @ down.weight.double()).to(down.weight.dtype))
    if down.bias is not None:
        down.bias = nn.Parameter((down.bias.double() @ t).to(down.bias.dtype))


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def select(calibrator: _Calibrator, options: PruneOptions) -> Selection:
    """The layers to remove, with the scores of every candidate."""
    if options.criterion == "manual":
        return Selection(sorted(options.layers), "manual", {}, "n/a")
    total = calibrator.model.config.num_hidden_layers
    # ReplaceMe folds into the layer before the block, so only there may a block not start at layer 0.
    first = 1 if options.operator == "replaceme-ls" else 0
    plan = selection_plan(options.criterion, options.num_layers, total, options.weighting,
                          options.skip_first_tokens, first)
    stats = calibrator.ensure(plan, f"criterion {options.criterion!r}")
    return select_layers(stats, options.criterion, options.num_layers, options.ridge, first=first)


def build(model: PreTrainedModel, removed: list[int], fits: list[BoundaryFit], options: PruneOptions) -> GhostedForCausalLM:
    """The pruned model with each boundary's operator installed (or folded, for fused kinds)."""
    kind = options.operator
    operators = {f.source: f.operator for f in fits if kind != "none" and f.operator is not None}
    ghosted = prune_layers(model, removed, operators, operator_kind=kind,
                           operator_dtype=getattr(torch, options.operator_dtype))
    for fit, record in zip(fits, ghosted.config.ghost_boundaries):
        if fit.fused is not None:
            layer = fit.source - 1 - sum(1 for i in removed if i < fit.source - 1)
            fold_into_down_proj(ghosted, layer, fit.fused)
            record["operator"] = "identity"
            record["fused_into"] = f"model.layers.{layer}.mlp.down_proj"
        record["fit"] = fit.figures
    return ghosted


def report(ghosted: GhostedForCausalLM, base_name: str | None, dense_parameters: int, selection: Selection,
           calibrator: _Calibrator, options: PruneOptions, seconds: float) -> dict[str, Any]:
    """Everything needed to reproduce and judge the result; saved in config.json and the model card."""
    operator_parameters = sum(p.numel() for p in ghosted.ghost_operators().values())
    data, stats = calibrator.data, calibrator.stats
    return {
        "method": METHOD,
        "base_model": base_name or None,
        "selection": selection.describe(),
        "operator": options.operator,
        "fitting": options.fitting,
        "solver": {"dtype": "float64", "solve": "torch.linalg.solve", "ridge": options.ridge,
                   "ridge_scale": "mean diagonal of X^T X", "weighting": options.weighting,
                   "skip_first_tokens": options.skip_first_tokens},
        "calibration": {**(data.describe() if data else {}), "tokens_used": stats.tokens if stats else None},
        "cost": {"seconds": round(seconds, 2), "passes": calibrator.passes},
        "parameters": {"dense": dense_parameters, "pruned": count_parameters(ghosted) - operator_parameters,
                       "operators": operator_parameters},
        "options": options.to_dict(),
        "versions": {"ghosted_hf": _version(), "transformers": transformers.__version__, "torch": torch.__version__},
    }


def ghost_prune(
    model: PreTrainedModel,
    tokenizer: Any = None,
    calibration: CalibrationSource | None = None,
    options: PruneOptions | None = None,
    *,
    statistics: CalibrationStatistics | str | Path | None = None,
    **overrides: Any,
) -> GhostedForCausalLM:
    """Remove layers from `model` and recover them in closed form.

    `calibration` is a list of strings, a text file or a `datasets.Dataset`; options are `PruneOptions`
    fields (e.g. ``num_layers=8, criterion="ghost-aware", operator="ghost"``). Precomputed `statistics`
    (object or safetensors file) are used wherever they hold what is needed. The model shares the dense
    model's tensors (treat `model` as consumed); the report is in ``config.ghost_provenance``.
    """
    options = PruneOptions.build(options, **overrides)
    started = time.perf_counter()
    check_request(model, options)
    data = prepare_calibration(model, tokenizer, calibration, statistics, options)
    if isinstance(statistics, (str, Path)):
        statistics = CalibrationStatistics.load(statistics, device=options.stats_device or "cpu")
    calibrator = _Calibrator(model, data, statistics, options)
    base_name, dense_parameters = model.config._name_or_path, count_parameters(model)

    selection = select(calibrator, options)
    fits = fit_operators(calibrator, selection.removed, options)
    ghosted = build(model, selection.removed, fits, options)
    ghosted.config.ghost_provenance = report(ghosted, base_name, dense_parameters, selection, calibrator, options,
                                             time.perf_counter() - started)
    logger.info("Removed layers %s (%s, %s).", selection.removed, options.criterion, options.operator)
    return ghosted


def check_request(model: PreTrainedModel, options: PruneOptions) -> None:
    total = model.config.num_hidden_layers
    if options.criterion != "manual":
        check_num_layers(options.num_layers, total)
        return
    removed = validate_removal(options.layers, total)
    if options.operator == "replaceme-ls" and removed[0] == 0:
        raise ValueError("replaceme-ls folds into the layer before the removed block; it cannot remove layer 0.")


def prepare_calibration(model: PreTrainedModel, tokenizer: Any, calibration: CalibrationSource | None,
                        statistics: Any, options: PruneOptions) -> TokenBatches | None:
    """Token batches of the calibration text (None when only precomputed statistics are given)."""
    if calibration is None:
        if statistics is None:
            raise ValueError("Pass calibration text (list of strings, text file or Dataset) or precomputed statistics.")
        return None
    if tokenizer is None:
        raise ValueError("A tokenizer is needed to tokenize the calibration text.")
    data = tokenize_texts(tokenizer, calibration, options.seq_len, options.num_sequences, options.batch_size)
    sequences = data.describe()["sequences"]
    check_token_budget(data.num_tokens - options.skip_first_tokens * sequences, model.config.hidden_size)
    return data


def _version() -> str:
    from . import __version__

    return __version__
