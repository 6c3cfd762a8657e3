"""`ghost_prune`: calibration text -> statistics -> layer selection -> operators -> a GhostedForCausalLM.

Orchestration only: statistics live in calibration.py, fits in operators.py, criteria in selection.py,
weight edits in surgery.py.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import PreTrainedModel

from .assets import base_model_info
from .calibration import (Calibrator, CalibrationStatistics, ShardSpec, StatisticsPlan, check_same_model,
                          collect_statistics, model_fingerprint, stat_key)
from .data import CalibrationSource, TokenBatches, tokenize_texts
from .errors import GhostedError
from .operators import BoundaryFit, OperatorKind, lookahead_correction, operator_kind
from .options import ExportOptions, PruneOptions
from .remote.configuration_ghosted import LAYER_TARGET, expected_boundaries, pruned_index
from .remote.modeling_ghosted import GhostedForCausalLM, ghost_tensor_key
from .selection import (ContiguousCriterion, Selection, SelectionRequest, candidate_layers,
                        check_num_layers, criterion)
from .surgery import count_parameters, export_plain, fold_into_down_proj, prune_layers, refuse_biases, validate_removal

logger = logging.getLogger(__name__)

METHOD = "Ghosted Layers (arXiv 2605.15491)"


def ghost_prune(
    model: PreTrainedModel,
    tokenizer: Any = None,
    calibration: CalibrationSource | None = None,
    options: PruneOptions | None = None,
    *,
    statistics: CalibrationStatistics | str | Path | None = None,
    **overrides: Any,
) -> PreTrainedModel:
    """Remove layers from `model` and recover them in closed form.

    `calibration` is a list of strings, a text file or a `datasets.Dataset`; options are `PruneOptions`
    fields (e.g. ``num_layers=8, criterion="ghost-aware", operator="ghost"``). Precomputed `statistics`
    (object or safetensors file) are used wherever they hold what is needed. Returns a `GhostedForCausalLM`,
    or for operator kinds that fold into the weights (`folded`, `replaceme-ls`) the stock architecture of
    `model`. It shares the dense model's tensors (treat `model` as consumed); the report is in
    ``config.ghost_provenance``.
    """
    options = PruneOptions.build(options, **overrides)
    started = time.perf_counter()
    check_request(model, options)
    calibrator = Calibrator(model, *prepare_calibration(model, tokenizer, calibration, statistics, options),
                            weighting=options.weighting, skip_first_tokens=options.skip_first_tokens,
                            device=options.stats_device)
    selection, fitted = select(calibrator, options)
    fits = fitted.get(tuple(selection.removed)) or fit_operators(calibrator, selection.removed, options)
    if hasattr(model, "load_model"):  # layer-wise calibration: the statistics are done; read what the build keeps
        model = model.load_model(selection.removed)
    dense_parameters = count_parameters(model)
    ghosted = build(model, selection.removed, fits, options)
    ghosted.config.ghost_provenance = provenance(ghosted, model.config._name_or_path, dense_parameters, selection,
                                                 calibrator, options, time.perf_counter() - started)
    logger.info("Removed layers %s (%s, %s).", selection.removed, options.criterion, options.operator)
    return export_plain(ghosted) if operator_kind(options.operator).plain else ghosted


def selection_request(depth: int, options: PruneOptions) -> SelectionRequest:
    return SelectionRequest(depth=depth, num_layers=options.num_layers,
                            first=operator_kind(options.operator).first_removable, ridge=options.ridge,
                            layers=tuple(options.layers or ()), max_blocks=options.max_blocks)


def statistics_plan(depth: int, options: PruneOptions) -> StatisticsPlan:
    """Everything `ghost_prune` with these options can need from the dense model, known before selection: the
    criterion's statistics and the fit statistics of every boundary it may choose (every candidate span of a
    contiguous criterion, the given layers' boundaries for 'manual'). ShortGPT's scattered layers and
    sequential fits of later boundaries need passes on the chosen layers (pass calibration text then)."""
    chosen, kind = criterion(options.criterion), operator_kind(options.operator)
    request = selection_request(depth, options)
    plan = chosen.statistics(request)
    if isinstance(chosen, ContiguousCriterion):
        spans = chosen.spans(request)
    elif chosen.takes_layers:
        spans = boundary_spans(depth, sorted(options.layers))
    else:
        spans = []
    return StatisticsPlan.union([plan, *(kind.statistics(s, e) for s, e in spans)])


def select(calibrator: Calibrator, options: PruneOptions) -> tuple[Selection, dict[tuple[int, ...], list[BoundaryFit]]]:
    """The layers to remove, with the scores of every candidate, and the fits made while verifying candidates
    (removed layers -> fits; empty without verification)."""
    chosen = criterion(options.criterion)
    request = selection_request(calibrator.model.config.num_hidden_layers, options)
    plan = chosen.statistics(request)
    stats = calibrator.ensure(plan, f"selection by {chosen.name!r}") if plan else None
    selection = chosen.select(stats, request)
    if options.verify_candidates > 1 and len(selection.scores) > 1:
        return verify(calibrator, selection, options)
    return selection, {}


def verify(calibrator: Calibrator, selection: Selection, options: PruneOptions,
           ) -> tuple[Selection, dict[tuple[int, ...], list[BoundaryFit]]]:
    """Refit the best `verify_candidates` candidates as `ghost_prune` would (sequentially, on the model pruned
    and patched upstream) and keep the one whose fitted residuals ||X W - X_e||^2 / ||X_e||^2 sum to the least:
    the cheap score fits every block on the dense model, but a later boundary sees the upstream error too."""
    fitted, verified = {}, {}
    for name in selection.ranked()[: options.verify_candidates]:
        removed = tuple(candidate_layers(name))
        fitted[removed] = fit_operators(calibrator, list(removed), options)
        verified[name] = sum(fit.figures.get("residual_vs_target", float("nan")) for fit in fitted[removed])
        logger.info("Candidate %s: score %.4g, fitted residuals sum %.4g.", name, selection.scores[name], verified[name])
    best = min(verified, key=lambda name: (verified[name], name))
    return dataclasses.replace(selection, removed=candidate_layers(best), verified=verified), fitted


def boundary_spans(depth: int, removed: list[int]) -> list[tuple[int, int]]:
    """(s, e) per boundary: X_s enters the first removed layer, X_e the next kept layer (e == depth: the norm)."""
    return [(b["removed"][0], b["removed"][-1] + 1) for b in expected_boundaries(depth, removed)]


def fit_operators(calibrator: Calibrator, removed: list[int], options: PruneOptions) -> list[BoundaryFit]:
    """One fit per boundary; sequential fitting refits each source on the model pruned and patched so far.
    With `lookahead` each boundary feeding a layer is refitted once on that layer's output; with `norm_operator`
    one more fit corrects the final norm's input (the last fit, source and target the depth)."""
    kind = operator_kind(options.operator)
    depth = calibrator.model.config.num_hidden_layers
    spans = boundary_spans(depth, removed)
    if (options.lookahead != "none" or options.norm_operator) and (hasattr(calibrator.model, "patched") or calibrator.data is None):
        raise GhostedError("lookahead and norm_operator fit on the pruned and patched model: they need the calibration "
                           "text (not only precomputed statistics) and a model in memory (not layer-wise calibration).")
    sequential = options.fitting == "sequential" and kind.sequential and len(spans) > 1
    plans = [kind.statistics(s, e) for s, e in spans]
    # Sequentially fitted boundaries read their sources from the patched model, so the dense pass skips them.
    dense_plan = StatisticsPlan.union(plan.split_at(s)[1] if sequential and k else plan
                                      for k, (plan, (s, _)) in enumerate(zip(plans, spans)))
    stats = calibrator.ensure(dense_plan, f"fitting the {kind.name} operators")
    fits: list[BoundaryFit] = []
    for k, (plan, (s, e)) in enumerate(zip(plans, spans)):
        if sequential and k > 0:
            fits.append(_fit_on_patched(calibrator, kind, stats, plan.split_at(s)[0], fits, removed, (s, e),
                                        options, f"sequential fit {k + 1}/{len(spans)}"))
        else:
            fits.append(kind.fit(stats, s, e, options.ridge))
            fits[-1].figures["fitted_on"] = "dense model"
        if options.lookahead != "none" and e < depth:
            fits[-1] = _look_ahead(calibrator, kind, fits, removed, options, f"lookahead {k + 1}/{len(spans)}")
    if options.norm_operator and spans[-1][1] < depth:
        patched = _patched_model(calibrator, kind, fits, removed)
        local = calibrator.collect(kind.statistics(depth, depth), "operator at the final norm's input",
                                   source=(patched, {depth: depth - len(removed)}))
        fits.append(kind.fit(local, depth, depth, options.ridge))
        fits[-1].figures["fitted_on"] = "pruned and patched model, against the dense model's final norm input"
    return fits


