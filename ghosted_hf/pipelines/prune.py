"""`ghost_prune`: calibration text -> statistics -> layer selection -> operators -> a pruned model.

Orchestration only: statistics live in statistics/, fits and criteria in fitting/, weight edits in model/.
"""

from __future__ import annotations

import importlib.metadata
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import PretrainedConfig, PreTrainedModel

from ..architectures import (architecture, check_removal, decoder_layers, kv_per_token, language_config, refuse_fold,
                             stream_width)
from ..assets import base_model_info
from ..errors import GhostedError
from ..fitting import subblocks, units
from ..fitting.operators import BoundaryFit, operator_kind
from ..fitting.selection import Selection, criterion
from ..fitting.units import boundary_spans, selection_request
from ..model.provenance import Provenance
from ..model.folding import fold_into_mlp_writers, to_stock_model
from ..model.surgery import check_derived_layout, count_parameters, prune_layers, validate_removal
from ..options import ExportOptions, PruneOptions, budget_share
from ..remote.modeling_ghosted import GhostedForCausalLM
from ..statistics import (CalibrationPass, CalibrationStatistics, Calibrator, Patch, ShardSpec, StatisticsPlan,
                          as_calibration_pass, check_same_model)
from ..text.tokens import TextSource, TokenBatches, check_positions, tokenize_texts
from ..utils.memory import check_batch_memory

logger = logging.getLogger(__name__)

METHOD = "Ghosted Layers (arXiv 2605.15491)"
SUBBLOCK_RECOVERY = "linear map of each replaced sub-block's input"


def ghost_prune(
    model: PreTrainedModel | CalibrationPass,
    tokenizer: Any = None,
    calibration: TextSource | None = None,
    options: PruneOptions | None = None,
    *,
    statistics: CalibrationStatistics | str | Path | None = None,
    **overrides: Any,
) -> PreTrainedModel:
    """Remove layers (or, with ``unit="subblock"``, attention and MLP sub-blocks) from `model` and recover them in
    closed form.

    `model` is a loaded causal LM, or a `LayerwisePass` over a folder too large for memory. `calibration` is
    a list of strings, a text file or a `datasets.Dataset`; options are `PruneOptions` fields (e.g.
    ``num_layers=8, criterion="ghost-aware", operator="ghost"``). Precomputed `statistics` (object or
    safetensors file) are used wherever they hold what is needed. Returns a `GhostedForCausalLM`, or for
    operator kinds that fold into the weights (`folded`, `replaceme-ls`, `none`) the stock architecture of
    `model`. It shares the dense model's tensors (treat `model` as consumed); the report is in
    ``config.ghost_provenance``.
    """
    options = PruneOptions.build(options, **overrides)
    started = time.perf_counter()
    calibration_pass = as_calibration_pass(model)
    check_request(calibration_pass.config, options)
    options = resolve_budget(calibration_pass, options)
    if units.unit(options.unit).subblocks:
        return prune_subblocks(calibration_pass, tokenizer, calibration, statistics, options, started)
    data, statistics = prepare_calibration(calibration_pass, tokenizer, calibration, statistics, options)
    calibrator = Calibrator(calibration_pass, data, statistics, device=options.stats_device,
                            partial=options.partial_sums)
    calibrator.check_agreement(options)
    chosen, request = criterion(options.criterion), selection_request(calibration_pass.config, options)
    selection = chosen.select(calibrator.ensure(chosen.statistics(request), f"selection by {chosen.name!r}"), request)
    fits = fit_operators(calibrator, selection.removed, options)
    dense = calibration_pass.model_for_build(selection.removed)
    dense_parameters = count_parameters(dense)
    ghosted = build(dense, selection.removed, fits, options)
    provenance(ghosted, calibration_pass.config._name_or_path, dense_parameters, selection, calibrator, options,
               time.perf_counter() - started).save_to(ghosted.config)
    logger.info("Removed layers %s (%s, %s).", selection.removed, options.criterion, options.operator)
    return to_stock_model(ghosted) if operator_kind(options.operator).stock else ghosted


