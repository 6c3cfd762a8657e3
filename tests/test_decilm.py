"""export-decilm: a ghosted model as a Nemotron-NAS (DeciLM) checkpoint, loaded without ghosted_hf by transformers
(the code saved beside it) and by mlx-lm, converted by llama.cpp's unmodified converter, and run by llama.cpp where
llama-cpp-python imports on a build (`llama_cpp_build` marker: `LLAMA_CPP_LIB_PATH=.../build/bin
GHOSTED_LLAMA_CPP=... pytest tests/test_decilm.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from isolated import run_without_ghosted
from safetensors.torch import load_file, save_file
from tiny import HIDDEN, VOCAB, batch, char_tokenizer, llama2_tokenizer, requires, texts, tiny_family

from ghosted_hf import GhostedError, ghost_prune, prune_layers
from ghosted_hf.pipelines.decilm import ZERO_FFN_WIDTH, export_decilm

FFN = 512  # (DeciLM's FFN widths are multiples of 256)


def _ghosted(kind: str, tokenizer=None):
    """A tiny Llama pruned three ways: two layers with a normed boundary, three sub-blocks replaced (one attention,
    two MLPs, rank-4 maps), two layers plainly removed (a stock checkpoint)."""
    tokenizer = tokenizer or char_tokenizer()
    dense = tiny_family("llama", intermediate_size=FFN, vocab_size=max(VOCAB, len(tokenizer)))
    common = dict(seq_len=48, num_sequences=24)
    if kind == "normed":
        return ghost_prune(dense, tokenizer, texts(), operator="normed", criterion="manual", layers=[2, 3], **common)
    if kind == "subblocks":
        return ghost_prune(dense, tokenizer, texts(), unit="subblock", criterion="manual", map_rank="4",
                           subblocks=["0.attention", "2.mlp", "5.mlp"], **common)
    return ghost_prune(dense, tokenizer, texts(), operator="none", criterion="manual", layers=[1, 4], **common)


def test_decilm_exports_load_without_ghosted_hf_with_the_ghosted_model_s_logits(tmp_path: Path) -> None:
    """Removed layers are no-op blocks, a normed boundary and each replaced sub-block a linear attention (an MLP map
    as a block after its layer, over a zero FFN of width 256); in a fresh process without ghosted_hf, transformers
    loads each folder with the code saved beside it, gives the ghosted model's logits and the same tokens with the
    KV cache as without; the plain removal's config reads as vLLM's DeciLM reads blocks (by attribute); a folder
    whose tensors do not match its block_configs is refused."""
    expected = {}
    for kind in ("normed", "subblocks", "plain"):
        ghosted = _ghosted(kind)
        export_decilm(ghosted, char_tokenizer(), tmp_path / kind)
        with torch.no_grad():
            expected[kind] = ghosted(**batch()).logits
        save_file({"expected": expected[kind], **batch()}, tmp_path / f"{kind}.safetensors")
    blocks = {kind: json.loads((tmp_path / kind / "config.json").read_text())["block_configs"] for kind in expected}
    linear = {kind: [j for j, b in enumerate(bs) if b["attention"]["replace_with_linear"]] for kind, bs in blocks.items()}
    no_op = {kind: [j for j, b in enumerate(bs) if b["attention"]["no_op"]] for kind, bs in blocks.items()}
    # dense layers 2, 3 no-op, the boundary's block after them; layer 0's attention a map, layers 2's and 5's MLPs
    # maps as blocks after them; dense layers 1, 4 no-op
    assert (linear, no_op) == ({"normed": [4], "subblocks": [0, 3, 7], "plain": []},
                               {"normed": [2, 3], "subblocks": [], "plain": [1, 4]})
    assert blocks["subblocks"][2]["ffn"]["ffn_mult"] == round(1.5 * ZERO_FFN_WIDTH / HIDDEN, 6)  # (its MLP: a map)
    printed = run_without_ghosted(
        f"""
        import torch
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM
        for kind in ("normed", "subblocks", "plain"):
            model = AutoModelForCausalLM.from_pretrained(f"{tmp_path}/{{kind}}", trust_remote_code=True)
            io = load_file(f"{tmp_path}/{{kind}}.safetensors")
            expected = io.pop("expected")
            with torch.no_grad():
                torch.testing.assert_close(model(**io).logits, expected, rtol=0, atol=1e-5)
            prompt = io["input_ids"][:1, :5]
            cached = model.generate(input_ids=prompt, max_new_tokens=4, do_sample=False)
            assert torch.equal(cached, model.generate(input_ids=prompt, max_new_tokens=4, do_sample=False,
                                                      use_cache=False)), kind
            print("LOADED", kind, type(model).__module__, type(model).__name__)
        blocks = AutoModelForCausalLM.from_pretrained(f"{tmp_path}/plain", trust_remote_code=True).config.block_configs
        print("NO-OP", [j for j, block in enumerate(blocks) if block.attention.no_op and block.ffn.no_op])
        """,
        tmp_path,
    )
    assert printed.count("modeling_decilm DeciLMForCausalLM") == 3
    assert "NO-OP [1, 4]" in printed  # (read by attribute, as vLLM's DeciLM reads a config's blocks)
    weights = load_file(tmp_path / "subblocks" / "model.safetensors")
    weights.pop("model.layers.3.self_attn.linear_attn.weight")
    save_file(weights, tmp_path / "subblocks" / "model.safetensors")
    with pytest.raises(AssertionError, match="does not match its config.json's block_configs"):
        run_without_ghosted(f"""
            from transformers import AutoModelForCausalLM
            AutoModelForCausalLM.from_pretrained({str(tmp_path / "subblocks")!r}, trust_remote_code=True)
            """, tmp_path)


def test_what_deci_layers_cannot_hold_is_refused_by_name(tmp_path: Path) -> None:
    """A ghost operator (x @ W, no DeciLM block), an FFN width DeciLM cannot write, a family whose layers are not
    Llama's, and unknown tensor names are each refused before anything is written."""
    ghost = ghost_prune(tiny_family("llama", intermediate_size=FFN), char_tokenizer(), texts(), criterion="manual",
                        layers=[2, 3], seq_len=48, num_sequences=24)
    with pytest.raises(GhostedError, match="'ghost' operator whose x @ W is not the identity"):
        export_decilm(ghost, char_tokenizer(), tmp_path / "ghost")
    narrow = prune_layers(tiny_family("llama"), [2, 3], None)
    with pytest.raises(GhostedError, match=r"FFN width 64 \(DeciLM: a multiple of 256\)"):
        export_decilm(narrow, char_tokenizer(), tmp_path / "narrow")
    qwen = prune_layers(tiny_family("qwen2"), [2, 3], None)
    with pytest.raises(GhostedError, match="a pruned qwen2 model's are not"):
        export_decilm(qwen, char_tokenizer(), tmp_path / "qwen")
    with pytest.raises(GhostedError, match="tensor_names must be one of"):
        export_decilm(narrow, char_tokenizer(), tmp_path / "names", tensor_names="vllm")
    assert not any(tmp_path.iterdir())