def _patched_model(calibrator: Calibrator, kind: OperatorKind, fits: list[BoundaryFit], removed: list[int]
                   ) -> GhostedForCausalLM:
    """The calibrated model pruned of `removed` with the fits so far installed (fused transforms folded)."""
    patched = prune_layers(calibrator.model, removed, {f.source: f.operator.float() for f in fits if f.operator is not None},
                           biases={f.source: f.bias.float() for f in fits if f.bias is not None},
                           operator_kind=kind.name)
    for fit in fits:
        if fit.fused is not None:
            fold_into_down_proj(patched, fit.source - 1, fit.fused)
    return patched


def _look_ahead(calibrator: Calibrator, kind: OperatorKind, fits: list[BoundaryFit], removed: list[int],
                options: PruneOptions, purpose: str) -> BoundaryFit:
    """The last fit refined once so that the first kept layer's OUTPUT matches the dense model's, X_{e+1}.

    On the model patched with the fit, u = x W (+ b) enters kept layer e and z leaves it; a closed-form correction
    u -> u R (+ c) toward X_{e+1} (`operators.lookahead_correction`: the layer's update held fixed, or the layer
    linearised on these tokens) is composed into the fit: W' = W R, b' = b R + c. One pass over the patched model
    alone (u^T u, u^T z) and one beside the dense model (u^T X_{e+1}); the fit figures stay those of the fit
    before the refit."""
    fit = fits[-1]
    s, e = fit.source, fit.target
    upto = [i for i in removed if i < e]
    patched = _patched_model(calibrator, kind, fits, upto)
    p = pruned_index(e, upto)
    affine = fit.bias is not None
    own = calibrator.collect(StatisticsPlan(grams=frozenset({p}), pairs=frozenset({(p, p + 1)}),
                                            sums=frozenset({(p, p + 1)})), f"{purpose}: patched layer {p}",
                             model=patched)
    dense = calibrator.collect(StatisticsPlan(pairs=frozenset({(s, e + 1)}), sums=frozenset({(s, e + 1)})),
                               f"{purpose}: dense output of layer {e}", source=(patched, {s: p}))
    gram = own.gram(p)
    u_sum, z_sum, count = own.sums(p, p + 1)
    sums = (u_sum, z_sum, dense.sums(s, e + 1)[1], count) if affine else None
    r, c = lookahead_correction(gram, own.cross(p, p + 1), dense.cross(s, e + 1), options.ridge, options.lookahead,
                                sums)
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    w = fit.operator.to(r)
    refined = dataclasses.replace(fit, operator=w @ r, bias=(fit.bias.to(r) @ r + c) if affine else None,
                                  figures=dict(fit.figures))
    refined.figures["lookahead_change"] = float(torch.linalg.norm(w @ r - w) / torch.linalg.norm(w - eye).clamp_min(1e-300))
    return refined


