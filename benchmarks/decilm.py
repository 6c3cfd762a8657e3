"""A ghosted model served by mlx-lm from a Nemotron-NAS (DeciLM) export (issue #52): SmolLM2-135M-Instruct with 8/30
layers removed (`normed`) and with sub-blocks replaced at 25% of the decoder's parameters, exported with `ghosted
export-decilm --tensor-names mlx-lm` and run by mlx-lm on the CPU beside transformers: perplexity on the same
held-out windows, greedy tokens, KV-cache bytes per token; and whether llama.cpp's unmodified converter takes the
`nemotron` export; then (--llama-cpp) the converter's GGUF run by llama.cpp, on a model whose vocabulary it takes.

    pip install -e .[test]      # mlx-lm and mlx-cpu (Linux x86-64)
    # llama.cpp and llama-cpp-python built as benchmarks/serving.py says (llama-perplexity, llama-quantize)
    python benchmarks/decilm.py [--llama-cpp PATH/TO/llama.cpp] > benchmarks/results/decilm.md

Both engines in float32 on the packaged model's fp32 weights; perplexity over --windows non-overlapping 512-token
windows of the held-out Wikipedia articles (mlx-lm takes no attention mask: whole windows only); greedy: 32 new tokens
after the first 32 tokens of the first window. The sub-blocks are the ones the ghost-aware criterion chose at 25%
(benchmarks/results/subblocks.md), replaced here without choosing them again.

llama.cpp's DeciLM converter takes Llama 3's vocabulary or Llama 2's byte-fallback BPE, and no packaged model has
either: its run is measured on a small Llama (8 layers of 128, FFN 512) trained here for --train-steps steps on the
calibration articles with a Llama-2-style byte-fallback tokenizer (one token a character), pruned the same two ways
(2/8 layers `normed`; sub-blocks at 25%), exported, converted by the unmodified converter at F16, quantized to Q8_0
by llama-quantize, and scored by llama-perplexity beside transformers on the same token ids (--ctx-token chunks of
the held-out articles, second halves scored, BOS first as llama-perplexity puts it); greedy: 32 tokens after each of 5
prompts through llama-cpp-python, the share of the 160 that come before the first difference.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from common import held_out_windows, packaged_model
from serving import add_bos, binding_agreement, llama_perplexity, run, transformers_perplexity
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from ghosted_hf import assets, ghost_prune
from ghosted_hf.pipelines.decilm import export_decilm

SUBBLOCKS_25 = ("5.attention, 6.attention, 7.attention, 8.attention, 12.attention, 12.mlp, 13.mlp, 14.attention, "
                "14.mlp, 15.attention, 15.mlp, 16.mlp, 17.attention, 17.mlp, 18.mlp, 19.mlp, 20.attention, "
                "21.attention, 24.attention, 26.attention, 27.attention, 28.attention, 29.attention").split(", ")


def transformers_figures(model, windows: list[torch.Tensor], prompt: torch.Tensor) -> tuple[float, list[int]]:
    nll = count = 0
    with torch.no_grad():
        for ids in windows:
            logits = model(ids[None]).logits[0].log_softmax(-1)
            nll -= float(logits[:-1].gather(1, ids[1:, None]).sum())
            count += len(ids) - 1
        tokens = model.generate(input_ids=prompt[None], max_new_tokens=32, do_sample=False)[0, len(prompt):]
    return math.exp(nll / count), tokens.tolist()


def mlx_figures(folder: Path, windows: list[torch.Tensor], prompt: torch.Tensor) -> tuple[float, list[int], float]:
    """(perplexity, greedy tokens, KV-cache bytes per token) in mlx-lm."""
    import mlx.core as mx
    from mlx_lm import load

    model, _ = load(str(folder), tokenizer_config={"trust_remote_code": True})
    nll = count = 0
    for ids in windows:
        logits = np.array(model(mx.array(ids.numpy()[None])).astype(mx.float32))[0]
        logits = torch.from_numpy(logits).log_softmax(-1)
        nll -= float(logits[:-1].gather(1, ids[1:, None]).sum())
        count += len(ids) - 1
    cache = model.make_cache()
    logits = model(mx.array(prompt.numpy()[None]), cache=cache)
    # (each layer's buffer grows 256 tokens at a time: its bytes over the tokens it has room for)
    kv = sum(c.nbytes / c.keys.shape[2] for c in cache if c.keys is not None)
    tokens = []
    for _ in range(32):
        token = int(mx.argmax(logits[0, -1]).item())
        tokens.append(token)
        logits = model(mx.array([[token]]), cache=cache)
    return math.exp(nll / count), tokens, kv


def converter_verdict(llama_cpp: Path | None, folder: Path) -> str:
    if llama_cpp is None:
        return "not run (no --llama-cpp)"
    done = subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(folder), "--outfile",
                           str(folder / "model.gguf"), "--outtype", "f32"], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")})
    return "converted" if done.returncode == 0 else "refused: " + done.stderr.strip().splitlines()[-1][:160]


def trained_llama(tokenizer, texts: list[str], steps: int) -> LlamaForCausalLM:
    """A small Llama trained on `texts`: a real (if small) language model on a vocabulary llama.cpp's DeciLM
    converter takes."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
    ids = torch.tensor(tokenizer("\n\n".join(texts), add_special_tokens=False)["input_ids"])
    windows = ids[:len(ids) // 256 * 256].view(-1, 256)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    for _ in tqdm(range(steps), desc="training the small Llama"):
        rows = windows[torch.randint(len(windows), (16,))]
        model(rows, labels=rows).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step(), schedule.step(), optimizer.zero_grad()
    return model.eval()


def llama_cpp_table(llama_cpp: Path, work: Path, steps: int, ctx: int, chunks: int) -> None:
    """The unmodified converter's GGUF of each export run by llama.cpp at F16 and Q8_0 against transformers."""
    from llama_cpp import Llama

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from tiny import llama2_tokenizer

    tokenizer, bin_dir = llama2_tokenizer(), llama_cpp / "build" / "bin"
    calibration = assets.wikipedia_split("calibration")
    text = work / "held-out.txt"
    text.parent.mkdir(parents=True, exist_ok=True)
    text.write_text("\n\n".join(assets.wikipedia_split("evaluation")))
    tokens = tokenizer(text.read_text(), add_special_tokens=False)["input_ids"]
    trained = work / f"trained-{steps}"  # (kept: a rerun scores the same model)
    if not (trained / "config.json").is_file():
        trained_llama(tokenizer, calibration, steps).save_pretrained(trained)
    dense = LlamaForCausalLM.from_pretrained(trained, dtype=torch.float32).eval()
    print(f"\nllama.cpp on the converter's GGUF: a small Llama trained here ({steps} steps), perplexity on {chunks} "
          f"chunks of {ctx} held-out tokens, transformers fp32 on the same ids.\n")
    print("| model | precision | llama.cpp ppl | transformers ppl | gap | greedy tokens equal (share) | token ids "
          "equal |\n"
          "|---|---|---|---|---|---|---|")
    models = {"dense": None, "2/8 layers, normed": dict(operator="normed", num_layers=2),
              "sub-blocks at 25%": dict(unit="subblock", remove="25%")}
    for name, options in models.items():
        model = dense if options is None else ghost_prune(copy.deepcopy(dense), tokenizer, calibration, seq_len=256,
                                                          num_sequences=64, **options)
        folder = work / name.split()[0].replace("/", "-")
        if options is None:  # (the dense model as the Llama it is)
            model.save_pretrained(folder), tokenizer.save_pretrained(folder)
        else:
            export_decilm(model, tokenizer, folder)
        f16 = folder / "model-F16.gguf"
        run([sys.executable, llama_cpp / "convert_hf_to_gguf.py", folder, "--outfile", f16, "--outtype", "f16"],
            env={**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")})
        run([bin_dir / "llama-quantize", f16, folder / "model-Q8_0.gguf", "Q8_0"])
        wants_bos, bos = add_bos(f16)
        reference = transformers_perplexity(model, tokens, ctx, chunks, bos if wants_bos else None)
        theirs = Llama(model_path=str(f16), vocab_only=True, verbose=False).tokenize(text.read_bytes(), add_bos=False)
        for quant in ("F16", "Q8_0"):
            path = folder / f"model-{quant}.gguf"
            ppl = llama_perplexity(bin_dir / "llama-perplexity", path, text, ctx, chunks, threads=2, repack=True)
            greedy = binding_agreement(model, path, tokenizer, tokens, ctx, threads=2)["greedy_prefix"]
            print(f"| {name} | {quant} | {ppl:.4f} | {reference:.4f} | {100 * (ppl / reference - 1):+.3f}% | "
                  f"{greedy:.3f} | {theirs == tokens} |", flush=True)


def smollm2_table(windows: int, work: Path, llama_cpp: Path | None) -> None:
    tokenizer, load = packaged_model()
    windows = [row for batch in held_out_windows(tokenizer, windows).batches for row in batch["input_ids"]]
    prompt = windows[0][:32]
    calibration = assets.wikipedia_split("calibration")
    print("| model | transformers ppl | mlx-lm ppl | gap | greedy tokens equal | mlx KV bytes/token | llama.cpp "
          "converter (`nemotron` names) |\n|---|---|---|---|---|---|---|")
    models = {"8/30 layers, normed": dict(operator="normed", num_layers=8),
              "sub-blocks at 25%": dict(unit="subblock", criterion="manual", subblocks=SUBBLOCKS_25)}
    for name, options in models.items():
        ghosted = ghost_prune(load(), tokenizer, calibration, **options)
        ppl, tokens = transformers_figures(ghosted, windows, prompt)
        folder = work / name.split()[0].replace("/", "-")
        export_decilm(ghosted, tokenizer, folder / "mlx", tensor_names="mlx-lm")
        export_decilm(ghosted, tokenizer, folder / "nemotron")
        mlx_ppl, mlx_tokens, kv = mlx_figures(folder / "mlx", windows, prompt)
        print(f"| {name} | {ppl:.3f} | {mlx_ppl:.3f} | {100 * (mlx_ppl / ppl - 1):+.3f}% | "
              f"{tokens == mlx_tokens} | {kv:.0f} | {converter_verdict(llama_cpp, folder / 'nemotron')} |",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--llama-cpp", type=Path, default=None)
    parser.add_argument("--work", type=Path, default=Path("benchmark-cache/decilm"))
    parser.add_argument("--train-steps", type=int, default=600)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--skip-smollm2", action="store_true", help="Only the llama.cpp run (--llama-cpp).")
    args = parser.parse_args()
    if not args.skip_smollm2:
        smollm2_table(args.windows, args.work, args.llama_cpp)
    if args.llama_cpp is not None:
        llama_cpp_table(args.llama_cpp, args.work / "small-llama", args.train_steps, args.ctx, args.chunks)


if __name__ == "__main__":
    main()
