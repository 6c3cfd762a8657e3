"""ghosted_hf: remove decoder layers from decoder-only causal LMs and recover quality in closed form
(Ghosted Layers, arXiv 2605.15491), as first-class Hugging Face Transformers models."""

import importlib.metadata

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForImageTextToText

from .assets import default_model_dir, wikipedia_split
from .errors import GhostedError
from .fitting.operators import OPERATOR_KINDS, OperatorKind
from .fitting.selection import CRITERIA, Criterion
from .io.card import save_with_card
from .io.hub import push_to_hub
from .io.summary import inspect_folder
from .model.loading import load_for_calibration
from .model.folding import to_stock_model
from .model.surgery import prune_layers
from .options import ExportOptions, PruneOptions
from .pipelines.export import export_stock
from .pipelines.healing import HealOptions, HealResult, heal, merge
from .pipelines.prune import calibrate, ghost_prune
from .remote.configuration_ghosted import GhostedConfig
from .remote.modeling_ghosted import GhostedForCausalLM, GhostedForConditionalGeneration, GhostedModel, GhostOperator
from .statistics import CalibrationStatistics, LayerwisePass, StatisticsPlan, collect_statistics

__version__ = importlib.metadata.version("ghosted_hf")

AutoConfig.register(GhostedConfig.model_type, GhostedConfig, exist_ok=True)
AutoModel.register(GhostedConfig, GhostedModel, exist_ok=True)
AutoModelForCausalLM.register(GhostedConfig, GhostedForCausalLM, exist_ok=True)
AutoModelForImageTextToText.register(GhostedConfig, GhostedForConditionalGeneration, exist_ok=True)
# save_pretrained then writes `auto_map` and copies the two remote-code files next to the weights.
GhostedConfig.register_for_auto_class()
GhostedModel.register_for_auto_class("AutoModel")
GhostedForCausalLM.register_for_auto_class("AutoModelForCausalLM")
GhostedForConditionalGeneration.register_for_auto_class("AutoModelForImageTextToText")

__all__ = [
    "CRITERIA",
    "OPERATOR_KINDS",
    "CalibrationStatistics",
    "Criterion",
    "ExportOptions",
    "GhostedConfig",
    "GhostedError",
    "GhostedForCausalLM",
    "GhostedForConditionalGeneration",
    "GhostedModel",
    "GhostOperator",
    "HealOptions",
    "HealResult",
    "LayerwisePass",
    "OperatorKind",
    "PruneOptions",
    "StatisticsPlan",
    "__version__",
    "calibrate",
    "collect_statistics",
    "default_model_dir",
    "export_stock",
    "ghost_prune",
    "heal",
    "inspect_folder",
    "load_for_calibration",
    "merge",
    "prune_layers",
    "push_to_hub",
    "save_with_card",
    "to_stock_model",
    "wikipedia_split",
]
