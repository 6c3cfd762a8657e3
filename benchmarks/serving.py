"""The exports served by llama.cpp: converted with llama.cpp's own converter (the `normed` ghosted model with
`ghosted export-gguf`, which runs it), quantized with its llama-quantize, scored with its llama-perplexity on
the same held-out text as transformers, and timed with llama-bench, for the dense packaged
SmolLM2-135M-Instruct and its plainly pruned, `replaceme-ls`, `folded-tied`, `folded` and `normed` exports
(the block the default selection removes; one shared set of calibration statistics per depth, cached under
benchmark-cache/). "gap closed" is the share of the log-perplexity gap between the same block plainly pruned and
the dense model that an export closes, both run by llama.cpp at the same precision; "share of ghost gain" is
(log plain - log ppl) / (log plain - log ghost), with the plainly pruned and ghosted models' transformers
perplexity on the same chunks.

With llama-cpp-python on the same build (`--bindings`), each model is also converted at F32 and compared with
transformers on the same token ids: next-token logits over the first chunk (max abs difference, top-1 agreement)
and the first 32 greedy tokens of 5 prompts (F32: the engine's arithmetic, not the weights' rounding to F16).

Perplexity is computed the way llama-perplexity computes it, on both sides: the token stream cut into
chunks of --ctx tokens, the first token of a chunk replaced by BOS where the vocabulary asks for one, and
the second half of each chunk scored. "vs transformers" is llama.cpp's perplexity over transformers' (fp32)
on the same chunks.

    # llama.cpp from the llama-cpp-python sdist (vendor/llama.cpp), CPU build, about 20 minutes on 2 cores:
    #   cmake -B build -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=ON \
    #     && cmake --build build -j2 --target llama-perplexity llama-quantize llama-bench
    # and its Python bindings on that build (nothing compiled again):
    #   CMAKE_ARGS="-DLLAMA_BUILD=OFF" pip install llama-cpp-python==0.3.36
    #   export LLAMA_CPP_LIB_PATH=PATH/TO/llama.cpp/build/bin
    pip install sentencepiece   # llama.cpp's converter imports it even for a tokenizer.json-only folder
    python benchmarks/serving.py --llama-cpp PATH/TO/llama.cpp --layers 8 4 --bindings > benchmarks/results/serving.md
    # the agreement alone, without scoring and timing every precision:
    python benchmarks/serving.py --llama-cpp PATH/TO/llama.cpp --layers 8 4 --bindings --quants
    # the two best llama.cpp exports healed (`heal`'s defaults, 130 steps: what 10 CPU-minutes gave the ghost):
    python benchmarks/serving.py --llama-cpp PATH/TO/llama.cpp --layers 8 --heal-steps 130 --quants F16 Q4_K_M

Where llama.cpp's AMX path crashes (a Q8_0 file on a virtual machine with AMX, here), add --no-repack.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import packaged_model
from healing import cached_statistics

from ghosted_hf import assets, ghost_prune, heal, merge, save_with_card
from ghosted_hf.evaluate import gap_closed
from ghosted_hf.fitting.operators import OPERATOR_KINDS
from ghosted_hf.options import PruneOptions
from ghosted_hf.fitting.units import boundary_spans
from ghosted_hf.statistics import StatisticsPlan, collect_statistics
from ghosted_hf.text.tokens import tokenize_texts

KINDS = [("plainly pruned", "none"), ("replaceme-ls", "replaceme-ls"), ("folded-tied", "folded-tied"),
         ("folded", "folded"), ("normed", "normed")]
HEALED = ("folded", "normed")  # the best exports llama.cpp runs, healed with --heal-steps
PROMPTS = ["The history of the city", "In mathematics, a prime number", "The river flows", "Scientists have found",
           "The first law of"]


def run(command: list[str], **kwargs) -> str:
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, command))} failed:\n{done.stderr[-3000:]}")
    return done.stdout + done.stderr


def add_bos(gguf_path: Path) -> tuple[bool, int | None]:
    """Whether llama.cpp puts BOS before a chunk (the vocabulary's flag; without one, llama.cpp's default for a
    sentencepiece-style vocabulary is yes), and the BOS id."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields

    def value(name: str):
        field = fields.get(name)
        return None if field is None else field.contents()

    flag = value("tokenizer.ggml.add_bos_token")
    wants = value("tokenizer.ggml.model") == "llama" if flag is None else bool(flag)
    return wants, value("tokenizer.ggml.bos_token_id")