def prune_subblocks(calibration_pass: CalibrationPass, tokenizer: Any, calibration: TextSource | None,
                    statistics: CalibrationStatistics | str | Path | None, options: PruneOptions,
                    started: float) -> GhostedForCausalLM:
    """`ghost_prune` of a unit with sub-blocks ('subblock', 'mixed'): calibration text (and precomputed statistics of
    the dense model, where given) -> each candidate's map and measured damage -> the sub-blocks (and whole layers) that
    meet the budget with the least damage -> their maps (a run of whole layers: one boundary's ghost operator) fitted
    down the network -> the model. Every pass is a `Calibrator` pass."""
    unit = units.unit(options.unit)
    text = language_config(calibration_pass.config)
    depth = text.num_hidden_layers
    if calibration is None or tokenizer is None:
        raise GhostedError(f"unit={unit.name!r} measures each replacement's damage and fits each map on the model "
                           "patched so far, on calibration text: pass a tokenizer and calibration text (with or "
                           "without precomputed statistics).")
    data, statistics = prepare_calibration(calibration_pass, tokenizer, calibration, statistics, options)
    calibrator = Calibrator(calibration_pass, data, statistics, device=options.stats_device,
                            partial=options.partial_sums)
    calibrator.check_agreement(options)
    counted = calibration_pass.model_for_build(range(depth))  # layer by layer: no decoder layer read, freed below
    dense_parameters = count_parameters(counted)
    sizes = {ref: subblocks.subblock_parameters(counted, ref) for ref in subblocks.all_subblocks(depth, whole_layers=True)}
    budget = parameter_budget(counted, options) if options.criterion != "manual" and options.remove_kv is None else 0
    del counted
    rank = subblocks.parse_map_rank(options.map_rank)
    if options.criterion == "manual":
        chosen = subblocks.validate_subblocks(options.subblocks or [], depth, options.layers or [])
        selection = Selection([], "manual", {}, "n/a")
    else:
        candidates, frees = unit.candidates(depth), None
        if options.remove_kv is not None:  # the candidates that free cache: attention sub-blocks, whole layers
            frees, budget = cache_savings(calibration_pass.config, candidates, options)
            candidates = sorted(frees)
        fits = subblocks.candidate_fits(calibrator, candidates, options.ridge, rank)
        scored = calibrator.first_batches(max(1, -(-options.damage_sequences // options.batch_size)))
        saved = frees if frees is not None else {ref: sizes[ref] - fit.parameters for ref, fit in fits.items()}
        chosen, damage = subblocks.choose_jointly(scored, fits, saved, budget, options.joint_rounds,
                                                  "parameters" if frees is None else "KV-cache values")
        rank = {ref: fits[ref].rank or "full" for ref in chosen}  # the ranks the choice priced
        selection = Selection([], "ghost-aware", {ref.name: round(value, 6) for ref, value in damage.items()}, "lower")
    first = len(calibrator.passes)
    fitted = subblocks.fit_sequentially(calibrator, chosen, options.ridge, rank)
    calibrator.merge_passes(first, "sequential fits")
    whole, maps = ([f for f in fitted if (f.ref.block == subblocks.LAYER) == layer] for layer in (True, False))
    selection.removed, selection.subblocks = [i for f in whole for i in range(f.ref.layer, f.end)], [f.ref.name for f in maps]
    model = calibration_pass.model_for_build(selection.removed)
    ghosted = prune_layers(model, selection.removed, {f.ref.layer: f.map for f in whole}, operator_kind="ghost",
                           subblocks={(f.ref.layer, f.ref.block): (f.map, f.outputs) for f in maps},
                           operator_dtype=getattr(torch, options.operator_dtype))
    for fit, record in zip(maps, ghosted.config.ghost_subblocks):
        record["fit"] = fit.figures
    for fit, record in zip(whole, ghosted.config.ghost_boundaries):
        record.update(operator="ghost", fit=fit.figures)
    provenance(ghosted, calibration_pass.config._name_or_path, dense_parameters, selection, calibrator, options,
               time.perf_counter() - started).with_changes(
        operator=SUBBLOCK_RECOVERY, fitting="sequential" if len(fitted) > 1 else "single").save_to(ghosted.config)
    logger.info("Replaced sub-blocks %s (%s).", selection.subblocks, options.criterion)
    return ghosted


def decoder_parameters(model: PreTrainedModel) -> int:
    """Parameters of the decoder layers (what a share to remove is a share of)."""
    return sum(count_parameters(layer) for layer in decoder_layers(model))


def parameter_budget(model: PreTrainedModel, options: PruneOptions) -> int:
    """How many decoder parameters to remove, net of what is added."""
    if options.num_parameters is not None:
        return options.num_parameters
    return round(budget_share(options.remove) * decoder_parameters(model))


def kv_budget(config: PretrainedConfig, options: PruneOptions) -> tuple[list[int], int]:
    """(the KV-cache values each layer adds per token, how many of them to remove) for `remove_kv`."""
    per_layer = kv_per_token(config)
    return per_layer, round(budget_share(options.remove_kv, "remove_kv") * sum(per_layer))


def cache_savings(config: PretrainedConfig, candidates: list[subblocks.SubBlockRef],
                  options: PruneOptions) -> tuple[dict[subblocks.SubBlockRef, int], int]:
    """(the KV-cache values per token each candidate that frees any frees: an attention sub-block or a whole layer of
    a layer that holds a cache; how many to remove) for `remove_kv`."""
    per_layer, budget = kv_budget(config, options)
    frees = {ref: per_layer[ref.layer] for ref in candidates if ref.block != "mlp" and per_layer[ref.layer]}
    if not frees:
        raise GhostedError("No layer of this model holds a KV cache that grows with the tokens: remove_kv has nothing "
                           "to remove; give a parameter budget (remove, num_parameters).")
    return frees, budget


def resolve_budget(calibration_pass: CalibrationPass, options: PruneOptions) -> PruneOptions:
    """Whole layers at a budget: the fewest layers whose parameters, net of one boundary's operator, reach it (every
    layer of a family has the same count but MoE's dense first layers: their mean is used), or whose KV cache does
    (the mean over the layers: a hybrid's recurrent layers hold none)."""
    if units.unit(options.unit).subblocks or not options.budgeted:
        return options
    text = language_config(calibration_pass.config)
    depth, width = text.num_hidden_layers, stream_width(calibration_pass.config)
    kind = operator_kind(options.operator)
    if options.remove_kv is not None:
        per_layer, budget = kv_budget(calibration_pass.config, options)
        num_layers, what = max(1, math.ceil(budget / (sum(per_layer) / depth))), "KV-cache values per token"
    else:
        model = calibration_pass.model_for_build(range(depth))  # (layer by layer: no decoder layer read, only counted)
        budget, what = parameter_budget(model, options), "parameters"
        added = 0 if kind.stock else kind.regressors * width * width
        num_layers = max(1, math.ceil((budget + added) / (decoder_parameters(model) / depth)))
    if num_layers >= depth - kind.first_removable:  # what check_request refuses for num_layers, said for a budget
        raise GhostedError(f"Removing {budget:,} {what} takes {num_layers} whole layers of the "
                           f"{depth - kind.first_removable} that operator {kind.name!r} can remove: ask for less.")
    logger.info("A budget of %d %s: %d whole layers.", budget, what, num_layers)
    return PruneOptions.build(options, num_layers=num_layers)


def statistics_plan(config: PretrainedConfig, options: PruneOptions) -> StatisticsPlan:
    """Everything `ghost_prune` with these options can need from the dense model, known before anything is chosen
    (the unit's statistics)."""
    return units.unit(options.unit).statistics(config, options)


def fit_operators(calibrator: Calibrator, removed: list[int], options: PruneOptions) -> list[BoundaryFit]:
    """One fit per boundary; sequential fitting refits each source on the model pruned and patched so far."""
    kind = operator_kind(options.operator)
    spans = boundary_spans(calibrator.depth, removed)
    sequential = options.fitting == "sequential" and kind.sequential and len(spans) > 1
    plans = [kind.statistics(s, e) for s, e in spans]
    # Sequentially fitted boundaries read their sources from the patched stream, so the dense pass skips them.
    dense_plan = StatisticsPlan.union(plan.split_at(s)[1] if sequential and k else plan
                                      for k, (plan, (s, _)) in enumerate(zip(plans, spans)))
    stats = calibrator.ensure(dense_plan, f"fitting the {kind.name} operators")
    fits: list[BoundaryFit] = []
    for k, (plan, (s, e)) in enumerate(zip(plans, spans)):
        patched = sequential and k > 0
        if patched:
            patch = Patch(tuple(i for i in removed if i < s),
                          operators={f.source: f.operator.float() for f in fits if f.operator is not None},
                          transforms={f.source - 1: f.fused.float() for f in fits if f.fused is not None},
                          normed={f.source: f.normed.float() for f in fits if f.normed is not None})
            local = calibrator.collect(plan.split_at(s)[0], f"sequential fit {k + 1}/{len(spans)}", patch=patch)
        fits.append(kind.fit(stats.with_tensors(local) if patched else stats, s, e, options.ridge))
        fits[-1].figures["fitted_on"] = "pruned and patched model" if patched else "dense model"
    return fits


def build(model: PreTrainedModel, removed: list[int], fits: list[BoundaryFit], options: PruneOptions) -> GhostedForCausalLM:
    """The pruned model with each boundary's operator installed (and transforms folded into the MLP's output weights)."""
    operators = {f.source: f.operator for f in fits if f.operator is not None}
    ghosted = prune_layers(model, removed, operators, operator_kind=options.operator,
                           operator_dtype=getattr(torch, options.operator_dtype),
                           normed={f.source: f.normed for f in fits if f.normed is not None})
    for fit, record in zip(fits, ghosted.config.ghost_boundaries):
        if fit.fused is not None:
            record["fused_into"] = fold_into_mlp_writers(ghosted, fit.source - 1, fit.fused)
        record.update(operator=fit.kind, fit=fit.figures)
    return ghosted


def fitting_done(boundaries: list[dict[str, Any]]) -> str:
    """What the fits were, not what was asked: 'sequential' where a boundary was fitted on the model pruned and
    patched before it (a kind that cannot be, such as replaceme-ls, is fitted on the dense model), 'single' for one
    fit, 'none' without a fit."""
    fitted_on = [b["fit"]["fitted_on"] for b in boundaries
                 if b.get("operator") != "none" and (b.get("fit") or {}).get("fitted_on")]
    if len(fitted_on) < 2:
        return "single" if fitted_on else "none"
    return "sequential" if any(on != "dense model" for on in fitted_on) else "independent"


def provenance(ghosted: GhostedForCausalLM, base_name: str | None, dense_parameters: int, selection: Selection,
               calibrator: Calibrator, options: PruneOptions, seconds: float) -> Provenance:
    """Everything needed to reproduce and judge the result; saved in config.json and rendered by the card
    and `ghosted inspect`."""
    operator_parameters = sum(p.numel() for p in ghosted.ghost_operators().values())
    data, stats = calibrator.data_description, calibrator.statistics
    base = base_model_info(base_name)
    return Provenance(
        method=METHOD,
        base_model=base.hub_id or base_name or None,
        base_model_path=base_name or None,
        base_model_license=base.license,
        base_model_notice=base.notice,
        selection=selection.describe(),
        operator=options.operator,
        fitting=fitting_done(ghosted.config.ghost_boundaries),
        solver={"dtype": "float64", "solve": "torch.linalg.solve", "ridge": options.ridge,
                "ridge_scale": "mean diagonal of X^T X"},
        calibration={**data, "tokens_used": stats.tokens if stats else data.get("tokens"), "processes": calibrator.world,
                     **({"statistics": {k: v for k, v in stats.origin.items() if k != "plan"}}
                        if stats is not None and not data else {})},
        cost={"seconds": round(seconds, 2), "passes": calibrator.passes},
        parameters={"dense": dense_parameters, "pruned": count_parameters(ghosted) - operator_parameters,
                    "operators": operator_parameters},
        options=options.to_dict(),
        versions={"ghosted_hf": importlib.metadata.version("ghosted_hf"), "transformers": transformers.__version__,
                  "torch": torch.__version__},
    )


def check_request(config: PretrainedConfig, options: PruneOptions) -> None:
    """Refuse a request that cannot succeed before any calibration work."""
    depth = getattr(language_config(config), "num_hidden_layers", None)
    if not isinstance(depth, int):
        raise GhostedError(f"Expected a decoder-only causal LM (a transformers model with config.num_hidden_layers), "
                           f"got a {type(config).__name__}.")
    kind = operator_kind(options.operator)
    family, unit = architecture(config), units.unit(options.unit)
    if unit.whole_layers:  # before any calibration work
        check_derived_layout(config)
    if unit.subblocks:
        check_derived_layout(config, subblocks=True)
        if options.subblocks or options.layers:
            subblocks.validate_subblocks(options.subblocks or [], depth, options.layers or [])
        return
    if kind.stock and kind.name != "none":
        refuse_fold(family, kind.name)
    if not criterion(options.criterion).takes_layers:
        room = depth - kind.first_removable  # (not checked with a budget, which sets num_layers once counted)
        if not options.budgeted and not 1 <= options.num_layers < room:
            raise GhostedError(f"num_layers must be between 1 and {room - 1} for a model with {room} layers, got "
                               f"{options.num_layers}.")
        return
    removed = validate_removal(options.layers, depth)
    check_removal(config, removed)
    if removed[0] < kind.first_removable:
        raise GhostedError(f"Operator kind {kind.name!r} cannot remove layers below {kind.first_removable} "
                           f"(it folds into the kept layer before the boundary); got layers {removed}.")


def prepare_calibration(calibration_pass: CalibrationPass, tokenizer: Any, calibration: TextSource | None,
                        statistics: CalibrationStatistics | str | Path | None, options: PruneOptions,
                        ) -> tuple[TokenBatches | None, CalibrationStatistics | None]:
    """(token batches of the calibration text or None, precomputed statistics or None)."""
    if isinstance(statistics, (str, Path)):
        statistics = CalibrationStatistics.load(statistics, device=options.stats_device or "cpu")
    if statistics is not None:
        config = language_config(calibration_pass.config)
        widths = {config.hidden_size, stream_width(config)}  # (a sub-block's sums, a stream's)
        if statistics.depth != config.num_hidden_layers or statistics.hidden_size not in widths:
            raise GhostedError(f"The given statistics were collected on a model of {statistics.depth} layers of "
                               f"width {statistics.hidden_size}, not this one ({config.num_hidden_layers} x "
                               f"{' or '.join(map(str, sorted(widths)))}): collect statistics on this model.")
        check_same_model(statistics, calibration_pass.fingerprint(), "The given statistics")
    if statistics is not None and "shard" in statistics.origin and statistics.origin["shard"] != "0/1":
        raise GhostedError(f"The given statistics are shard {statistics.origin['shard']} only: merge all shards first "
                           "(ghosted stats merge stats-*.safetensors --output stats.safetensors).")
    if statistics is not None and statistics.origin.get("set_tokens", statistics.tokens) != statistics.tokens:
        raise GhostedError(f"The given statistics hold {statistics.tokens} tokens of the {statistics.origin['set_tokens']} "
                           "of the calibration set they were collected from: a part of it (a shard, whatever its "
                           "label says); merge all shards first (ghosted stats merge).")
    needed = statistics_plan(calibration_pass.config, options)
    if calibration is None:
        if statistics is None and needed:
            raise GhostedError("Pass calibration text (list of strings, text file or Dataset) or precomputed statistics.")
        return None, statistics
    if not needed:  # e.g. manual layers, no recovery: nothing to measure, so the text is neither read nor tokenized
        logger.info("criterion %r with operator %r needs no calibration statistics: the calibration text is unused.",
                    options.criterion, options.operator)
        return None, statistics
    if tokenizer is None:
        raise GhostedError("A tokenizer is needed to tokenize the calibration text.")
    data = calibration_tokens(tokenizer, calibration, options, calibration_pass.config, calibration_pass.vocab_size,
                              operator_kind(options.operator).regressors)
    if statistics is not None and statistics.origin.get("data") not in (None, data.token_sha256()):
        raise GhostedError("The given statistics were collected on other calibration tokens than the calibration text "
                           "given here, and the two would be mixed in one fit: pass the text they were collected from "
                           "with the same seq_len, num_sequences and batch_size, or collect statistics on this text.")
    return data, statistics


def calibrate(model: PreTrainedModel | CalibrationPass, tokenizer: Any, calibration: TextSource,
              options: PruneOptions | None = None, *, shard: ShardSpec | None = None,
              **overrides: Any) -> CalibrationStatistics:
    """The statistics `ghost_prune` with these options needs (`statistics_plan`), over shard `shard` of the
    calibration batches, with the model and data they come from recorded for `CalibrationStatistics.merge`
    and for the check that `ghost_prune(statistics=...)` is given the same model."""
    options = PruneOptions.build(options, **overrides)
    calibration_pass = as_calibration_pass(model)
    options = resolve_budget(calibration_pass, options)
    check_request(calibration_pass.config, options)
    data, _ = prepare_calibration(calibration_pass, tokenizer, calibration, None, options)
    calibrator = Calibrator(calibration_pass, data, device=options.stats_device, shard=shard,
                            partial=options.partial_sums)
    calibrator.check_agreement(options)
    stats = calibrator.collect(statistics_plan(calibration_pass.config, options), f"statistics shard {calibrator.shard}")
    stats.origin["model"] = calibration_pass.fingerprint()
    return stats


def calibration_tokens(tokenizer: Any, calibration: TextSource, options: PruneOptions | ExportOptions,
                       config: PretrainedConfig, vocab_size: int, regressors: int = 1) -> TokenBatches:
    """The calibration windows `options` ask for (read by the one text reader), checked against the model's vocabulary
    (`vocab_size` rows of its embedding), the memory a batch needs and the text a fit of `regressors` x C inputs
    needs."""
    config = language_config(config)
    data = tokenize_texts(tokenizer, calibration, options.seq_len, options.num_sequences, options.batch_size,
                          options.text_column, split=options.split, streaming=options.streaming)
    top = max(int(b["input_ids"].max()) for b in data.batches)
    if top >= vocab_size:  # a tokenizer of another model
        raise GhostedError(f"The tokenizer produced token id {top}, but the model's embedding has {vocab_size} rows: "
                           "the tokenizer does not belong to this model. Load the tokenizer from the model's own folder.")
    check_token_budget(data.num_tokens, stream_width(config), regressors)
    check_positions(config, options.seq_len)  # before any forward, as the batch's memory
    check_batch_memory(*data.batches[0]["input_ids"].shape, config, "batch_size")
    return data


def check_token_budget(tokens: int, hidden_size: int, regressors: int = 1) -> None:
    """The one rule for how much text a fit needs, for a fit of `regressors` x C inputs per output channel (the
    joint `ghost-normed` fit reads X_s and n(X_s): 2): fewer tokens than that leave the least-squares fit
    underdetermined and are refused; fewer than 10 x that fit, with a warning that the fit may not be stable."""
    columns = regressors * hidden_size
    what = f"a {hidden_size}x{hidden_size} operator" if regressors == 1 else f"{regressors} {hidden_size}x{hidden_size} terms jointly"
    if columns <= tokens < 10 * columns:  # (fewer than that is refused below, without a warning first)
        logger.warning("The calibration data gave %d tokens for %s: fewer than 10x the %d inputs of the fit (%d), so "
                       "the fit may not carry over to other text. Add calibration text or raise seq_len / "
                       "num_sequences.", tokens, what, columns, 10 * columns)
    if tokens < columns:
        raise GhostedError(
            f"The calibration data gave {tokens} usable tokens, but fitting {what} needs at least {columns} (the "
            f"inputs of the fit), and about {10 * columns} for a stable fit. Add calibration text or raise seq_len / "
            "num_sequences."
        )
