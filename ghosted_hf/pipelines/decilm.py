"""`export_decilm`: a ghosted model as a Nemotron-NAS (DeciLM) safetensors checkpoint, the heterogeneous format that
llama.cpp's converter, mlx-lm and TensorRT-LLM read as it is (no remote code of ours in those engines).

Each layer of a DeciLM model has an attention (Llama's, a linear map of its normed input, or none) and an FFN (Llama's,
or none): a plainly removed layer is a `no_op` block; a normed boundary ``x + n(x) A`` is a linear-attention block
with gain 1 and weight A^T; a replaced attention is its layer's linear attention; a replaced MLP is a linear-attention
block after its layer, with the MLP's norm gain. llama.cpp drops the attention output of a layer whose FFN width is 0,
so a linear-attention block (and a layer whose MLP is a map) carries an all-zero FFN of DeciLM's smallest width, 256.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..architectures import EMBEDDING_WEIGHT, architecture, layer_of, layer_prefix
from ..errors import GhostedError
from ..model.checkpoint import made_as
from ..remote.format_ghosted import NORMED_EPS, kept_layers
from ..remote.modeling_decilm import ffn_width
from .gguf import SubBlockMaps, llama_cpp_families, normed_blocks, subblock_maps

logger = logging.getLogger(__name__)

REMOTE_FILES = ("modeling_decilm.py", "cache_ghosted.py")  # the transformers code saved beside the weights
ZERO_FFN_WIDTH = 256  # DeciLM's smallest FFN width (a multiple of 256)
# What a linear attention's weight is called, by the readers that expect it: `self_attn.linear_attn` in NVIDIA's
# published checkpoints, TensorRT-LLM and llama.cpp's converter; `self_attn.linear` in mlx-lm 0.32, which loads no
# other (its LinearSubblockReplacement). transformers reads either (the config's `linear_attention_name`).
TENSOR_NAMES = {"nemotron": "linear_attn", "mlx-lm": "linear"}


@dataclass
class DeciLayer:
    """One layer of the export: its `block_configs` entry and its tensors (names under ``model.layers.{j}.``)."""

    attention: dict[str, Any]
    ffn: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def block(self) -> dict[str, Any]:
        return {"attention": self.attention, "ffn": self.ffn}


def ffn_mult(width: int, hidden: int) -> float:
    """The `ffn_mult` whose DeciLM width is `width` (a multiple of 256), as every reader computes it."""
    mult = round(1.5 * width / hidden, 6)  # (mlx-lm rounds it to 6 decimals)
    if ffn_width(mult, hidden) != width:
        raise GhostedError(f"No ffn_mult gives an FFN of width {width} at hidden size {hidden} in DeciLM's rounding.")
    return mult


@dataclass
class Pruned:
    """What the export reads off a ghosted model, or off a stock export ghosted_hf made (its provenance keeps which
    layers were removed; it has no blocks or maps)."""

    text: Any  # the pruned decoder's config
    depth: int  # the dense model's layer count
    removed: list[int]
    blocks: dict[int, torch.Tensor] = field(default_factory=dict)  # normed boundaries, by pruned position
    maps: SubBlockMaps = field(default_factory=SubBlockMaps)


def pruned_of(model: Any) -> Pruned:
    """The `Pruned` of a model ghosted_hf made; a GhostedError for any other, or for a boundary operator that no
    DeciLM block is (`normed_blocks`)."""
    made = made_as(getattr(model, "config", None))
    if made == "stock":
        stock = model.config.ghost_provenance["stock_export"]
        pruned = Pruned(model.config, stock["original_num_hidden_layers"], list(stock["removed_layers"]))
        if pruned.depth - len(set(pruned.removed)) != model.config.num_hidden_layers:
            raise GhostedError(f"The stock export's provenance removes {pruned.removed} of {pruned.depth} layers, but "
                               f"it holds {model.config.num_hidden_layers}: its config.json is damaged.")
        return pruned
    if made != "ghosted":
        raise GhostedError("export-decilm takes a model ghosted_hf pruned (a ghosted model or a stock export); a "
                           "dense Llama is a DeciLM model with every block plain already.")
    config = model.config  # (normed_blocks refuses an operator no DeciLM block is)
    return Pruned(config.text_config, config.original_num_hidden_layers, list(config.removed_layers),
                  normed_blocks(model), subblock_maps(model))


def check_expressible(model: Any, text: Any) -> None:
    """Refuse, naming why, a model whose layers DeciLM's (Llama's) cannot be."""
    if architecture(model).gguf_architecture != "llama":
        raise GhostedError(f"export-decilm writes Llama layers (DeciLM's); a pruned {text.model_type} model's are "
                           f"not (families: {llama_cpp_families()}). Serve it with transformers "
                           "(trust_remote_code=True).")
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    problems = [what for what, wrong in (
        ("attention or MLP biases", getattr(text, "attention_bias", False) or getattr(text, "mlp_bias", False)),
        (f"activation {text.hidden_act!r} (DeciLM: silu)", text.hidden_act != "silu"),
        ("a sliding window", getattr(text, "sliding_window", None) is not None),
        (f"head size {head_dim} (DeciLM: hidden size / heads)", head_dim * text.num_attention_heads != text.hidden_size),
        (f"FFN width {text.intermediate_size} (DeciLM: a multiple of 256)", text.intermediate_size % 256 != 0),
    ) if wrong]
    if problems:
        raise GhostedError(f"A DeciLM layer cannot hold this model's: {', '.join(problems)}. Serve it with "
                           "transformers (trust_remote_code=True).")


def decilm_layers(model: Any, pruned: Pruned, linear_name: str = TENSOR_NAMES["nemotron"]) -> list[DeciLayer]:
    """The export's layers in order: each dense layer (a plain removal as a `no_op` block), with a linear-attention
    block after each run of removed layers whose boundary is normed and after each layer whose MLP is a map; a
    linear attention's weight named `linear_name` (`TENSOR_NAMES`)."""
    text, blocks, maps = pruned.text, dict(pruned.blocks), pruned.maps
    hidden, groups = text.hidden_size, text.num_attention_heads // text.num_key_value_heads
    dense_ffn, zero = ffn_mult(text.intermediate_size, hidden), ffn_mult(ZERO_FFN_WIDTH, hidden)
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    kept = kept_layers(pruned.depth, pruned.removed)
    dtype = state[EMBEDDING_WEIGHT].dtype

    def linear(gain: torch.Tensor | None, a: torch.Tensor) -> DeciLayer:
        gain = torch.ones(hidden, dtype=dtype) if gain is None else gain
        return DeciLayer({"no_op": False, "replace_with_linear": True, "n_heads_in_group": None},
                         {"no_op": False, "replace_with_linear": False, "ffn_mult": zero},
                         {"input_layernorm.weight": gain, f"self_attn.{linear_name}.weight": a.T.to(dtype),
                          **zero_ffn(hidden, dtype)})

    layers = []
    for d in range(pruned.depth + 1):
        i = sum(k < d for k in kept)  # the pruned position dense layer d is at, or is removed before
        if d < pruned.depth and d not in kept:
            layers.append(DeciLayer({"no_op": True, "replace_with_linear": False, "n_heads_in_group": None},
                                    {"no_op": True, "replace_with_linear": False, "ffn_mult": None}))
            continue
        if i in blocks:  # the boundary after the removed run, before kept layer i (or the final norm)
            layers.append(linear(None, blocks.pop(i)))
        if d == pruned.depth:
            break
        own = {name.removeprefix(layer_prefix(i)): t for name, t in state.items()
               if name.startswith(layer_prefix(i)) and ".ghost." not in name}
        layer = DeciLayer({"no_op": False, "replace_with_linear": False, "n_heads_in_group": groups},
                          {"no_op": False, "replace_with_linear": False, "ffn_mult": dense_ffn}, own)
        if i in maps.attention:
            layer.attention = {"no_op": False, "replace_with_linear": True, "n_heads_in_group": None}
            own[f"self_attn.{linear_name}.weight"] = maps.attention[i].T.to(dtype)
        gain = own["post_attention_layernorm.weight"]
        if i in maps.mlp:
            layer.ffn = {"no_op": False, "replace_with_linear": False, "ffn_mult": zero}
            own.update(zero_ffn(hidden, dtype))
        layers.append(layer)
        if i in maps.mlp:
            layers.append(linear(gain, maps.mlp[i]))
    return layers


