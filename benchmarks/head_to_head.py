"""Published layer choices against the criterion's (issue #51 item 6), training-free, on the packaged models and the
same held-out texts as the equal-budget table: gem-3-small's layers [8, 9, 14, 16] of Gemma 3 270M (optipfair), and
SmolLM2-135M's layers 14 and 17, reported as "anti-layers" whose removal lowers perplexity (arXiv 2603.19348).

Rows per published set: its layers plainly removed, the same layers with ghost operators (`ghost_prune`'s defaults
for given layers), and what `ghost_prune` chooses itself for the same number of layers (its defaults), plainly
removed and ghosted. Scored as the perplexity ratio to the dense model on the packaged Wikipedia evaluation articles
and gensim's news articles (16 windows of 512 tokens each; Gemma's windows start with BOS as it was trained).
Calibration: `ghost_prune`'s defaults on the Wikipedia calibration articles.

With `--heal`, each ghosted row is also healed by `heal`'s defaults (150 steps of LoRA on the same Wikipedia
articles, the next-token loss) and scored on both sources: the healed ratio and the share of the log gap between
plain removal and dense that it closes (gem-3-small reports 0.888 on its own text after distilling 5 epochs on
2,000 samples). Seconds: the heal's wall time.

    python benchmarks/head_to_head.py > benchmarks/results/head_to_head.md
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from common import held_out_sources
from transformers import AutoModelForCausalLM, AutoTokenizer

from ghosted_hf import assets, ghost_prune
from ghosted_hf.evaluate import perplexity
from ghosted_hf.model.loading import NO_HUB_KERNELS
from ghosted_hf.pipelines.healing import heal, merge

PUBLISHED = {  # model -> (who chose them, layers)
    "gemma3-270m": ("gem-3-small (optipfair)", [8, 9, 14, 16]),
    "smollm2-135m-instruct": ("anti-layers (arXiv 2603.19348)", [14, 17]),
}
WINDOWS = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(PUBLISHED), choices=list(PUBLISHED))
    parser.add_argument("--heal", action="store_true", help="also heal each ghosted row with heal's defaults")
    args = parser.parse_args()
    print(f"`python benchmarks/head_to_head.py --models {' '.join(args.models)}{' --heal' if args.heal else ''}` "
          f"({torch.get_num_threads()} threads)\n")
    for name in args.models:
        folder = assets.resolve_model(name)
        tokenizer = AutoTokenizer.from_pretrained(folder)

        def load():
            return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **NO_HUB_KERNELS).eval()

        held_out = held_out_sources(tokenizer, WINDOWS)
        dense = {source: perplexity(load(), batches, progress=False) for source, batches in held_out.items()}
        who, layers = PUBLISHED[name]
        print(f"## {name}: dense perplexity wiki {dense['wiki']:.2f}, news {dense['news']:.2f}\n")
        healed_columns = " healed wiki / news ratio | log gap closed wiki / news | heal s |" if args.heal else ""
        print("| layers | chosen by | recovery | wiki ppl ratio | news ppl ratio | s |" + healed_columns)
        print("|---|---|---|---|---|---|" + "---|---|---|" * args.heal)
        calibration = assets.wikipedia_split("calibration")
        started = time.perf_counter()
        own = ghost_prune(load(), tokenizer, calibration, num_layers=len(layers))
        runs = [(who, layers, "ghost", None), (who, layers, "none", None),
                ("ghost_prune's criterion", own.config.removed_layers, "ghost", (own, time.perf_counter() - started)),
                ("ghost_prune's criterion", own.config.removed_layers, "none", None)]
        rows, plain = [], {}
        for chooser, removed, operator, made in runs:
            started = time.perf_counter()
            model, seconds = made or (ghost_prune(load(), tokenizer, calibration, criterion="manual", layers=removed,
                                                  operator=operator), None)
            seconds = seconds if seconds is not None else time.perf_counter() - started
            ratios = {source: perplexity(model, batches, progress=False) / dense[source]
                      for source, batches in held_out.items()}
            if operator == "none":
                plain[tuple(removed)] = ratios
            rows.append((model if operator == "ghost" else None, f"| {removed} | {chooser} | "
                         f"{'ghost operators' if operator == 'ghost' else 'plainly removed'} | {ratios['wiki']:.3f} | "
                         f"{ratios['news']:.3f} | {seconds:.0f} |", removed))
            if not args.heal:
                print(rows[-1][1], flush=True)
        for model, line, removed in rows if args.heal else ():
            if model is None:
                print(line + " - | - | - |", flush=True)
                continue
            started = time.perf_counter()
            healed = merge(heal(model, tokenizer, calibration, eval_sequences=0, progress=False)).eval()
            seconds = time.perf_counter() - started
            ratios = {source: perplexity(healed, batches, progress=False) / dense[source]
                      for source, batches in held_out.items()}
            closed = {source: 1 - math.log(ratios[source]) / math.log(plain[tuple(removed)][source]) for source in ratios}
            print(line + f" {ratios['wiki']:.3f} / {ratios['news']:.3f} | {closed['wiki']:.3f} / {closed['news']:.3f} "
                  f"| {seconds:.0f} |", flush=True)
        print()


if __name__ == "__main__":
    main()