def transformers_perplexity(model: torch.nn.Module, tokens: list[int], ctx: int, chunks: int,
                            bos: int | None) -> float:
    """llama-perplexity's perplexity computed with transformers (fp32) on the same token ids (where the vocabulary
    asks for BOS, llama-perplexity puts one before the text too, and then over each chunk's first token)."""
    tokens = tokens if bos is None else [bos, *tokens]
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


def llama_perplexity(binary: Path, gguf_path: Path, text: Path, ctx: int, chunks: int, threads: int,
                     repack: bool) -> float:
    out = run([binary, "-m", gguf_path, "-f", text, "-c", ctx, "--chunks", chunks, "-t", threads, "-b", ctx,
               *([] if repack else ["--no-repack"])])
    return float(re.search(r"Final estimate: PPL = ([0-9.]+)", out).group(1))


def llama_speed(binary: Path, gguf_path: Path, threads: int, repack: bool) -> tuple[float, float]:
    """(prefill tokens/s for 512 tokens, decode tokens/s for 128) from llama-bench."""
    rows = json.loads(run([binary, "-m", gguf_path, "-p", 512, "-n", 128, "-t", threads, "-r", 3, "-o", "json",
                           "--repack", int(repack)]))
    speed = {("prefill" if r["n_prompt"] else "decode"): r["avg_ts"] for r in rows}
    return speed["prefill"], speed["decode"]