def zero_ffn(hidden: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """An FFN of width 256 that adds nothing (its gate, up and down weights zero), with a unit norm gain."""
    return {"post_attention_layernorm.weight": torch.ones(hidden, dtype=dtype),
            "mlp.gate_proj.weight": torch.zeros(ZERO_FFN_WIDTH, hidden, dtype=dtype),
            "mlp.up_proj.weight": torch.zeros(ZERO_FFN_WIDTH, hidden, dtype=dtype),
            "mlp.down_proj.weight": torch.zeros(hidden, ZERO_FFN_WIDTH, dtype=dtype)}


def decilm_config(model: Any, text: Any, layers: list[DeciLayer], linear_name: str) -> dict[str, Any]:
    """config.json as the published Nemotron-NAS checkpoints write it (rope_theta and rope_scaling at the top, as
    mlx-lm and llama.cpp read them), with the auto_map of the transformers code saved beside it."""
    rope = dict(getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {})  # (5.x, 4.x)
    theta = rope.pop("rope_theta", getattr(text, "rope_theta", 10000.0))
    scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
    return {
        "architectures": ["DeciLMForCausalLM"], "model_type": "nemotron-nas",
        "auto_map": {"AutoConfig": "modeling_decilm.DeciLMConfig",
                     "AutoModelForCausalLM": "modeling_decilm.DeciLMForCausalLM"},
        "block_configs": [layer.block for layer in layers], "num_hidden_layers": len(layers),
        "linear_attention_name": linear_name,
        "hidden_size": text.hidden_size, "num_attention_heads": text.num_attention_heads,
        "num_key_value_heads": text.num_key_value_heads, "intermediate_size": text.intermediate_size,
        "vocab_size": text.vocab_size, "rms_norm_eps": text.rms_norm_eps, "hidden_act": "silu",
        "max_position_embeddings": text.max_position_embeddings, "rope_theta": theta, "rope_scaling": scaling,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": bool(model.config.tie_word_embeddings),
        "bos_token_id": text.bos_token_id, "eos_token_id": text.eos_token_id, "pad_token_id": text.pad_token_id,
        "torch_dtype": str(model.get_input_embeddings().weight.dtype).removeprefix("torch."),
    }


def export_decilm(model: Any, tokenizer: Any, output: str | Path, tensor_names: str = "nemotron") -> Path:
    """Write `model` (a ghosted model, every boundary `normed` or plain, with any replaced sub-blocks; or a stock
    export) to the folder `output` as a Nemotron-NAS checkpoint with its tokenizer, a card, and the transformers code
    that loads it (written beside `output` and moved into place when complete); linear attentions' weights named as
    the readers of `tensor_names` expect (`TENSOR_NAMES`)."""
    from ..io.files import staged_folder

    if tensor_names not in TENSOR_NAMES:
        raise GhostedError(f"tensor_names must be one of {sorted(TENSOR_NAMES)} ('nemotron' for llama.cpp and "
                           f"TensorRT-LLM, 'mlx-lm' for mlx-lm), got {tensor_names!r}.")
    linear_name = TENSOR_NAMES[tensor_names]
    pruned = pruned_of(model)
    check_expressible(model, pruned.text)
    layers = decilm_layers(model, pruned, linear_name)
    eps = pruned.text.rms_norm_eps
    if eps != NORMED_EPS and any(layer.attention.get("replace_with_linear") for layer in layers):
        logger.info("DeciLM normalises the linear-attention blocks with the model's eps %g, not the format's %g: "
                    "negligible unless the stream's mean square is that small.", eps, NORMED_EPS)
    tensors = {name: tensor for name, tensor in model.state_dict().items()
               if layer_of(name) is None and ".ghost." not in name}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    for j, layer in enumerate(layers):
        tensors.update({f"{layer_prefix(j)}{name}": t for name, t in layer.tensors.items()})
    with staged_folder(output) as folder:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps(decilm_config(model, pruned.text, layers, linear_name), indent=2) + "\n")
        for name in REMOTE_FILES:
            shutil.copyfile(Path(__file__).parents[1] / "remote" / name, folder / name)
        if tokenizer is not None:
            from ..io.card import name_tokenizer_class_for_every_reader

            tokenizer.save_pretrained(folder)
            name_tokenizer_class_for_every_reader(folder)  # (AutoTokenizer then reads no model code)
        (folder / "README.md").write_text(decilm_card(pruned, layers, linear_name))
    logger.info("Wrote %s: %d DeciLM layers (%d linear-attention, %d no-op).", output, len(layers),
                sum(bool(x.attention["replace_with_linear"]) for x in layers), sum(x.attention["no_op"] for x in layers))
    return Path(output)


