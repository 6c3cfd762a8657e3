"""Human-readable summary of what a ghosted model contains and how it was made (from its config)."""

from __future__ import annotations

from typing import Any

from .remote.configuration_ghosted import GhostedConfig

SHOWN_FIGURES = ("relative_residual", "residual_vs_target", "pruned_residual_vs_target", "condition_number",
                 "antisymmetric_share", "fitted_on")


def _figure(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def summarize(config: GhostedConfig, tensors: dict[str, tuple[int, ...]] | None = None, top_scores: int = 8) -> str:
    text = config.text_config
    prov = config.ghost_provenance or {}
    lines = [
        f"base model      : {prov.get('base_model') or 'unknown'} ({text.model_type})",
        f"layers          : {config.original_num_hidden_layers} -> {text.num_hidden_layers} "
        f"(removed {config.removed_layers})",
        f"operator dtype  : {config.operator_dtype}",
    ]
    params = prov.get("parameters")
    if params:
        saved = 1 - (params["pruned"] + params["operators"]) / params["dense"]
        lines.append(f"parameters      : {params['dense']:,} -> {params['pruned']:,} + {params['operators']:,} "
                     f"in operators ({saved:.1%} fewer)")
    selection = prov.get("selection")
    if selection:
        lines.append(f"selection       : {selection['criterion']} ({selection['better']} is better)")
        scores = selection.get("scores") or {}
        ranked = sorted(scores.items(), key=lambda kv: kv[1], reverse=selection["better"] == "higher")
        for name, score in ranked[:top_scores]:
            lines.append(f"    {name:>8} : {score:.6g}")
        if len(ranked) > top_scores:
            lines.append(f"    ... {len(ranked) - top_scores} more candidates")
    if prov.get("calibration"):
        cal = prov["calibration"]
        lines.append(f"calibration     : {cal.get('name')} - {cal.get('tokens_used')} tokens, sha256 {str(cal.get('sha256'))[:16]}...")
    if prov.get("solver"):
        lines.append(f"solver          : {prov.get('operator')} / {prov.get('fitting')} - " + ", ".join(
            f"{k}={v}" for k, v in prov["solver"].items()))
    lines.append("boundaries      :")
    for b in config.ghost_boundaries:
        where = f"pruned layer {b['layer']} (dense {b['original_layer']})" if b["target"] == "layer" else "final norm"
        lines.append(f"  removed {b['removed']} -> {where}: {b['operator']}"
                     + (f", fused into {b['fused_into']}" if b.get("fused_into") else ""))
        fit = b.get("fit") or {}
        shown = [f"{k}={_figure(fit[k])}" for k in SHOWN_FIGURES if k in fit]
        if shown:
            lines.append("      " + ", ".join(shown))
    if tensors is not None:
        lines.append("operator tensors:")
        lines.extend(f"  {name} {list(shape)}" for name, shape in sorted(tensors.items()))
    return "\n".join(lines)