def binding_agreement(model: torch.nn.Module, gguf_path: Path, tokenizer, tokens: list[int], ctx: int,
                      threads: int) -> dict[str, float]:
    """llama.cpp (through llama-cpp-python) against transformers on the same token ids: next-token logits over
    `ctx` tokens and 32 greedy tokens of each prompt."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf_path), n_ctx=ctx, n_batch=ctx, logits_all=True, n_threads=threads, verbose=False)
    ids = tokens[:ctx]
    llm.reset()
    llm.eval(ids)
    theirs = torch.tensor(llm.scores[:len(ids)], dtype=torch.float32)
    with torch.no_grad():
        ours = model(torch.tensor([ids])).logits[0].float()
    same, total = 0, 0
    for prompt in PROMPTS:
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            reference = model.generate(torch.tensor([prompt_ids]), max_new_tokens=32, do_sample=False)[0, len(prompt_ids):]
        generated = []
        for token in llm.generate(prompt_ids, top_k=1, top_p=1.0, temp=0.0, reset=True):
            generated.append(token)
            if len(generated) == len(reference):
                break
        match = next((i for i, (a, b) in enumerate(zip(generated, reference.tolist())) if a != b), len(reference))
        same += match
        total += len(reference)
    return {"max_abs_logit_diff": float((theirs - ours).abs().max()),
            "top1_agreement": float((theirs.argmax(-1) == ours.argmax(-1)).float().mean()),
            "greedy_prefix": same / total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp folder (converter + build/bin).")
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 4])
    parser.add_argument("--quants", nargs="*", default=["F16", "Q8_0", "Q4_K_M"],
                        help="Precisions to score and time (none: only the agreement of --bindings).")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("benchmark-cache/serving"))
    parser.add_argument("--statistics", type=Path, default=Path("benchmark-cache"))
    parser.add_argument("--heal-steps", type=int, default=0,
                        help="Also heal the folded and normed exports with `heal`'s defaults for this many steps "
                             "(on the calibration articles), and serve the healed models.")
    parser.add_argument("--no-repack", dest="repack", action="store_false",
                        help="Run llama.cpp without its extra CPU buffer types (weight repacking, AMX): its AMX path "
                             "crashed on Q8_0 on a virtual machine with AMX here.")
    parser.add_argument("--bindings", action="store_true",
                        help="Compare logits and greedy tokens through llama-cpp-python (LLAMA_CPP_LIB_PATH: this build).")
    args = parser.parse_args()
    bin_dir = args.llama_cpp / "build" / "bin"
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    from transformers import AutoModelForCausalLM

    load_folder = lambda folder: AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # noqa: E731
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
        for name, kind in [*KINDS, ("ghost", "ghost")]:
            folder = args.work / f"{n}-{kind}"
            if not (folder / "config.json").is_file():
                save_with_card(ghost_prune(load(), tokenizer, calibration, prune, statistics=stats, operator=kind,
                                           criterion="manual", layers=removed), folder, tokenizer)
            if kind != "ghost":
                folders[(name, n)] = folder
        for name in HEALED if args.heal_steps else ():
            folder = args.work / f"{n}-{name}-healed-{args.heal_steps}"
            if not (folder / "config.json").is_file():
                healed = heal(load_folder(args.work / f"{n}-{name}"), tokenizer, calibration, steps=args.heal_steps)
                save_with_card(merge(healed), folder, tokenizer)
            folders[(f"{name} + healing", n)] = folder

    if args.quants:
        print(f"SmolLM2-135M-Instruct exports in llama.cpp (CPU, {args.threads} threads); perplexity on {args.chunks} "
              f"chunks of {args.ctx} held-out tokens (second halves scored, as llama-perplexity does).\n")
        print("| model | removed | precision | GGUF MB | llama.cpp perplexity | vs transformers | gap closed | "
              "share of ghost gain | prefill t/s | decode t/s |")
        print("|---|---|---|---|---|---|---|---|---|---|")

    def gguf_file(name: str, n: int, folder: Path, outtype: str) -> Path:
        path = args.work / f"{name}-{n}-{outtype.upper()}.gguf".replace(" ", "_")
        if not path.is_file():
            if name.startswith("normed"):
                run([sys.executable, "-m", "ghosted_hf.cli", "export-gguf", folder, path, "--llama-cpp", args.llama_cpp,
                     "--outtype", outtype])
            else:
                run([sys.executable, args.llama_cpp / "convert_hf_to_gguf.py", folder, "--outfile", path, "--outtype",
                     outtype])
        return path

    @functools.cache
    def folder_perplexity(folder: Path, bos: int | None) -> float:
        """transformers' perplexity of a saved model on the chunks: each folder is scored once, not once a row."""
        return transformers_perplexity(load_folder(folder), tokens, args.ctx, args.chunks, bos)

    agreement, served = [], {}
    for (name, n), folder in folders.items():
        f16 = gguf_file(name, n, folder, "f16")
        wants_bos, bos = add_bos(f16)
        bos = bos if wants_bos else None
        reference = folder_perplexity(folder, bos)
        plain = ghost = None
        if n:
            plain = folder_perplexity(args.work / f"{n}-none", bos)
            ghost = folder_perplexity(args.work / f"{n}-ghost", bos)
        if args.bindings:
            f32 = gguf_file(name, n, folder, "f32")
            agreement.append((name, n, binding_agreement(load_folder(folder), f32, tokenizer, tokens, args.ctx,
                                                         args.threads)))
        for quant in args.quants:
            path = f16 if quant == "F16" else f16.with_name(f16.name.replace("F16", quant))
            if not path.is_file():
                run([bin_dir / "llama-quantize", f16, path, quant])
            ppl = llama_perplexity(bin_dir / "llama-perplexity", path, text, args.ctx, args.chunks, args.threads,
                                   args.repack)
            prefill, decode = llama_speed(bin_dir / "llama-bench", path, args.threads, args.repack)
            served[(name, n, quant)] = ppl
            share = f"{(math.log(plain) - math.log(ppl)) / (math.log(plain) - math.log(ghost)):.3f}" if n else "-"
            closed = (f"{gap_closed(ppl, served[('plainly pruned', n, quant)], served[('dense', 0, quant)]):.3f}"
                      if n else "-")
            print(f"| {name} | {f'{n}/30' if n else '-'} | {quant} | {path.stat().st_size / 1e6:.1f} | {ppl:.3f} | "
                  f"{ppl / reference:.4f} (transformers {reference:.3f}) | {closed} | {share} | {prefill:.0f} | "
                  f"{decode:.1f} |", flush=True)
    if agreement:
        print("\nF32 in llama.cpp (llama-cpp-python on the same build) against transformers fp32, same token ids: "
              f"next-token logits over the first {args.ctx} held-out tokens, and the share of 32 greedy tokens of "
              f"{len(PROMPTS)} prompts that agree before the first difference.\n")
        print("| model | removed | max abs logit diff | top-1 agreement | greedy tokens equal |")
        print("|---|---|---|---|---|")
        for name, n, figures in agreement:
            print(f"| {name} | {f'{n}/30' if n else '-'} | {figures['max_abs_logit_diff']:.4f} | "
                  f"{figures['top1_agreement']:.4f} | {figures['greedy_prefix']:.3f} |")
    print(f"\nTotal {time.perf_counter() - started:.0f} s.")


if __name__ == "__main__":
    main()