def decilm_card(pruned: Pruned, layers: list[DeciLayer], linear_name: str) -> str:
    """A short model card: what was pruned and replaced, in which format, and which engines read it."""
    linear = [j for j, layer in enumerate(layers) if layer.attention["replace_with_linear"]]
    readers = "mlx-lm" if linear_name == TENSOR_NAMES["mlx-lm"] else "llama.cpp's converter and TensorRT-LLM"
    return (f"---\nlibrary_name: transformers\ntags: [ghosted, pruned, nemotron-nas, decilm]\n---\n\n"
            f"# Ghosted Layers, as a Nemotron-NAS (DeciLM) checkpoint\n\n"
            f"A {pruned.text.model_type} model of {pruned.depth} layers pruned with Ghosted Layers (arXiv "
            f"2605.15491): layers {pruned.removed} removed, {len(pruned.maps.attention) + len(pruned.maps.mlp)} "
            f"sub-blocks replaced by linear maps. Written as {len(layers)} DeciLM blocks: removed layers as `no_op` "
            f"blocks, each normed boundary and replaced sub-block as a linear attention (layers {linear}), each over "
            f"an all-zero FFN of width {ZERO_FFN_WIDTH} where llama.cpp needs one.\n\nThe linear attentions' weights "
            f"are `self_attn.{linear_name}` (read by {readers}, and by transformers with `trust_remote_code=True`, "
            f"the code beside the weights).\n")
