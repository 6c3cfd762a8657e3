"""Model card (README.md) of a saved ghosted model, generated from its config with huggingface_hub."""

from __future__ import annotations

import importlib.resources
import json
import logging
import re
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from .remote.configuration_ghosted import GhostedConfig

logger = logging.getLogger(__name__)

TAGS = ["ghosted-layers", "layer-pruning", "custom_code", "pruned"]
SOURCE_FILE = "SOURCE.json"  # written next to converted base models: {"hub_id": ..., "license": ...}
PLOT_FILE = "selection_scores.png"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def base_model_info(name_or_path: str | None) -> tuple[str | None, str | None]:
    """(Hub id, license) of the base model when they can be known offline."""
    if not name_or_path:
        return None, None
    folder = Path(name_or_path)
    if folder.is_dir():
        source = folder / SOURCE_FILE
        if source.is_file():
            info = json.loads(source.read_text())
            return info.get("hub_id"), info.get("license")
        readme = folder / "README.md"
        if readme.is_file():
            data = ModelCard.load(readme).data
            return getattr(data, "base_model", None), getattr(data, "license", None)
        return None, None
    return (name_or_path if HUB_ID.match(name_or_path) else None), None


def eval_results(config: GhostedConfig) -> list[EvalResult]:
    """`model-index` entries from ``ghost_provenance["evaluation"]`` (a list of
    {task_type, dataset_type, dataset_name, metric_type, metric_value} records)."""
    return [EvalResult(**record) for record in config.ghost_provenance.get("evaluation", [])]


def write_score_plot(config: GhostedConfig, folder: Path) -> str | None:
    """Bar chart of the selection scores (needs matplotlib, the `plot` extra)."""
    selection = config.ghost_provenance.get("selection") or {}
    scores = selection.get("scores") or {}
    if not scores:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info("matplotlib is not installed: the model card has no score plot.")
        return None
    names = list(scores)
    chosen = {str(i) for i in config.removed_layers}
    colors = ["tab:red" if n in chosen or n == _block_name(config.removed_layers) else "tab:gray" for n in names]
    figure, axes = plt.subplots(figsize=(max(6, 0.3 * len(names)), 3))
    axes.bar(range(len(names)), [scores[n] for n in names], color=colors)
    axes.set_xticks(range(len(names)), names, rotation=90, fontsize=7)
    axes.set_ylabel(f"{selection['criterion']} ({selection['better']} is better)")
    axes.set_title("Layer selection scores (chosen in red)")
    figure.tight_layout()
    figure.savefig(folder / PLOT_FILE, dpi=100)
    plt.close(figure)
    return PLOT_FILE


def _block_name(layers: list[int]) -> str:
    return f"{layers[0]}-{layers[-1]}" if layers else ""


def _figures(fit: dict[str, Any]) -> str:
    keys = ("relative_residual", "residual_vs_target", "pruned_residual_vs_target", "condition_number")
    return ", ".join(f"{k}={fit[k]:.4g}" for k in keys if isinstance(fit.get(k), (int, float))) or "-"


def build_card(config: GhostedConfig, repo_id: str | None = None, license: str | None = None,
               plot: str | None = None) -> ModelCard:
    prov = config.ghost_provenance or {}
    text = config.text_config
    hub_id, base_license = base_model_info(prov.get("base_model"))
    repo_id = repo_id or "path/to/this-model"
    model_name = repo_id.split("/")[-1]
    card_data = ModelCardData(
        base_model=hub_id,
        library_name="transformers",
        pipeline_tag="text-generation",
        license=license or base_license,
        tags=TAGS,
        model_name=model_name,
        eval_results=eval_results(config) or None,
    )
    params = prov.get("parameters") or {}
    selection = prov.get("selection") or {}
    calibration = prov.get("calibration") or {}
    scores = selection.get("scores") or {}
    ranked = sorted(scores.items(), key=lambda kv: kv[1], reverse=selection.get("better") == "higher")
    boundaries = []
    for b in config.ghost_boundaries:
        feeds = f"layer {b['layer']} (dense {b['original_layer']})" if b["target"] == "layer" else "final norm"
        operator = b["operator"] + (f" (fused into `{b['fused_into']}`)" if b.get("fused_into") else "")
        boundaries.append({"removed": b["removed"], "feeds": feeds, "operator": operator, "figures": _figures(b.get("fit") or {})})
    template = importlib.resources.files("ghosted_hf.model_cards") / "ghosted_model_card.md"
    return ModelCard.from_template(
        card_data,
        template_str=template.read_text(encoding="utf-8"),
        model_name=model_name,
        repo_id=repo_id,
        base_description=f"[{hub_id}](https://huggingface.co/{hub_id})" if hub_id else "A causal language model",
        base_model=hub_id or prov.get("base_model") or "unknown",
        model_type=text.model_type,
        hidden_size=text.hidden_size,
        original_layers=config.original_num_hidden_layers,
        kept_layers=text.num_hidden_layers,
        removed_count=len(config.removed_layers),
        removed_layers=config.removed_layers,
        parameters=(f"{params['dense']:,} -> {params['pruned']:,} (+ {params['operators']:,} in operators)"
                    if params else "unknown"),
        selection=(f"{selection.get('criterion')}" if selection else "unknown"),
        selection_criterion=selection.get("criterion"),
        selection_better=selection.get("better"),
        scores=[(name, f"{score:.6g}") for name, score in ranked],
        chosen=_block_name(config.removed_layers),
        plot=plot,
        operator=prov.get("operator", "unknown"),
        fitting=prov.get("fitting", "unknown"),
        calibration=(f"{calibration.get('name')}: {calibration.get('tokens_used')} tokens in "
                     f"{calibration.get('sequences')} sequences of {calibration.get('sequence_length')}, "
                     f"sha256 `{calibration.get('sha256')}`" if calibration else "unknown"),
        solver=", ".join(f"{k}={v}" for k, v in (prov.get("solver") or {}).items()) or "unknown",
        operator_dtype=config.operator_dtype,
        versions=", ".join(f"{k} {v}" for k, v in (prov.get("versions") or {}).items()) or "unknown",
        boundaries=boundaries,
        evaluations=prov.get("evaluation", []),
        ghosted_version=(prov.get("versions") or {}).get("ghosted_hf", ""),
    )


def save_with_card(model: Any, folder: str | Path, tokenizer: Any = None, repo_id: str | None = None,
                   license: str | None = None) -> Path:
    """`save_pretrained` plus the generated README.md (and score plot); the way to save a ghosted model."""
    config = model.config
    if getattr(config, "model_type", None) != "ghosted":
        raise ValueError("save_with_card expects a GhostedForCausalLM; a plain export carries no ghost metadata.")
    folder = Path(folder)
    model.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    plot = write_score_plot(config, folder)
    build_card(config, repo_id=repo_id or folder.name, license=license, plot=plot).save(folder / "README.md")
    return folder
