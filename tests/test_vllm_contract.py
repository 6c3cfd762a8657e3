"""What vLLM's Transformers backend asks of a remote-code model, checked on the CPU as the backend uses it:
`auto_map` names an `AutoModel` class; that base class (not the LM head) holds every customisation and
declares `_supports_attention_backend`; it builds on the meta device from the config; it has exactly one
`nn.ModuleList` of decoder layers; and every layer's attention goes through `ALL_ATTENTION_FUNCTIONS` under
the configured name, with the kwargs the caller passes."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tiny import batch, build, char_tokenizer, random_operator
from torch import nn
from transformers import AttentionInterface, AutoConfig, AutoModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ghosted_hf import GhostedModel, GhostOperator, prune_layers, save_with_card


def saved(tmp_path: Path, arch: str = "qwen2") -> Path:
    model = prune_layers(build(arch), [1, 2, 5], {1: random_operator(1), 5: random_operator(2)})
    return save_with_card(model, tmp_path / "ghosted", char_tokenizer())


def test_auto_map_names_the_base_model_which_holds_every_customisation(tmp_path: Path) -> None:
    folder = saved(tmp_path)
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModel"] == "modeling_ghosted.GhostedModel"
    base = AutoModel.from_pretrained(folder)
    assert type(base).__name__ == "GhostedModel" and base._supports_attention_backend
    operators = [m for m in base.modules() if isinstance(m, GhostOperator)]
    assert len(operators) == 2  # the operators live in the base model, not in the LM head class


def test_it_builds_on_the_meta_device_with_one_module_list(tmp_path: Path) -> None:
    config = AutoConfig.from_pretrained(saved(tmp_path))
    with torch.device("meta"):
        model = GhostedModel(config)
    assert all(p.device.type == "meta" for p in model.parameters())
    lists = [name for name, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    assert lists == ["model.layers"] and len(model.model.layers) == config.num_hidden_layers


def test_every_layer_attends_through_the_registered_attention_function(tmp_path: Path) -> None:
    calls: list[dict] = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        calls.append({"layer": module.layer_idx, "marker": kwargs.get("vllm_marker")})
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("ghosted_contract", recording)
    AttentionMaskInterface.register("ghosted_contract", sdpa_mask)  # as the backend registers its own
    base = AutoModel.from_pretrained(saved(tmp_path))  # qwen2: full and sliding-window layers
    inputs = batch()
    with torch.no_grad():
        expected = base(**inputs).last_hidden_state
        base.set_attn_implementation("ghosted_contract")
        got = base(**inputs, vllm_marker="passed down").last_hidden_state
    assert sorted(c["layer"] for c in calls) == list(range(base.config.num_hidden_layers))
    assert {c["marker"] for c in calls} == {"passed down"}
    torch.testing.assert_close(got, expected)  # the same attention, through the registered function
