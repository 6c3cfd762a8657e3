"""LAMBADA (OpenAI, first `--items` of 5,153) last-word accuracy and perplexity of the dense packaged model, of
LLM-Streamline's block plainly removed, of the default block plainly removed, and of the default ghosted
model, beside held-out perplexity: a zero-shot measure that still separates models of this size. The models
are built from the statistics cache of benchmarks/healing.py (computed there if missing).

    python benchmarks/lambada.py --layers 8 --items 500 > benchmarks/results/lambada.md
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from common import held_out_windows, layer_ranges, packaged_model
from healing import cached_statistics

from ghosted_hf import assets, ghost_prune
from ghosted_hf.evaluate import gap_closed, lambada, perplexity
from ghosted_hf.options import PruneOptions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--items", type=int, default=500)
    parser.add_argument("--statistics", default="benchmark-cache/healing-statistics.safetensors")
    args = parser.parse_args()
    tokenizer, load = packaged_model()
    calibration = assets.wikipedia_split("calibration")
    held_out = held_out_windows(tokenizer, 16)
    prune = PruneOptions(num_layers=args.layers)
    stats = cached_statistics(Path(args.statistics), load, tokenizer, calibration, prune)
    models = {
        "dense": load,
        "LLM-Streamline's block plainly removed": lambda: ghost_prune(load(), tokenizer, calibration, prune, statistics=stats,
                                                                      criterion="streamline", operator="none"),
        "default block plainly removed": lambda: ghost_prune(load(), tokenizer, calibration, prune, statistics=stats,
                                                             operator="none"),
        "ghosted (defaults)": lambda: ghost_prune(load(), tokenizer, calibration, prune, statistics=stats),
    }
    started = time.perf_counter()
    print(f"SmolLM2-135M-Instruct, fp32, {args.layers}/30 layers removed. LAMBADA: first {args.items} items; "
          f"perplexity: {held_out.num_tokens} held-out tokens.\n")
    print("| model | layers removed | perplexity | gap closed | LAMBADA acc (SE) | LAMBADA ppl |")
    print("|---|---|---|---|---|---|", flush=True)
    ppl = {}
    for name, make in models.items():
        model = make()
        ppl[name] = perplexity(model, held_out.batches, progress=False)
        result = lambada(model, tokenizer, limit=args.items, progress=False)
        removed = getattr(model.config, "removed_layers", None)
        baseline = ppl.get("LLM-Streamline's block plainly removed")
        closed = f"{gap_closed(ppl[name], baseline, ppl['dense']):.3f}" if baseline and removed else "-"
        layers = layer_ranges(removed) if removed else "-"
        print(f"| {name} | {layers} | {ppl[name]:.2f} | {closed} | {result['accuracy']:.3f} ({result['accuracy_stderr']:.3f}) "
              f"| {result['perplexity']:.1f} |", flush=True)
    print(f"\nTotal {time.perf_counter() - started:.0f} s.")


if __name__ == "__main__":
    main()