def _fit_on_patched(calibrator: Calibrator, kind: OperatorKind, stats: CalibrationStatistics, plan: StatisticsPlan,
                    fits: list[BoundaryFit], removed: list[int], span: tuple[int, int], options: PruneOptions,
                    purpose: str) -> BoundaryFit:
    """Fit boundary `span` with its source statistics taken from the model pruned and patched before it."""
    s, e = span
    before = [i for i in removed if i < s]
    if hasattr(calibrator.model, "patched"):  # layer-wise: a second stream through the same layer reads
        if any(f.fused is not None or f.bias is not None for f in fits) or plan.mlp_terms:
            raise GhostedError(f"Layer-wise calibration cannot refit {kind.name!r} sequentially (its transform of an "
                               "MLP output or its bias is not streamed layer by layer): pass fitting='independent'.")
        patched = calibrator.model.patched(before, {f.source: f.operator.float() for f in fits})
    else:
        patched = _patched_model(calibrator, kind, fits, before)
    index_map = {i: pruned_index(i, before) for i in (s - 1, s) if i >= 0}  # X_s, and layer s-1's MLP output
    local = calibrator.collect(plan, purpose, source=(patched, index_map))
    fit = kind.fit(stats.with_tensors(local), s, e, options.ridge)
    fit.figures["fitted_on"] = "pruned and patched model"
    return fit