@requires("mlx_lm")
def test_mlx_lm_loads_a_decilm_export_with_the_ghosted_model_s_logits_and_no_cache_for_linear_layers(
        tmp_path: Path) -> None:
    """mlx-lm (CPU) loads the export written with its tensor names (`--tensor-names mlx-lm`) as its nemotron-nas
    model: the ghosted model's logits, and no KV-cache bytes in the linear-attention layers after a prompt."""
    ghosted = _ghosted("subblocks")
    export_decilm(ghosted, char_tokenizer(), tmp_path / "mlx", tensor_names="mlx-lm")
    full = batch()["attention_mask"].all(dim=1)  # (mlx-lm takes no attention mask: the unpadded rows)
    ids = batch()["input_ids"][full]
    with torch.no_grad():
        expected = ghosted(input_ids=ids).logits
    np.save(tmp_path / "ids.npy", ids.numpy())
    code = f"""
        import numpy as np, mlx.core as mx
        from mlx_lm import load
        model, _ = load({str(tmp_path / "mlx")!r}, tokenizer_config={{"trust_remote_code": True}})
        np.save({str(tmp_path / "got.npy")!r}, np.array(model(mx.array(np.load({str(tmp_path / "ids.npy")!r})))))
        cache = model.make_cache()
        model(mx.array(np.load({str(tmp_path / "ids.npy")!r})[:1]), cache=cache)
        print("CACHED", [c.nbytes if c.keys is not None else 0 for c in cache])
        """
    done = subprocess.run([sys.executable, "-c", "import textwrap; exec(textwrap.dedent(" + repr(code) + "))"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    np.testing.assert_allclose(np.load(tmp_path / "got.npy"), expected.numpy(), rtol=0, atol=1e-4)
    cached = json.loads(done.stdout.split("CACHED", 1)[1].strip())
    assert [j for j, n in enumerate(cached) if n == 0] == [0, 3, 7]  # the linear attentions (layer 0, two MLP maps)
    assert all(n > 0 for j, n in enumerate(cached) if j not in (0, 3, 7))


LLAMA_CPP = os.environ.get("GHOSTED_LLAMA_CPP")


@pytest.mark.skipif(not LLAMA_CPP, reason="set GHOSTED_LLAMA_CPP to a llama.cpp source folder (.ci/run unpacks one "
                                          "from the llama-cpp-python sdist)")
def test_llama_cpp_s_unmodified_converter_reads_a_decilm_export(tmp_path: Path) -> None:
    """llama.cpp's convert_hf_to_gguf.py writes the export as its `deci` architecture: no KV heads in the linear
    attentions, FFN widths as the blocks say, each map the linear attention's output weight."""
    import gguf

    tokenizer = llama2_tokenizer()
    ghosted = _ghosted("subblocks", tokenizer)
    export_decilm(ghosted, tokenizer, tmp_path / "deci")
    done = subprocess.run([sys.executable, str(Path(LLAMA_CPP) / "convert_hf_to_gguf.py"), str(tmp_path / "deci"),
                           "--outfile", str(tmp_path / "deci.gguf"), "--outtype", "f32"], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(Path(LLAMA_CPP) / "gguf-py")})
    assert done.returncode == 0, done.stderr[-2000:]
    reader = gguf.GGUFReader(str(tmp_path / "deci.gguf"))
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    assert field("general.architecture") == "deci" and field("deci.block_count") == 8
    assert field("deci.attention.head_count_kv") == [0, 2, 2, 0, 2, 2, 2, 0]
    assert field("deci.feed_forward_length") == [FFN, FFN, ZERO_FFN_WIDTH, ZERO_FFN_WIDTH, FFN, FFN, ZERO_FFN_WIDTH,
                                                  ZERO_FFN_WIDTH]
    output = next(t for t in reader.tensors if t.name == "blk.3.attn_output.weight")  # layer 2's MLP map, A^T
    down, up = (ghosted.get_parameter(f"model.layers.2.mlp.ghost.{part}").detach() for part in ("down", "up"))
    np.testing.assert_allclose(np.asarray(output.data).reshape(HIDDEN, HIDDEN), (down @ up).T.numpy(), atol=1e-6)


@pytest.mark.llama_cpp_build
@pytest.mark.skipif(not LLAMA_CPP, reason="set GHOSTED_LLAMA_CPP to the llama.cpp source folder of the build")
@pytest.mark.parametrize("kind", ["normed", "subblocks"])
def test_llama_cpp_runs_the_converter_s_gguf_with_the_ghosted_model_s_logits(kind: str, tmp_path: Path) -> None:
    """The unmodified converter's F32 GGUF run by llama.cpp: the ghosted model's logits over a prompt and over tokens
    fed one at a time through its KV cache (the linear attentions hold none)."""
    from llama_cpp import Llama

    tokenizer = llama2_tokenizer()
    ghosted = _ghosted(kind, tokenizer).eval()
    export_decilm(ghosted, tokenizer, tmp_path / "deci")
    done = subprocess.run([sys.executable, str(Path(LLAMA_CPP) / "convert_hf_to_gguf.py"), str(tmp_path / "deci"),
                           "--outfile", str(tmp_path / "deci.gguf"), "--outtype", "f32"], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(Path(LLAMA_CPP) / "gguf-py")})
    assert done.returncode == 0, done.stderr[-2000:]
    ids = [tokenizer.bos_token_id, *tokenizer(texts()[0][:40], add_special_tokens=False)["input_ids"]]
    llm = Llama(model_path=str(tmp_path / "deci.gguf"), n_ctx=128, n_batch=128, logits_all=True, verbose=False,
                type_k=0, type_v=0)  # (an F32 KV cache: its F16 default rounds the keys and values)
    llm.eval(ids[:20])  # a prompt, then one token at a time on its cache
    for token in ids[20:]:
        llm.eval([token])
    with torch.no_grad():
        expected = ghosted(torch.tensor([ids])).logits[0]
    np.testing.assert_allclose(np.asarray(llm.scores[:len(ids)]), expected.numpy(), rtol=0, atol=1e-4)

