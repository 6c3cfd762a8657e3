"""Model card (README.md) of a saved ghosted model, rendered with huggingface_hub from the same summary
that `ghosted inspect` prints."""

from __future__ import annotations

import importlib.resources
import json
import logging
import re
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from ..assets import NOTICE_FILE, base_model_info
from ..errors import GhostedError
from ..model.provenance import Provenance
from ..remote.configuration_ghosted import GhostedConfig
from ..utils.distributed import is_main_process
from .files import staged_folder
from .summary import summarize

logger = logging.getLogger(__name__)

TAGS = ["ghosted-layers", "layer-pruning", "custom_code", "pruned"]
STOCK_TAGS = ["ghosted-layers", "layer-pruning", "pruned"]  # a stock checkpoint: no custom code
PLOT_FILE = "selection_scores.png"


def eval_results(config: GhostedConfig) -> list[EvalResult]:
    """`model-index` entries from the ``ghost_provenance["evaluation"]`` records."""
    return [EvalResult(**record) for record in Provenance.of(config).evaluation]


def score_axis_scale(values: list[float]) -> str:
    """"log" when the scores are positive and span more than a decade: the chosen candidate's score is often the
    smallest by far (a fit residual), and a linear axis draws its bar as nothing."""
    positive = [v for v in values if v > 0]
    return "log" if positive and len(positive) == len(values) and max(positive) > 10 * min(positive) else "linear"


def write_score_plot(config: GhostedConfig, folder: Path) -> str | None:
    """Bar chart of the selection scores, removed candidates in red (needs matplotlib, the `plot` extra)."""
    summary = summarize(config)
    if not summary.scores:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info("matplotlib is not installed: the model card has no score plot.")
        return None
    scores = Provenance.of(config).selection["scores"]  # in layer order, not ranked
    chosen = {name for name, _, removed in summary.scores if removed}
    names, values = list(scores), list(scores.values())
    figure, axes = plt.subplots(figsize=(max(6, 0.3 * len(names)), 3))
    axes.bar(range(len(names)), values, color=["tab:red" if n in chosen else "tab:gray" for n in names])
    axes.set_yscale(score_axis_scale(values))
    axes.set_xticks(range(len(names)), names, rotation=90, fontsize=7)
    axes.set_ylabel(f"{summary.criterion} ({summary.better} is better)")
    axes.set_title("Layer selection scores (removed in red)")
    figure.tight_layout()
    figure.savefig(folder / PLOT_FILE, dpi=100)
    plt.close(figure)
    return PLOT_FILE


def build_card(config: GhostedConfig, repo_id: str | None = None, license: str | None = None,
               plot: str | None = None, revision: str | None = None, local_path: str | None = None) -> ModelCard:
    """The card of `config`'s model; `revision` (the commit the files were pushed as) is pinned in the
    code sample. Without a `repo_id`, the sample loads `local_path` (the folder as it was saved)."""
    summary, prov = summarize(config), Provenance.of(config)
    base = base_model_info(prov.base_model)
    hub_id = base.hub_id
    local = repo_id is None
    repo_id = repo_id or local_path or "path/to/this-model"
    model_name = repo_id.rstrip("/").split("/")[-1]
    card_data = ModelCardData(
        base_model=hub_id,
        library_name="transformers",
        pipeline_tag="image-text-to-text" if summary.multimodal else "text-generation",
        license=license or prov.base_model_license or base.license,
        tags=STOCK_TAGS if summary.stock else TAGS,
        model_name=model_name,
        eval_results=eval_results(config) or None,
    )
    template = importlib.resources.files("ghosted_hf.model_cards") / "ghosted_model_card.md"
    card = ModelCard.from_template(
        card_data,
        template_str=template.read_text(encoding="utf-8"),
        model_name=model_name,
        repo_id=repo_id,
        local=local,
        revision=revision,
        base_description=f"[{hub_id}](https://huggingface.co/{hub_id})" if hub_id else "A causal language model",
        summary=summary,
        plot=plot,
        ghosted_version=(prov.versions or {}).get("ghosted_hf", ""),
        notice=prov.base_model_notice,
    )
    return ModelCard(re.sub(r"\n{3,}", "\n\n", card.content))  # sections left out leave no runs of blank lines


def name_tokenizer_class_for_every_reader(folder: Path) -> None:
    """transformers 5 saves a fast tokenizer as the class `TokenizersBackend`, which transformers 4.x (and
    llama.cpp's converter running on it) cannot load; its older name, `PreTrainedTokenizerFast`, loads on both."""
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return
    values = json.loads(path.read_text())
    if values.get("tokenizer_class") == "TokenizersBackend":
        values["tokenizer_class"] = "PreTrainedTokenizerFast"
        path.write_text(json.dumps(values, indent=2, ensure_ascii=False) + "\n")


def check_finite(model: Any) -> None:
    """Refuse to save a model holding NaN or Inf anywhere (a diverged heal, a damaged teacher merged in): it would
    load and generate garbage."""
    import torch

    bad = [name for name, tensor in model.state_dict().items()
           if tensor.is_floating_point() and tensor.device.type != "meta" and not torch.isfinite(tensor).all()]
    if bad:
        raise GhostedError(f"The model holds NaN or Inf values in {len(bad)} tensor(s) ({', '.join(bad[:3])}"
                           f"{', ...' if len(bad) > 3 else ''}): nothing was saved. If it was healed, heal again with a "
                           "lower --lr.")


def save_with_card(model: Any, folder: str | Path, tokenizer: Any = None, repo_id: str | None = None,
                   license: str | None = None) -> Path:
    """`save_pretrained` plus the tokenizer, the generated README.md and the score plot; the way to save a
    ghosted model or a stock export. All or nothing: the folder is written beside `folder` and replaces it whole, so an
    interrupted save leaves the previous folder as it was and nothing of an earlier save survives."""
    config = model.config
    summarize(config)  # refuses a model that ghosted_hf did not make
    check_finite(model)
    folder = Path(folder)
    if not is_main_process():
        return folder  # under torchrun every process holds the same model: the main one writes it
    with staged_folder(folder) as staging:
        model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
            name_tokenizer_class_for_every_reader(staging)
        plot = write_score_plot(config, staging)
        notice = Provenance.of(config).base_model_notice
        if notice:  # the base's terms ask every derivative to ship it (Gemma: "a 'Notice' text file")
            (staging / NOTICE_FILE).write_text(notice)
        build_card(config, repo_id=repo_id, license=license, plot=plot, local_path=str(folder)).save(
            staging / "README.md")
    return folder