def build(model: PreTrainedModel, removed: list[int], fits: list[BoundaryFit], options: PruneOptions) -> GhostedForCausalLM:
    """The pruned model with each boundary's operator installed (or folded into the weights, for fused kinds)."""
    operators = {f.source: f.operator for f in fits if f.operator is not None}
    ghosted = prune_layers(model, removed, operators, biases={f.source: f.bias for f in fits if f.bias is not None},
                           operator_kind=options.operator, operator_dtype=getattr(torch, options.operator_dtype))
    for fit, record in zip(fits, ghosted.config.ghost_boundaries):
        if fit.fused is not None:
            record["fused_into"] = fold_into_down_proj(ghosted, fit.source - 1, fit.fused)
        record["operator"] = fit.kind
        record["fit"] = fit.figures
    return ghosted


def provenance(ghosted: GhostedForCausalLM, base_name: str | None, dense_parameters: int, selection: Selection,
               calibrator: Calibrator, options: PruneOptions, seconds: float) -> dict[str, Any]:
    """Everything needed to reproduce and judge the result; saved in config.json and rendered by the card
    and `ghosted inspect`."""
    operator_parameters = sum(p.numel() for p in ghosted.ghost_tensors().values())
    data, stats = calibrator.data_description, calibrator.statistics
    hub_id, license = base_model_info(base_name)
    return {
        "method": METHOD,
        "base_model": hub_id or base_name or None,
        "base_model_path": base_name or None,
        "base_model_license": license,
        "selection": selection.describe(),
        "operator": options.operator,
        "fitting": options.fitting,
        "norm_operator": options.norm_operator,
        "lookahead": options.lookahead,
        "solver": {"dtype": "float64", "solve": "torch.linalg.solve", "ridge": options.ridge,
                   "ridge_scale": "mean diagonal of X^T X", "weighting": options.weighting,
                   "skip_first_tokens": options.skip_first_tokens},
        "calibration": {**data, "tokens_used": stats.tokens if stats else None, "processes": calibrator.world,
                        **({"statistics": {k: v for k, v in stats.origin.items() if k != "plan"}}
                           if stats is not None and not data else {})},
        "cost": {"seconds": round(seconds, 2), "passes": calibrator.passes},
        "parameters": {"dense": dense_parameters, "pruned": count_parameters(ghosted) - operator_parameters,
                       "operators": operator_parameters},
        "options": options.to_dict(),
        "versions": {"ghosted_hf": importlib.metadata.version("ghosted_hf"), "transformers": transformers.__version__,
                     "torch": torch.__version__},
    }


