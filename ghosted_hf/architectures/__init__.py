"""The architecture registry and what is derived from transformers' own models: everything ghosted_hf knows about
a decoder family, in one package (`registry`: what is declared; `positions`: what a layer owes its position;
`lookup`: a model's family, declared or derived, and where its modules are).
"""

from .lookup import (Verdict, architecture, centered_norm, decoder, decoder_layers, decoder_only_types,
                     derived_architecture, derived_layout, final_norm, find_layout, lora_target_parameters, lora_targets,
                     quiet_transformers, reads_layer_by_layer, refuse_fold, shallow_layers, small_configs,
                     stream_width)
from .positions import (LAYER_FIELDS, SOFTMAX_LAYER_TYPES, Rule, check_layers_match, check_removal, kv_per_token,
                        kv_sources, layers_to_keep_one_of, pruned_config, removal_problem)
from .registry import (ARCHITECTURES, EMBEDDING_WEIGHT, ENTRIES, GAINS, NORM_PLACEMENTS, Architecture, Layout,
                       StreamWeight, SubBlock, check_declared, checked_shapes, checkpoint_layer, is_multimodal,
                       language_config, layer_of, layer_prefix, refuse_non_decoder, stream_weights)

__all__ = ["ARCHITECTURES", "EMBEDDING_WEIGHT", "ENTRIES", "GAINS", "LAYER_FIELDS", "NORM_PLACEMENTS",
           "SOFTMAX_LAYER_TYPES", "Architecture", "Layout", "Rule", "StreamWeight", "SubBlock", "Verdict",
           "architecture", "centered_norm", "check_declared", "check_layers_match", "check_removal", "checked_shapes",
           "checkpoint_layer", "decoder", "decoder_layers", "decoder_only_types", "derived_architecture",
           "derived_layout", "final_norm", "find_layout", "is_multimodal", "kv_per_token", "kv_sources", "language_config",
           "layer_of", "layer_prefix", "layers_to_keep_one_of", "lora_target_parameters", "lora_targets",
           "pruned_config", "quiet_transformers", "reads_layer_by_layer", "refuse_fold", "refuse_non_decoder",
           "removal_problem", "shallow_layers", "small_configs", "stream_weights", "stream_width"]
