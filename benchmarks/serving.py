"""The stock exports served by llama.cpp: converted with llama.cpp's own converter, quantized with its
llama-quantize, scored with its llama-perplexity on the same held-out text as transformers, and timed with
llama-bench, for the dense packaged SmolLM2-135M-Instruct and its plainly pruned, `replaceme-ls`,
`folded-tied` and `folded` exports (default ghost-aware selection; one shared set of calibration statistics
per depth, cached under benchmark-cache/).

Perplexity is computed the way llama-perplexity computes it, on both sides: the token stream cut into
chunks of --ctx tokens, the first token of a chunk replaced by BOS where the vocabulary asks for one, and
the second half of each chunk scored. "vs transformers" is llama.cpp's perplexity over transformers' (fp32)
on the same chunks.

    # llama.cpp from the llama-cpp-python sdist (vendor/llama.cpp), CPU build, about 20 minutes on 2 cores:
    #   cmake -B build -DLLAMA_CURL=OFF && cmake --build build -j2 --target llama-perplexity llama-quantize llama-bench
    pip install sentencepiece   # llama.cpp's converter imports it even for a tokenizer.json-only folder
    python benchmarks/serving.py --llama-cpp PATH/TO/llama.cpp --layers 8 4 > benchmarks/results/serving.md
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from ghosted_hf import assets, ghost_prune, save_with_card
from ghosted_hf.data import tokenize_texts
from ghosted_hf.operators import OPERATOR_KINDS
from ghosted_hf.options import PruneOptions
from ghosted_hf.recipe import boundary_spans
from ghosted_hf.statistics import StatisticsPlan, collect_statistics

from common import packaged_model
from healing import cached_statistics

KINDS = [("plainly pruned", "none"), ("replaceme-ls", "replaceme-ls"), ("folded-tied", "folded-tied"),
         ("folded", "folded")]


def run(command: list[str], **kwargs) -> str:
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, command))} failed:\n{done.stderr[-3000:]}")
    return done.stdout + done.stderr


def add_bos(gguf_path: Path) -> tuple[bool, int | None]:
    """Whether llama.cpp puts BOS before a chunk (the vocabulary's flag), and the BOS id."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields

    def value(name: str):
        field = fields.get(name)
        return None if field is None else field.parts[field.data[0]][0]

    return bool(value("tokenizer.ggml.add_bos_token")), value("tokenizer.ggml.bos_token_id")


def transformers_perplexity(model: torch.nn.Module, tokens: list[int], ctx: int, chunks: int,
                            bos: int | None) -> float:
    """llama-perplexity's perplexity computed with transformers (fp32) on the same token ids."""
    nll, count, first = 0.0, 0, ctx // 2
    with torch.no_grad():
        for i in range(chunks):
            ids = list(tokens[i * ctx:(i + 1) * ctx])
            if bos is not None:
                ids[0] = bos
            logits = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
            targets = torch.tensor(ids[first + 1:])
            nll -= float(logits[first:ctx - 1].gather(1, targets[:, None]).sum())
            count += len(targets)
    return math.exp(nll / count)


def llama_perplexity(binary: Path, gguf_path: Path, text: Path, ctx: int, chunks: int, threads: int) -> float:
    out = run([binary, "-m", gguf_path, "-f", text, "-c", ctx, "--chunks", chunks, "-t", threads, "-b", ctx])
    return float(re.search(r"Final estimate: PPL = ([0-9.]+)", out).group(1))


def llama_speed(binary: Path, gguf_path: Path, threads: int) -> tuple[float, float]:
    """(prefill tokens/s for 512 tokens, decode tokens/s for 128) from llama-bench."""
    rows = json.loads(run([binary, "-m", gguf_path, "-p", 512, "-n", 128, "-t", threads, "-r", 3, "-o", "json"]))
    speed = {("prefill" if r["n_prompt"] else "decode"): r["avg_ts"] for r in rows}
    return speed["prefill"], speed["decode"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp folder (converter + build/bin).")
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 4])
    parser.add_argument("--quants", nargs="+", default=["F16", "Q8_0", "Q4_K_M"])
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("benchmark-cache/serving"))
    parser.add_argument("--statistics", type=Path, default=Path("benchmark-cache"))
    args = parser.parse_args()
    bin_dir = args.llama_cpp / "build" / "bin"
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    tokenizer, load = packaged_model()
    calibration = assets.wikipedia_split("calibration")
    text = args.work / "held-out.txt"
    text.write_text("\n\n".join(assets.wikipedia_split("evaluation")))
    tokens = tokenizer(text.read_text(), add_special_tokens=False)["input_ids"]
    folders = {("dense", 0): assets.default_model_dir()}
    for n in args.layers:
        prune = PruneOptions(num_layers=n)
        stats = cached_statistics(args.statistics / f"stats-{n}.safetensors", load, tokenizer, calibration, prune)
        removed = ghost_prune(load(), statistics=stats, num_layers=n, operator="none").config.ghost_provenance[
            "selection"]["removed"]
        # One more pass for what the folding kinds read beyond the selection's statistics (shared by all).
        plan = StatisticsPlan.union(OPERATOR_KINDS[kind].statistics(s, e) for _, kind in KINDS
                                    for s, e in boundary_spans(30, removed)).missing_from(stats.tensors)
        if plan:
            batches = tokenize_texts(tokenizer, calibration, prune.seq_len, prune.num_sequences, prune.batch_size)
            stats = stats.with_tensors(collect_statistics(load(), batches.batches, plan))
        for name, kind in KINDS:
            folder = args.work / f"{n}-{kind}"
            if not (folder / "config.json").is_file():
                save_with_card(ghost_prune(load(), tokenizer, calibration, prune, statistics=stats, operator=kind),
                               folder, tokenizer)
            folders[(name, n)] = folder

    print(f"SmolLM2-135M-Instruct exports in llama.cpp (CPU, {args.threads} threads); perplexity on {args.chunks} "
          f"chunks of {args.ctx} held-out tokens (second halves scored, as llama-perplexity does).\n")
    print("| model | removed | precision | GGUF MB | llama.cpp perplexity | vs transformers | prefill t/s | "
          "decode t/s |")
    print("|---|---|---|---|---|---|---|---|")
    for (name, n), folder in folders.items():
        f16 = args.work / f"{name}-{n}-F16.gguf".replace(" ", "_")
        if not f16.is_file():
            run([sys.executable, args.llama_cpp / "convert_hf_to_gguf.py", folder, "--outfile", f16, "--outtype", "f16"])
        wants_bos, bos = add_bos(f16)
        from transformers import AutoModelForCausalLM

        reference = transformers_perplexity(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(),
                                            tokens, args.ctx, args.chunks, bos if wants_bos else None)
        for quant in args.quants:
            path = f16 if quant == "F16" else f16.with_name(f16.name.replace("F16", quant))
            if not path.is_file():
                run([bin_dir / "llama-quantize", f16, path, quant])
            ppl = llama_perplexity(bin_dir / "llama-perplexity", path, text, args.ctx, args.chunks, args.threads)
            prefill, decode = llama_speed(bin_dir / "llama-bench", path, args.threads)
            print(f"| {name} | {f'{n}/30' if n else '-'} | {quant} | {path.stat().st_size / 1e6:.1f} | {ppl:.3f} | "
                  f"{ppl / reference:.4f} (transformers {reference:.3f}) | {prefill:.0f} | {decode:.1f} |", flush=True)
    print(f"\nTotal {time.perf_counter() - started:.0f} s.")


if __name__ == "__main__":
    main()