def check_request(model: PreTrainedModel, options: PruneOptions) -> None:
    """Refuse a request that cannot succeed before any calibration work."""
    config = getattr(model, "config", None)
    depth = getattr(config, "num_hidden_layers", None)
    if not isinstance(depth, int):
        raise GhostedError(f"Expected a Llama/Qwen causal LM (a transformers model with config.num_hidden_layers), "
                           f"got {type(model).__name__}.")
    meta = next((n for n, p in model.named_parameters() if p.device.type == "meta"), None)
    if meta is not None and not hasattr(model, "hf_device_map"):
        raise GhostedError(f"The model's weights are on the meta device (e.g. {meta}): it was built without loading "
                           "them. Load it with from_pretrained (real weights) before pruning.")
    kind = operator_kind(options.operator)
    if not criterion(options.criterion).takes_layers:
        check_num_layers(options.num_layers, depth - kind.first_removable)
        return
    removed = validate_removal(options.layers, depth)
    if removed[0] < kind.first_removable:
        raise GhostedError(f"Operator kind {kind.name!r} cannot remove layers below {kind.first_removable} "
                           f"(it folds into the kept layer before the boundary); got layers {removed}.")


def prepare_calibration(model: PreTrainedModel, tokenizer: Any, calibration: CalibrationSource | None,
                        statistics: CalibrationStatistics | str | Path | None, options: PruneOptions,
                        ) -> tuple[list[dict[str, torch.Tensor]] | None, CalibrationStatistics | None]:
    """(token batches of the calibration text or None, precomputed statistics or None)."""
    if isinstance(statistics, (str, Path)):
        statistics = CalibrationStatistics.load(statistics, device=options.stats_device or "cpu")
    if statistics is not None and statistics.origin.get("model"):
        check_same_model(statistics, model_fingerprint(model), "The given statistics")
    if statistics is not None and "shard" in statistics.origin and statistics.origin["shard"] != "0/1":
        raise GhostedError(f"The given statistics are shard {statistics.origin['shard']} only: merge all shards first "
                           "(ghosted stats merge stats-*.safetensors --output stats.safetensors).")
    if calibration is None:
        if statistics is None:
            raise GhostedError("Pass calibration text (list of strings, text file or Dataset) or precomputed statistics.")
        return None, statistics
    if tokenizer is None:
        raise GhostedError("A tokenizer is needed to tokenize the calibration text.")
    data = tokenize_texts(tokenizer, calibration, options.seq_len, options.num_sequences, options.batch_size,
                          text_format=options.calibration_format)
    check_token_ids(data, model)
    sequences = data.describe()["sequences"]
    check_token_budget(data.num_tokens - options.skip_first_tokens * sequences, model.config.hidden_size)
    return data, statistics


def calibrate(model: PreTrainedModel, tokenizer: Any, calibration: CalibrationSource, options: PruneOptions | None = None,
              *, shard: ShardSpec | None = None, **overrides: Any) -> CalibrationStatistics:
    """The statistics `ghost_prune` with these options needs (`statistics_plan`), over shard `shard` of the
    calibration batches, with the model and data they come from recorded for `CalibrationStatistics.merge`
    and for the check that `ghost_prune(statistics=...)` is given the same model."""
    options = PruneOptions.build(options, **overrides)
    check_request(model, options)
    data, _ = prepare_calibration(model, tokenizer, calibration, None, options)
    calibrator = Calibrator(model, data, weighting=options.weighting, skip_first_tokens=options.skip_first_tokens,
                            device=options.stats_device, shard=shard)
    stats = calibrator.collect(statistics_plan(model.config.num_hidden_layers, options), f"statistics shard {calibrator.shard}")
    stats.origin["model"] = model_fingerprint(model)
    return stats


