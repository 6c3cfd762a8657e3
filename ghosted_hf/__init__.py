"""ghosted_hf: remove decoder layers from Llama/Qwen causal LMs and recover quality in closed form
(Ghosted Layers, arXiv 2605.15491), as first-class Hugging Face Transformers models."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .remote.configuration_ghosted import GhostedConfig
from .remote.modeling_ghosted import GhostedForCausalLM, GhostedModel, GhostOperator
from .calibration import CalibrationStatistics, Calibrator, StatisticsPlan, collect_statistics
from .card import save_with_card
from .errors import GhostedError
from .healing import HealOptions, heal
from .hub import push_to_hub
from .operators import OPERATOR_KINDS, OperatorKind
from .options import PruneOptions
from .recipe import ghost_prune
from .selection import CRITERIA, Criterion
from .surgery import export_plain, prune_layers

__version__ = "0.1.0"

AutoConfig.register(GhostedConfig.model_type, GhostedConfig, exist_ok=True)
AutoModel.register(GhostedConfig, GhostedModel, exist_ok=True)
AutoModelForCausalLM.register(GhostedConfig, GhostedForCausalLM, exist_ok=True)
# save_pretrained then writes `auto_map` and copies the two remote-code files next to the weights.
GhostedConfig.register_for_auto_class()
GhostedModel.register_for_auto_class("AutoModel")
GhostedForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = [
    "CRITERIA",
    "OPERATOR_KINDS",
    "CalibrationStatistics",
    "Calibrator",
    "Criterion",
    "GhostedError",
    "HealOptions",
    "OperatorKind",
    "GhostedConfig",
    "GhostedForCausalLM",
    "GhostedModel",
    "GhostOperator",
    "PruneOptions",
    "StatisticsPlan",
    "collect_statistics",
    "export_plain",
    "ghost_prune",
    "heal",
    "prune_layers",
    "push_to_hub",
    "save_with_card",
    "__version__",
]
