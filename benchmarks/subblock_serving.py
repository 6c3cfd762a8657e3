"""A sub-block model in both engines (issue #34): SmolLM2-135M-Instruct with attention and MLP sub-blocks replaced at a
parameter budget, saved, reloaded, exported with `ghosted export-gguf` (DeciLM linear-attention layers) and run by
llama.cpp beside transformers: perplexity at F16 on the same chunks, KV-cache bytes per token, file size, prefill
and decode tokens/s, for the dense model and each budget (and, with `--layers`, whole layers removed with the `normed`
operator beside them, as at equal KV cache).

    # llama.cpp built as benchmarks/serving.py says (targets llama-perplexity and llama-bench)
    pip install sentencepiece
    python benchmarks/subblock_serving.py --llama-cpp PATH/TO/llama.cpp --remove 12.5% 25% \
        > benchmarks/results/subblock_serving.md

Each budget's model: `ghost_prune(unit="subblock", remove=b)` on 32 windows of 512 calibration tokens (as
benchmarks/subblocks.py). Perplexity is llama-perplexity's (chunks of --ctx tokens, BOS first where the vocabulary asks, second halves
scored) on the held-out Wikipedia articles; transformers' the same way on the same token ids (fp32). KV bytes per
token: llama.cpp's own count (its KV buffer over the context it was sized for, F16) and transformers' (the elements
a dynamic cache holds after a forward, at 2 bytes). Speeds: llama-bench (512-token prefill, 128-token decode, 3
repetitions) and transformers (the same lengths, batch 1, fp32, greedy, the best of 3), on --threads threads.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path

import torch
from common import packaged_model, transformers_speed
from serving import add_bos, llama_perplexity, llama_speed, run, transformers_perplexity
from transformers import AutoModelForCausalLM

from ghosted_hf import assets, ghost_prune, save_with_card
from ghosted_hf.model.loading import NO_HUB_KERNELS


def transformers_kv_bytes(model, prompt: list[int]) -> float:
    with torch.no_grad():
        cache = model(torch.tensor([prompt]), use_cache=True).past_key_values
    held = sum(t.numel() for layer in cache.layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
               if t is not None)
    return held * 2 / len(prompt)


def llama_kv_bytes(binary: Path, gguf_path: Path, text: Path, ctx: int, threads: int) -> float:
    """llama.cpp's KV buffer (F16 keys and values) over the context it holds, per token."""
    out = run([binary, "-m", gguf_path, "-f", text, "-c", ctx, "--chunks", 1, "-t", threads, "-b", ctx, "-lv", 4])
    return float(re.search(r"llama_kv_cache: size =\s*([0-9.]+) MiB", out).group(1)) * 2**20 / ctx


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True)
    parser.add_argument("--remove", nargs="*", default=["12.5%", "25%"])
    parser.add_argument("--subblocks", nargs="*", default=[], help="comma-separated sub-block lists to replace instead "
                        "of choosing them again (e.g. what benchmarks/subblocks.py chose for a budget)")
    parser.add_argument("--layers", nargs="*", default=[], help="comma-separated whole-layer lists to remove with the "
                        "normed operator, which llama.cpp runs (e.g. whole layers at the KV cache of a sub-block list)")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("benchmark-cache/subblock-serving"))
    args = parser.parse_args()
    bin_dir = args.llama_cpp / "build" / "bin"
    args.work.mkdir(parents=True, exist_ok=True)
    tokenizer, load = packaged_model()
    text = args.work / "held-out.txt"
    text.write_text("\n\n".join(assets.wikipedia_split("evaluation")))
    tokens = tokenizer(text.read_text(), add_special_tokens=False)["input_ids"]
    prompt = tokens[:512]
    folders = {"dense": assets.default_model_dir()}
    calibration = assets.wikipedia_split("calibration")
    for budget in args.remove:
        folder = args.work / f"subblocks-{budget.replace('%', 'pct')}"
        if not (folder / "config.json").is_file():
            save_with_card(ghost_prune(load(), tokenizer, calibration, unit="subblock", remove=budget,
                                       num_sequences=32), folder, tokenizer)
        folders[f"sub-blocks, {budget}"] = folder
    for names in args.subblocks:
        chosen = names.split(",")
        folder = args.work / f"subblocks-{hashlib.sha256(names.encode()).hexdigest()[:8]}"
        if not (folder / "config.json").is_file():
            save_with_card(ghost_prune(load(), tokenizer, calibration, unit="subblock", criterion="manual",
                                       subblocks=chosen, num_sequences=32), folder, tokenizer)
        folders[f"sub-blocks, {len(chosen)} given"] = folder
    for names in args.layers:
        chosen = [int(i) for i in names.split(",")]
        folder = args.work / f"layers-normed-{hashlib.sha256(names.encode()).hexdigest()[:8]}"
        if not (folder / "config.json").is_file():
            save_with_card(ghost_prune(load(), tokenizer, calibration, criterion="manual", layers=chosen,
                                       operator="normed", num_sequences=32), folder, tokenizer)
        folders[f"layers, {len(chosen)} given"] = folder
    print(f"SmolLM2-135M-Instruct in transformers (fp32) and llama.cpp (F16), {args.threads} threads; perplexity on "
          f"{args.chunks} chunks of {args.ctx} held-out tokens.\n")
    print("| model | replaced | llama.cpp ppl | transformers ppl | ratio | GGUF MB | KV B/token llama.cpp | KV B/token "
          "transformers (bf16) | prefill t/s llama.cpp / transformers | decode t/s llama.cpp / transformers |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, folder in folders.items():
        gguf_path = args.work / f"{Path(folder).name}-F16.gguf"
        if not gguf_path.is_file():
            if name == "dense":
                run([sys.executable, args.llama_cpp / "convert_hf_to_gguf.py", folder, "--outfile", gguf_path,
                     "--outtype", "f16"])
            else:
                run([sys.executable, "-m", "ghosted_hf.cli", "export-gguf", folder, gguf_path, "--llama-cpp",
                     args.llama_cpp, "--outtype", "f16"])
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=name != "dense",
                                                     **NO_HUB_KERNELS).eval()
        wants_bos, bos = add_bos(gguf_path)
        reference = transformers_perplexity(model, tokens, args.ctx, args.chunks, bos if wants_bos else None)
        served = llama_perplexity(bin_dir / "llama-perplexity", gguf_path, text, args.ctx, args.chunks, args.threads,
                                  True)
        kv_llama = llama_kv_bytes(bin_dir / "llama-perplexity", gguf_path, text, args.ctx, args.threads)
        prefill, decode = llama_speed(bin_dir / "llama-bench", gguf_path, args.threads, True)
        hf_prefill, hf_decode = transformers_speed(model, prompt, 128)
        replaced = ", ".join(f"{r['original_layer']}{r['block'][0]}" for r in getattr(model.config, "ghost_subblocks", []))
        replaced = replaced or ", ".join(map(str, getattr(model.config, "removed_layers", [])))
        print(f"| {name} | {replaced or '-'} | {served:.3f} | {reference:.3f} | {served / reference:.4f} | "
              f"{gguf_path.stat().st_size / 1e6:.1f} | {kv_llama:.0f} | {transformers_kv_bytes(model, prompt):.0f} | "
              f"{prefill:.0f} / {hf_prefill:.0f} | {decode:.1f} / {hf_decode:.1f} |", flush=True)


if __name__ == "__main__":
    main()