def check_token_ids(data: TokenBatches, model: PreTrainedModel) -> None:
    vocab = model.get_input_embeddings().weight.shape[0]
    top = max(int(b["input_ids"].max()) for b in data.batches)
    if top >= vocab:
        raise GhostedError(f"The tokenizer produced token id {top}, but the model's embedding has {vocab} rows: the "
                           "tokenizer does not belong to this model. Load the tokenizer from the model's own folder.")


def check_token_budget(tokens: int, hidden_size: int) -> None:
    """The C x C least-squares fit is underdetermined with fewer tokens than channels."""
    if tokens < hidden_size:
        raise GhostedError(
            f"The calibration data gave {tokens} usable tokens, but fitting a {hidden_size}x{hidden_size} operator "
            f"needs at least {hidden_size} (the hidden size), and about {10 * hidden_size} for a stable fit. "
            "Add calibration text or raise seq_len / num_sequences."
        )


def plain_export(model: GhostedForCausalLM, tokenizer: Any, calibration: CalibrationSource,
                 options: ExportOptions | None = None, **overrides: Any) -> PreTrainedModel:
    """The best stock checkpoint for an existing ghosted model, without the dense model: boundary by boundary,
    in order, its operator W is replaced by the foldable fit (`folded`: c (Y + M T) Q) that best imitates
    X -> X W on the model's own hidden states, then everything is folded into the weights. Each boundary's
    `fit` records how much of the operator's correction the fold misses (`relative_residual`,
    ||fold - X W||^2 / ||X W - X||^2). Treat `model` as consumed."""
    options = ExportOptions.build(options, **overrides)
    refuse_biases(model.config)
    kind = operator_kind(options.operator)
    data = tokenize_texts(tokenizer, calibration, options.seq_len, options.num_sequences, options.batch_size)
    check_token_ids(data, model)
    depth = model.config.num_hidden_layers
    for record in model.config.ghost_boundaries:
        operator = model.get_parameter(ghost_tensor_key(record))
        s = record["layer"] if record["target"] == LAYER_TARGET else depth  # pruned numbering
        stats = imitation_statistics(model, data, operator, s, kind, options)
        fit = kind.fit(stats, s, s + 1, options.ridge)
        with torch.no_grad():
            operator.copy_(fit.operator.to(operator))
        if fit.fused is not None:  # into the kept layer before the boundary (the last one, for a norm correction)
            first = record["removed"][0] if record["removed"] else model.config.original_num_hidden_layers
            record["fused_into"] = fold_into_down_proj(model, first - 1, fit.fused)
        record.update(operator=kind.name, fit={**fit.figures, "fitted_on": f"imitating the {record['operator']} operator"})
    return export_plain(model)


def imitation_statistics(model: GhostedForCausalLM, data: TokenBatches, operator: torch.Tensor, s: int,
                         kind: OperatorKind, options: ExportOptions) -> CalibrationStatistics:
    """Statistics for fitting a foldable operator to the target X_s W, where X_s enters pruned layer `s` before
    its operator: only X_s and the MLP output before it are collected; X_s W follows from them."""
    plan = StatisticsPlan(grams=frozenset({s}))
    if getattr(kind, "transform", False) and s >= 1:
        plan = plan | StatisticsPlan(mlp_terms=frozenset({(s, s)}))
    saved = operator.detach().clone()
    with torch.no_grad():
        operator.copy_(torch.eye(operator.shape[0], dtype=operator.dtype))  # the stream as it reaches the operator
    try:
        stats = collect_statistics(model, data.batches, plan, device=options.stats_device,
                                   description=f"Calibration pass: boundary before pruned layer {s}")
    finally:
        with torch.no_grad():
            operator.copy_(saved)
    gram = stats.gram(s)
    w = saved.to(gram)
    target = {stat_key("cross", s, s + 1): gram @ w, stat_key("energy", s, s + 1): ((gram @ w) * w).sum().reshape(1)}
    if plan.mlp_terms:
        target[stat_key("mlp_target", s, s + 1)] = stats.tensors[stat_key("mlp_source", s)] @ w
    return dataclasses.replace(stats, tensors={**stats.tensors, **target})
