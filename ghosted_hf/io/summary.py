"""One view of what a ghosted model contains and how it was made, read from its config: `ghosted
inspect` prints it and the model card renders it, so the two always say the same."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig

from ..errors import GhostedError
from ..fitting.selection import candidate_layers
from ..model.checkpoint import made_as
from ..model.provenance import BOUNDARY, SUBBLOCK, Provenance
from ..remote.configuration_ghosted import GhostedConfig
from ..remote.format_ghosted import LAYER_TARGET
from ..utils.diskio import check_shape

SHOWN_FIGURES = ("relative_residual", "residual_vs_target", "pruned_residual_vs_target", "condition_number",
                 "antisymmetric_share", "fitted_on")


def _figures(record: dict[str, Any]) -> str:
    fit = record.get("fit") or {}
    return ", ".join(f"{k}={fit[k]:.4g}" if isinstance(fit[k], float) else f"{k}={fit[k]}"
                     for k in SHOWN_FIGURES if k in fit) or "-"


@dataclass
class BoundarySummary:
    """One boundary as `inspect` and the card show it."""

    removed: list[int]
    feeds: str
    operator: str
    figures: str


@dataclass
class SubBlockSummary:
    """One replaced sub-block as `inspect` and the card show it."""

    name: str  # "12.attention", dense numbering
    layer: str
    figures: str
    map: str = "full"  # "full" (C x C) or "rank r" (format 1.4)


@dataclass
class ModelSummary:
    """Everything `inspect` and the card show about a saved model."""

    base_model: str
    model_type: str
    hidden_size: int
    depth: int
    kept: int
    removed: list[int]
    operator_dtype: str
    parameters: str
    criterion: str | None
    better: str | None
    scores: list[tuple[str, str, bool]]  # (candidate, score, chosen), best first
    recovery: str
    calibration: str
    solver: str
    versions: str
    boundaries: list[BoundarySummary]
    evaluations: list[dict[str, Any]] = field(default_factory=list)
    healing: str | None = None
    stock: bool = False  # a stock checkpoint: operators folded into the weights, no remote code
    untied_embeddings: bool = False
    normed: bool = False  # some boundary adds n(x) @ A (format 1.1)
    subblocks: list[SubBlockSummary] = field(default_factory=list)  # replaced sub-blocks (format 1.2)
    multimodal: str | None = None  # the image-text-to-text model whose language decoder was pruned (its model type)


def summarize(config: GhostedConfig | PretrainedConfig) -> ModelSummary:
    """The summary of a ghosted model's config, or of a stock export's (whose provenance keeps the layout)."""
    prov = Provenance.of(config)
    selection = prov.selection or {}
    scores = selection.get("scores") or {}
    for name, score in scores.items():
        check_shape(score, (int, float), f"config.json: ghost_provenance.selection.scores.{name}")
    stock, kind = prov.stock_export, made_as(config)
    if kind == "ghosted":
        text, depth, removed_layers = config.text_config, config.original_num_hidden_layers, config.removed_layers
        boundaries, storage = config.ghost_boundaries, config.operator_dtype
        check_shape(boundaries, [BOUNDARY], "config.json: ghost_boundaries")
        replaced = check_shape(getattr(config, "ghost_subblocks", []), [SUBBLOCK], "config.json: ghost_subblocks")
    elif stock:
        text, depth, removed_layers = config.get_text_config(), stock["original_num_hidden_layers"], stock["removed_layers"]
        boundaries, storage, replaced = stock["boundaries"], "folded into the weights", []
    else:
        raise GhostedError(f"This {getattr(config, 'model_type', None)!r} config was not made by ghosted_hf.")
    params = prov.parameters
    removed = set(removed_layers)
    chosen = set(selection.get("subblocks") or ())
    if chosen or any("." in name for name in scores):  # sub-block candidates are LAYER.KIND, a whole layer LAYER.layer
        chosen |= {f"{i}.layer" for i in removed}
    ranked = sorted(scores.items(), key=lambda kv: kv[1], reverse=selection.get("better") == "higher")
    cal, healing = prov.calibration or {}, prov.healing
    return ModelSummary(
        base_model=prov.base_model or "unknown",
        model_type=text.model_type,
        hidden_size=text.hidden_size,
        depth=depth,
        kept=text.num_hidden_layers,
        removed=list(removed_layers),
        operator_dtype=storage,
        parameters=(f"{params['dense']:,} -> {params['pruned']:,} (+ {params['operators']:,} in operators; "
                    f"{1 - (params['pruned'] + params['operators']) / params['dense']:.1%} fewer)" if params else "unknown"),
        criterion=selection.get("criterion"),
        better=selection.get("better"),
        scores=[(name, f"{score:.6g}", name in chosen if chosen else set(candidate_layers(name)) <= removed)
                for name, score in ranked],
        recovery=f"{prov.operator or 'unknown'}, {_fitting(prov.fitting or 'unknown')}",
        calibration=(f"{cal.get('name')}: {cal.get('tokens_used')} tokens in {cal.get('sequences')} sequences of "
                     f"{cal.get('sequence_length')}, sha256 {cal.get('sha256')}" if cal else "unknown"),
        solver=", ".join(f"{k}={v}" for k, v in (prov.solver or {}).items()) or "unknown",
        versions=", ".join(f"{k} {v}" for k, v in (prov.versions or {}).items()) or "unknown",
        boundaries=[_boundary(b) for b in boundaries],
        evaluations=list(prov.evaluation),
        healing=", ".join(f"{k}={v}" for k, v in healing.items()) if healing else None,
        stock=kind == "stock",
        untied_embeddings=bool(stock and stock.get("untied_embeddings")),
        normed=any(b.get("normed") for b in boundaries),
        subblocks=[_subblock(r) for r in replaced],
        multimodal=(config.base_config.model_type if kind == "ghosted" and config.base_config is not None else
                    config.model_type if kind == "stock" and text is not config else None),
    )


def _subblock(record: dict[str, Any]) -> SubBlockSummary:
    return SubBlockSummary(name=f"{record['original_layer']}.{record['block']}",
                           layer=f"pruned layer {record['layer']} (dense {record['original_layer']}).{record['module']}",
                           figures=_figures(record), map=f"rank {record['rank']}" if record.get("rank") else "full")


def _fitting(fitting: str) -> str:
    named = {"none": "no fit", "single": "one fit, on the dense model"}
    return named.get(fitting) or (f"{fitting} fitting" if fitting in ("sequential", "independent", "unknown")
                                  else fitting)


def _boundary(record: dict[str, Any]) -> BoundarySummary:
    feeds = (f"pruned layer {record['layer']} (dense {record['original_layer']})" if record["target"] == LAYER_TARGET
             else "final norm")
    return BoundarySummary(
        removed=record["removed"],
        feeds=feeds,
        operator=record["operator"] + (f", fused into {record['fused_into']}" if record.get("fused_into") else ""),
        figures=_figures(record),
    )


def render_text(summary: ModelSummary, tensors: dict[str, tuple[int, ...]] | None = None, top_scores: int = 8) -> str:
    """Plain-text rendering for the terminal."""
    s = summary
    lines = [
        f"base model      : {s.base_model} ({s.model_type})",
        f"layers          : {s.depth} -> {s.kept} (removed {s.removed})",
        f"operators       : {s.operator_dtype}" + (" (a stock checkpoint; embeddings untied)" if s.untied_embeddings
                                                  else " (a stock checkpoint)" if s.stock else ""),
        f"parameters      : {s.parameters}",
        f"recovery        : {s.recovery}",
        f"calibration     : {s.calibration}",
        f"solver          : {s.solver}",
    ]
    if s.criterion:
        lines.append(f"selection       : {s.criterion} ({s.better} is better)")
        for name, score, chosen in s.scores[:top_scores]:
            lines.append(f"    {name:>8} : {score}" + ("  (removed)" if chosen else ""))
        if len(s.scores) > top_scores:
            lines.append(f"    ... {len(s.scores) - top_scores} more candidates")
    if s.healing:
        lines.append(f"healing         : {s.healing}")
    lines.append("boundaries      :" + ("" if s.boundaries else " none"))
    for b in s.boundaries:
        lines += [f"  removed {b.removed} -> {b.feeds}: {b.operator}", f"      {b.figures}"]
    if s.subblocks:
        lines.append("sub-blocks      : replaced by a linear map of their input (format 1.2)")
        for r in s.subblocks:
            lines.append(f"  {r.name} -> {r.layer}, {r.map} map: {r.figures}")
    if tensors is not None:
        lines.append("operator tensors:")
        lines.extend(f"  {name} {list(shape)}" for name, shape in sorted(tensors.items()))
    lines.append(f"made with       : {s.versions}")
    return "\n".join(lines)


def inspect_folder(folder: str | Path, top_scores: int = 8) -> str:
    """What a saved ghosted folder (or a stock checkpoint ghosted_hf made) contains and how it was made, as
    `ghosted inspect` prints it; every weight file is verified first."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from ..assets import HUB_ID
    from .files import verify_folder

    if top_scores < 0:
        raise GhostedError(f"--top must be 0 or more (selection scores to show), got {top_scores}.")
    folder = Path(folder)
    if folder.is_file():
        raise GhostedError(f"{folder} is a file; inspect reads a saved model folder (the one holding config.json).")
    if not folder.is_dir():
        hub = HUB_ID.match(str(folder)) and not str(folder).startswith((".", "/", "~"))
        raise GhostedError(f"{folder} does not exist" + (f"; inspect reads a local folder: download the Hub model first "
                                                         f"(hf download {folder} --local-dir DIR)" if hub else "") + ".")
    raw = verify_folder(folder)  # a truncated or altered weight file (or no config.json) is named here, not in a load
    kind = made_as(raw)
    if kind == "ghosted":
        config = GhostedConfig.from_pretrained(folder)
        tensors = {}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as handle:
                tensors.update({k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys() if ".ghost." in k})
    elif kind == "stock":  # its operators are in its weights
        config, tensors = AutoConfig.from_pretrained(folder, trust_remote_code=False), None
    else:
        raise GhostedError(f"{folder} holds a {raw.get('model_type')!r} model that ghosted_hf did not make (its "
                           "config.json has no ghost_provenance): there is nothing to inspect.")
    return render_text(summarize(config), tensors, top_scores=top_scores)
