"""`export_stock`: an existing ghosted model -> the best stock checkpoint, without the dense model.

Boundary by boundary, each operator W is replaced by the foldable fit that best imitates X -> X W on the model's own
hidden states, then everything is folded into the weights (`to_stock_model`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from ..errors import GhostedError
from ..fitting.operators import operator_kind
from ..model.checkpoint import made_as
from ..model.provenance import Provenance
from ..model.folding import fold_into_mlp_writers, to_stock_model
from ..options import ExportOptions
from ..remote.format_ghosted import GHOST_MODULE, LAYER_TARGET, decoder_paths, ghost_tensor_key
from ..remote.modeling_ghosted import GhostedForCausalLM
from ..statistics import (CROSS, ENERGY, GRAM, MLP_GRAM, MLP_SOURCE, MLP_TARGET, CalibrationStatistics, StatisticsPlan,
                          collect_statistics)
from ..statistics.patch import replaced
from ..text.tokens import TextSource, TokenBatches
from .prune import calibration_tokens


def export_stock(model: GhostedForCausalLM, tokenizer: Any, calibration: TextSource,
                 options: ExportOptions | None = None, **overrides: Any) -> PreTrainedModel:
    """The best stock checkpoint for a ghosted model: each operator W refitted as the foldable kind
    (`folded`: c (Y + M T) Q) that best imitates X -> X W, then folded into the weights. Each boundary's `fit`
    records how much of the operator's correction the fold misses (`relative_residual`,
    ||fold - X W||^2 / ||X W - X||^2). Treat `model` as consumed."""
    options = ExportOptions.build(options, **overrides)
    if made_as(getattr(model, "config", None)) != "ghosted":
        raise GhostedError(f"export_stock refits a ghosted model's operators; got a {type(model).__name__}, which has "
                           "none. Prune it first (ghost_prune), or prune with operator='folded' for a stock checkpoint.")
    kind = operator_kind(options.operator)
    normed = [b["removed"] for b in model.config.ghost_boundaries if b.get("normed")]
    if normed:
        raise GhostedError(f"The boundaries after removed layers {normed} have a normed term, which export_stock "
                           "cannot imitate: prune the dense model with operator='folded' for a stock checkpoint.")
    data = calibration_tokens(tokenizer, calibration, options, model.config,
                              model.get_input_embeddings().weight.shape[0])  # the rules `ghost_prune` applies
    for record in model.config.ghost_boundaries:
        name = ghost_tensor_key(record, paths=decoder_paths(model.config))
        operator, parent = model.get_parameter(name), model.get_submodule(name.rsplit(".", 2)[0])
        s = record["layer"] if record["target"] == LAYER_TARGET else model.config.num_hidden_layers  # pruned numbering
        fit = kind.fit(imitation_statistics(model, data, parent, s, options), s, s + 1, options.ridge)
        with torch.no_grad():
            operator.copy_(fit.operator.to(operator))
        if fit.fused is not None:  # into the kept layer before the boundary
            record["fused_into"] = fold_into_mlp_writers(model, record["removed"][0] - 1, fit.fused)
        record.update(operator=kind.name, fit={**fit.figures, "fitted_on": f"imitating the {record['operator']} operator"})
    prov = Provenance.of(model.config)
    # What the export itself did, where the card and `inspect` read the recovery and its calibration from; the
    # ghosted model's own calibration and options stay under "refitted_from".
    prov.with_changes(
        operator=kind.name, fitting=f"imitation of the {prov.operator or 'ghost'} operators",
        calibration={**data.describe(), "tokens_used": data.num_tokens, "processes": 1},
        refitted_from={key: getattr(prov, key) for key in ("operator", "fitting", "calibration", "options")},
        options=options.to_dict()).save_to(model.config)
    return to_stock_model(model)


def imitation_statistics(model: GhostedForCausalLM, data: TokenBatches, parent: nn.Module, s: int,
                         options: ExportOptions) -> CalibrationStatistics:
    """The statistics of fitting X_s -> X_s W, where X_s enters pruned layer `s` (its operator served by `parent`'s
    ghost child) before its operator: X_s and the MLP output M before it are collected with that child passing the
    stream on, and the target's statistics follow exactly (X^T X W, ...)."""
    plan = StatisticsPlan.of(GRAM(s), *((MLP_GRAM(s), MLP_SOURCE(s)) if s >= 1 else ()))
    ghost = getattr(parent, GHOST_MODULE)
    with replaced([(parent, GHOST_MODULE, nn.Identity())]):  # the stream as it reaches the operator
        stats = collect_statistics(model, data.batches, plan, device=options.stats_device,
                                   description=f"Calibration pass: boundary before pruned layer {s}",
                                   partial=options.partial_sums)
    gram = stats[GRAM(s)]
    w = ghost.operator.detach().to(gram)
    target = {CROSS(s, s + 1): gram @ w, ENERGY(s, s + 1): ((gram @ w) * w).sum().reshape(1)}
    if s >= 1:
        target[MLP_TARGET(s, s + 1)] = stats[MLP_SOURCE(s)] @ w
    return stats.extended(target)
