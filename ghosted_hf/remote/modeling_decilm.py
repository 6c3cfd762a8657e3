"""A Nemotron-NAS (DeciLM) checkpoint in transformers: Llama layers whose attention and FFN are each, layer by layer,
Llama's (with the layer's own KV heads and FFN width), a linear map of the normed stream, or absent (`block_configs`,
the format of NVIDIA's Nemotron-NAS / Puzzletron checkpoints, which llama.cpp, mlx-lm and TensorRT-LLM read).

Written beside the weights by ghosted_hf's `export-decilm` and loaded with ``trust_remote_code=True``; imports only
torch, transformers and the standard library, and defines the model.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP

from .cache_ghosted import track_positions


class Fields(dict):
    """A block config read as a mapping (transformers, config.json) or by attribute (``block.attention.no_op``, as
    vLLM's DeciLM reads the published checkpoints' configs)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class DeciLMConfig(LlamaConfig):
    r"""A Llama config with `block_configs`: per layer ``{"attention": {"no_op", "replace_with_linear",
    "n_heads_in_group"}, "ffn": {"no_op", "replace_with_linear", "ffn_mult"}}``."""

    model_type = "nemotron-nas"

    def __init__(self, block_configs: list[dict[str, Any]] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.block_configs = [Fields({part: Fields(block[part]) for part in ("attention", "ffn")})
                              for block in block_configs or []]


def ffn_width(ffn_mult: float, hidden_size: int) -> int:
    """DeciLM's FFN width for `ffn_mult`: 2/3 of ffn_mult x hidden_size, rounded up to a multiple of 256."""
    width = int(2 * ffn_mult * hidden_size / 3)
    return width if width % 256 == 0 else width + 256 - width % 256


class ReplacedSubblock(nn.Module):
    """An attention or FFN that is a linear map of its normed input (`linear_attn` / `linear_mlp`, bias-free), or no
    module at all (`name` None: it adds nothing). In place of attention it keeps the KV cache's length, holding no
    keys or values."""

    def __init__(self, name: str | None, hidden_size: int, layer_idx: int, attention: bool) -> None:
        super().__init__()
        self.name, self.layer_idx, self.attention = name, layer_idx, attention
        if name is not None:
            self.add_module(name, nn.Linear(hidden_size, hidden_size, bias=False))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden_states = args[0] if args else kwargs["hidden_states"]
        if self.attention:
            track_positions(hidden_states, kwargs, self.layer_idx)
        out = getattr(self, self.name)(hidden_states) if self.name else torch.zeros_like(hidden_states)
        return (out, None) if self.attention else out


def _with(config: DeciLMConfig, **fields: Any) -> DeciLMConfig:
    changed = copy.deepcopy(config)
    for key, value in fields.items():
        setattr(changed, key, value)
    return changed


class DeciLMForCausalLM(LlamaForCausalLM):
    """Llama's causal LM with each layer's attention and FFN as its `block_configs` entry says."""

    config_class = DeciLMConfig

    def __init__(self, config: DeciLMConfig) -> None:
        blocks = list(getattr(config, "block_configs", None) or [])
        if len(blocks) != config.num_hidden_layers:
            raise ValueError(f"block_configs has {len(blocks)} entries for {config.num_hidden_layers} layers: the "
                             "config.json is damaged.")
        super().__init__(config)
        for i, (layer, block) in enumerate(zip(self.model.layers, blocks)):
            attention, ffn = block["attention"], block["ffn"]
            if attention.get("no_op") or attention.get("replace_with_linear"):
                # (`self_attn.linear_attn` as published; mlx-lm's `self_attn.linear` where the config says so)
                name = getattr(config, "linear_attention_name", None) or "linear_attn"
                linear = name if attention.get("replace_with_linear") else None
                layer.self_attn = ReplacedSubblock(linear, config.hidden_size, i, attention=True)
                if linear is None:
                    layer.input_layernorm = nn.Identity()
            elif config.num_attention_heads // attention["n_heads_in_group"] != config.num_key_value_heads:
                heads = config.num_attention_heads // attention["n_heads_in_group"]
                layer.self_attn = LlamaAttention(_with(config, num_key_value_heads=heads), i)
            if ffn.get("no_op") or ffn.get("replace_with_linear"):
                linear = "linear_mlp" if ffn.get("replace_with_linear") else None
                layer.mlp = ReplacedSubblock(linear, config.hidden_size, i, attention=False)
                if linear is None:
                    layer.post_attention_layernorm = nn.Identity()
            elif ffn_width(ffn["ffn_mult"], config.hidden_size) != config.intermediate_size:
                layer.mlp = LlamaMLP(_with(config, intermediate_size=ffn_width(ffn["ffn_mult"], config.hidden_size)))
        self.post_init()

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:
        """Loads as Llama does, refusing a checkpoint whose tensors do not all match the layers its config
        describes (nothing is left as initialised)."""
        wanted = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        problems = {key: sorted(map(str, info.get(key) or [])) for key in ("missing_keys", "unexpected_keys",
                                                                          "mismatched_keys")}
        if any(problems.values()):
            raise ValueError(f"This DeciLM checkpoint does not match its config.json's block_configs "
                             f"({ {k: v[:3] for k, v in problems.items() if v} }): download or export it again.")
        return (model, info) if wanted else model
