"""The architecture registry: what ghosted_hf is told about a decoder family, in one place.

What transformers can tell (decoder, layers, norms, embeddings, head) is derived from the model (`lookup`); an entry
declares only what cannot be: where the norms sit, which weights read and write the stream, what stock checkpoints and
llama.cpp can hold. Adding a family is one `Architecture` entry and one tiny-model test (tests/test_architectures.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from ..errors import GhostedError
from ..remote.format_ghosted import DEFAULT_LAYOUT

NORM_PLACEMENTS = ("pre", "sandwich", "post")  # where the norms sit around each sub-block
GAINS = ("weight", "one-plus-weight")  # RMSNorm(x) * w, or RMSNorm(x) * (1 + w) (Gemma)


@dataclass(frozen=True)
class SubBlock:
    """One residual branch of a decoder layer: the module (the first of `modules` the layer has), the norm it reads
    (None: the stream itself, post-norm), the weights that read that normalised stream and write the residual stream
    (for a stock fold), and the norm on its output before it is added (sandwich and post-norm families). A reader or
    writer is a Linear's name, or a parameter's path with the axis of the stream's width (``"experts.gate_up_proj@-1"``:
    fused experts, routers); a name a layer lacks is skipped (dense and sparse layers of one family differ)."""

    modules: tuple[str, ...]
    norm: str | None
    readers: tuple[str, ...] = ()
    writers: tuple[str, ...] = ()
    output_norm: str | None = None

    def module(self, layer: nn.Module) -> nn.Module:
        return getattr(layer, self.attribute(layer))

    def attribute(self, layer: nn.Module) -> str:
        """The name under which `layer` holds this sub-block."""
        for name in self.modules:
            if isinstance(getattr(layer, name, None), nn.Module):
                return name
        raise GhostedError(f"{type(layer).__name__} has none of the sub-blocks {self.modules}.")


@dataclass(frozen=True)
class Layout:
    """Where a causal LM keeps its decoder layers and the norm after the last one, as module paths (Llama's, or
    GPT-2's ``transformer.h`` and ``transformer.ln_f``, ...): a ghosted model holds the family's modules under the same
    names, and records a layout other than Llama's in its config (`ghost_layout`)."""

    layers: str = DEFAULT_LAYOUT["layers"]
    norm: str = DEFAULT_LAYOUT["norm"]
    # How many hidden_size-wide streams the residual carries between layers (hyper-connections: Qwen4-exp's 4), so
    # a boundary's operator is (streams C) x (streams C); `norm` is then what reads the last layer's output.
    streams: int = 1

    @property
    def is_default(self) -> bool:
        return self == Layout()

    def as_config(self) -> dict[str, Any] | None:
        """The `ghost_layout` config field: None for Llama's layout (older readers' only one)."""
        if self.is_default:
            return None
        return {"layers": self.layers, "norm": self.norm, **({"streams": self.streams} if self.streams > 1 else {})}


@dataclass(frozen=True)
class Architecture:
    """One decoder family (or several that share a layout), keyed by their `model_type`s."""

    model_types: tuple[str, ...]
    attention: SubBlock
    mlp: SubBlock
    norm_placement: str = "pre"
    gain: str = "weight"
    stock_folds: bool = False  # a scaled rotation and a down_proj transform fold exactly into its stock checkpoint
    # The GGUF architecture llama.cpp's converter writes for a pruned checkpoint of it, where export-gguf's DeciLM
    # rewrite maps that layout; None: export-gguf refuses the family.
    gguf_architecture: str | None = None
    moe: bool = False
    hybrid: bool = False  # some layers hold another mixer than attention (linear attention, state space)
    # Derived from the model rather than declared (`derived_architecture`): used once a small instance of its config
    # passed the skip-reference check (`model.verify.check_derived_layout`).
    derived: bool = False
    layout: Layout = Layout()

    def __post_init__(self) -> None:
        assert self.norm_placement in NORM_PLACEMENTS and self.gain in GAINS

    @property
    def name(self) -> str:
        return self.model_types[0]


# Llama's names (q/k/v/o, gate/up/down, input_layernorm, post_attention_layernorm); other layouts as differences.
_LLAMA_ATTENTION = SubBlock(("self_attn",), "input_layernorm", ("q_proj", "k_proj", "v_proj"), ("o_proj",))
_LLAMA_MLP = SubBlock(("mlp",), "post_attention_layernorm", ("gate_proj", "up_proj"), ("down_proj",))
_LLAMA = {"attention": _LLAMA_ATTENTION, "mlp": _LLAMA_MLP}
_SANDWICH = {"attention": replace(_LLAMA_ATTENTION, output_norm="post_attention_layernorm"),
             "mlp": replace(_LLAMA_MLP, norm="pre_feedforward_layernorm", output_norm="post_feedforward_layernorm"),
             "norm_placement": "sandwich"}
_POST_NORM = {"attention": replace(_LLAMA_ATTENTION, norm=None, output_norm="post_attention_layernorm"),
              "mlp": replace(_LLAMA_MLP, norm=None, output_norm="post_feedforward_layernorm"), "norm_placement": "post"}
# The router, the fused experts (F.linear layout: [experts, out, in]), shared experts and their gate; a name a layer
# lacks is skipped (first_k_dense_replace, mlp_only_layers: dense MLPs with Llama's names).
_MOE_READERS = ("gate.weight@-1", "gate.wg", "router.weight@-1", "experts.gate_up_proj@-1", "gate_proj", "up_proj",
                *(f"{shared}.{name}" for shared in ("shared_expert", "shared_experts", "shared_mlp")
                  for name in ("gate_proj", "up_proj")), "shared_expert_gate")
_MOE_WRITERS = ("experts.down_proj@-2", "down_proj", "shared_expert.down_proj", "shared_experts.down_proj",
                "shared_mlp.down_proj")
_MOE_MLP = SubBlock(("mlp", "block_sparse_moe"), "post_attention_layernorm", _MOE_READERS, _MOE_WRITERS)
# Attention of the MoE families: Llama's names, or DeepSeek's multi-head latent attention (low-rank q and kv inputs).
_ATTENTION = replace(_LLAMA_ATTENTION, readers=(*_LLAMA_ATTENTION.readers, "q_a_proj", "kv_a_proj_with_mqa"))
# Hybrids: softmax attention (gated q_proj), or a gated DeltaNet reading the stream through its input projections
# (Qwen3-Next fuses them in pairs, Qwen3.5 keeps four) and writing it through out_proj.
_HYBRID_ATTENTION = SubBlock(("self_attn", "linear_attn"), "input_layernorm",
                             ("q_proj", "k_proj", "v_proj", "in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z",
                              "in_proj_b", "in_proj_a"), ("o_proj", "out_proj"))

ENTRIES: tuple[Architecture, ...] = (
    # Dense pre-norm families with Llama's names: every operator kind, stock folds checked numerically.
    Architecture(("llama", "mistral"), **_LLAMA, stock_folds=True, gguf_architecture="llama"),
    # llama.cpp's converter writes Qwen as its own `qwen2`/`qwen3` architectures, which the DeciLM rewrite cannot map.
    Architecture(("qwen2", "qwen3"), **_LLAMA, stock_folds=True),
    Architecture(("smollm3", "ministral", "helium", "seed_oss", "ernie4_5", "hunyuan_v1_dense"), **_LLAMA,
                 stock_folds=True),
    Architecture(("arcee",), attention=_LLAMA_ATTENTION, mlp=replace(_LLAMA_MLP, readers=("up_proj",)),
                 stock_folds=True),
    # Multipliers on embeddings, residual branches, attention and logits: scalars, which a rotation passes.
    Architecture(("granite",), **_LLAMA, stock_folds=True),
    Architecture(("gemma",), **_LLAMA, gain="one-plus-weight", stock_folds=True),
    Architecture(("phi3",), attention=replace(_LLAMA_ATTENTION, readers=("qkv_proj",)),
                 mlp=replace(_LLAMA_MLP, readers=("gate_up_proj",)), stock_folds=True),
    Architecture(("glm", "glm4"), attention=replace(_LLAMA_ATTENTION, output_norm="post_self_attn_layernorm"),
                 mlp=replace(_LLAMA_MLP, readers=("gate_up_proj",), output_norm="post_mlp_layernorm"),
                 norm_placement="sandwich"),
    Architecture(("starcoder2",), attention=_LLAMA_ATTENTION,
                 mlp=SubBlock(("mlp",), "post_attention_layernorm", ("c_fc",), ("c_proj",))),
    Architecture(("cohere", "cohere2"), attention=SubBlock(("self_attn",), "input_layernorm"),
                 mlp=SubBlock(("mlp",), "input_layernorm")),  # parallel branches, one norm
    # Sandwich norms (a gain after each branch) and post-norm families: ghost and normed kinds, no stock fold.
    Architecture(("gemma2", "gemma3_text"), **_SANDWICH, gain="one-plus-weight"),
    Architecture(("olmo2", "olmo3"), **_POST_NORM),
    # Mixture-of-experts families: the router and the experts read the normalised stream.
    Architecture(("phimoe",), attention=_ATTENTION, mlp=_MOE_MLP, moe=True),
    Architecture(("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "granitemoe", "deepseek_v2", "deepseek_v3",
                  "glm4_moe", "minimax_m2", "dots1", "hunyuan_v1_moe", "ernie4_5_moe"),
                 attention=_ATTENTION, mlp=_MOE_MLP, moe=True, stock_folds=True),
    # gpt-oss: experts in the x @ W layout ([experts, in, out]) with biases, a router with a bias.
    Architecture(("gpt_oss",), attention=_ATTENTION,
                 mlp=SubBlock(("mlp",), "post_attention_layernorm", ("router.weight@-1", "experts.gate_up_proj@-2"),
                              ("experts.down_proj@-1", "experts.down_proj_bias@-1")), moe=True, stock_folds=True),
    # Hybrids: some layers hold linear attention (gated DeltaNet) instead of softmax attention.
    Architecture(("qwen3_next",), attention=_HYBRID_ATTENTION, mlp=_MOE_MLP, gain="one-plus-weight", moe=True,
                 hybrid=True, stock_folds=True),
    Architecture(("qwen3_5_text",), attention=_HYBRID_ATTENTION, mlp=_LLAMA_MLP, gain="one-plus-weight",
                 hybrid=True, stock_folds=True),
)
ARCHITECTURES: dict[str, Architecture] = {t: entry for entry in ENTRIES for t in entry.model_types}


def language_config(config: Any) -> Any:
    """The config of the language decoder: a multimodal model's text config (Gemma 3's `text_config`), a ghosted
    model's base's, else `config` itself."""
    if getattr(config, "model_type", None) == "ghosted":
        config = config.text_config
    get = getattr(config, "get_text_config", None)
    if not callable(get):
        return config
    try:
        return get()
    except ValueError:  # a text encoder beside the decoder (several text configs): the decoder's
        return get(decoder=True)


def is_multimodal(config: Any) -> bool:
    """Whether a (base or ghosted) config describes a multimodal model around its language decoder."""
    if getattr(config, "model_type", None) == "ghosted":
        return config.base_config is not None
    return language_config(config) is not config


def refuse_non_decoder(model_type: Any, is_encoder_decoder: bool = False) -> None:
    """Refuse an encoder-decoder or an encoder (a masked LM) as what it is."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_MASKED_LM_MAPPING_NAMES,
                                                        MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)

    if not isinstance(model_type, str):
        return  # a damaged config: its reader names the field
    if is_encoder_decoder or model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        raise GhostedError(f"{model_type!r} is an encoder-decoder model: ghosted_hf prunes decoder-only causal LMs.")
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and model_type not in ARCHITECTURES:
        raise GhostedError(f"{model_type!r} is an encoder (a masked LM), not a decoder-only causal LM: ghosted_hf prunes "
                           "decoder-only causal LMs.")


EMBEDDING_WEIGHT = "model.embed_tokens.weight"  # the input embedding, in every registry family's checkpoint


def layer_prefix(index: int, layout: Layout = Layout()) -> str:
    """The prefix of every parameter and module name of decoder layer `index` (``model.layers.<i>.``)."""
    return f"{layout.layers}.{index}."


def layer_of(name: str, layout: Layout = Layout()) -> int | None:
    """The decoder layer a parameter or module name belongs to (`layer_prefix`), else None."""
    head, _, tail = name.partition(layout.layers + ".")
    index = tail.split(".", 1)[0]
    return int(index) if not head and index.isdigit() and "." in tail else None


# Where multimodal checkpoints keep their language decoder (Gemma 3 / Qwen3.5: model.language_model; Llama 4:
# language_model.model), read as a decoder-only checkpoint's `model.`.
_LANGUAGE_MODEL_PREFIXES = ("model.language_model.", "language_model.model.")


def checkpoint_layer(name: str, layout: Layout = Layout()) -> int | None:
    """The decoder layer a checkpoint tensor belongs to, in a decoder-only checkpoint (stored from the causal LM, or
    from its base model: GPT-2's ``h.0.`` for ``transformer.h.0.``) or a multimodal one's language decoder; else
    None."""
    if layout.is_default:
        for prefix in _LANGUAGE_MODEL_PREFIXES:
            if name.startswith(prefix):
                return layer_of("model." + name[len(prefix):])
    found = layer_of(name, layout)
    base = layout.layers.partition(".")[0] + "."
    return found if found is not None else layer_of(base + name, layout)


def checked_shapes(config: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Checkpoint tensors whose shapes a config states (name -> the config field of each axis), to check a folder
    before a model is built; the first MLP output projection only where the family has a plain one."""
    shapes = {EMBEDDING_WEIGHT: ("vocab_size", "hidden_size")}
    model_type = config.get("model_type")
    entry = ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None  # (a damaged config: checked later)
    plain = [w for w in entry.mlp.writers if "@" not in w and "." not in w] if entry else []
    if plain:
        shapes[f"{layer_prefix(0)}{entry.mlp.modules[0]}.{plain[0]}.weight"] = ("hidden_size", "intermediate_size")
    return shapes


StreamWeight = tuple[nn.Module, str, int]  # (owner module, parameter name, the axis of the stream's width)


def stream_weights(module: nn.Module, names: Iterable[str], writes: bool) -> list[StreamWeight]:
    """The weights of a sub-block `module` that read (`writes` False) or write the stream, as `SubBlock` names
    them: a Linear reads along its weight's last axis and writes along its first (and its bias)."""
    found = []
    for name in names:
        path, _, axis = name.partition("@")
        owner_path, _, parameter = path.rpartition(".")
        try:
            target = module.get_submodule(path)
        except AttributeError:
            target = None
        if isinstance(target, nn.Linear):
            found.append((target, "weight", -2 if writes else -1))
            if writes and target.bias is not None:
                found.append((target, "bias", -1))
            continue
        try:
            owner = module.get_submodule(owner_path) if owner_path else module
        except AttributeError:
            continue  # not in this layer (a dense layer of a sparse family)
        if isinstance(getattr(owner, parameter, None), nn.Parameter):
            found.append((owner, parameter, int(axis or -1)))
    return found


def check_declared(module: nn.Module, declared: Iterable[StreamWeight], width: int) -> None:
    """Refuse a fold into a sub-block that holds a weight of the stream's width that the registry does not name:
    folding would leave it reading or writing the old basis."""
    covered = {(id(owner), name) for owner, name, _ in declared}
    for owner_name, owner in module.named_modules():
        for name, parameter in owner.named_parameters(recurse=False):
            if (id(owner), name) not in covered and width in parameter.shape and parameter.ndim > 1:
                raise GhostedError(f"{type(module).__name__} holds {owner_name + '.' if owner_name else ''}{name} "
                                   f"{tuple(parameter.shape)}, of the stream's width, which the architecture registry "
                                   "does not declare as a reader or writer: a stock fold would be wrong. Use operator "
                                   "'ghost' or 'normed', or declare it in ghosted_hf.architectures.")
