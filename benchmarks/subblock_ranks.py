"""Rank-r sub-block maps (issue #51 item 1): how much of a full C x C map's fit a map of rank r keeps, and what a
sub-block choice scores with its maps cut to rank r (2 C r parameters each instead of C^2).

1. Every attention and MLP sub-block's map fitted on the dense model (32 calibration sequences of 512 tokens): the
   share of the output energy the full map explains that the best map of rank r (`fitting.operators.reduced_rank`,
   the statistics alone) still explains, median and worst over the layers, per kind.
2. A sub-block choice (default: the criterion's 12.5% choice of SmolLM2 in benchmarks/results/subblocks.md) built
   by `ghost_prune` with full maps, then each map projected on the r leading directions of its fitted values (the
   dense model's statistics): held-out perplexity ratio to dense (the packaged Wikipedia evaluation articles and
   gensim's news articles, 16 windows of 512 tokens) and the parameters removed net of the maps.

    python benchmarks/subblock_ranks.py > benchmarks/results/subblock_ranks.md
"""

from __future__ import annotations

import argparse
import statistics as stat

import torch
from common import held_out_sources
from transformers import AutoModelForCausalLM, AutoTokenizer

from ghosted_hf import assets, ghost_prune
from ghosted_hf.evaluate import perplexity
from ghosted_hf.fitting.operators import reduced_rank, ridge_epsilon, ridge_solve, squared_residual
from ghosted_hf.model.loading import NO_HUB_KERNELS
from ghosted_hf.statistics import SUBBLOCK_SUMS, StatisticsPlan, collect_statistics, subblock_terms
from ghosted_hf.statistics.patch import subblock_slot
from ghosted_hf.text.tokens import tokenize_texts

CALIBRATION = dict(seq_len=512, num_sequences=32, batch_size=4)
RIDGE = 1e-6  # PruneOptions' default
CHOSEN = {"smollm2-135m-instruct": ["5.attention", "6.attention", "7.attention", "13.mlp", "14.attention", "14.mlp",
                                    "15.attention", "15.mlp", "16.mlp", "17.attention", "28.attention", "29.attention"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", choices=list(CHOSEN))
    parser.add_argument("--ranks", nargs="+", type=int, default=[16, 32, 64, 128, 256])
    args = parser.parse_args()
    folder = assets.resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)

    def load():
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **NO_HUB_KERNELS).eval()

    dense = load()
    depth, width = dense.config.num_hidden_layers, dense.config.hidden_size
    calibration = assets.wikipedia_split("calibration")
    batches = tokenize_texts(tokenizer, calibration, **CALIBRATION).batches
    kinds = ("attention", "mlp")
    stats = collect_statistics(dense, batches, StatisticsPlan.union(subblock_terms(k, j) for k in kinds
                                                                    for j in range(depth)), progress=False)
    print(f"`python benchmarks/subblock_ranks.py --model {args.model} --ranks {' '.join(map(str, args.ranks))}` "
          f"({torch.get_num_threads()} threads; width {width}, a full map {width * width:,} parameters)\n")
    print("## Share of the full map's explained energy kept at rank r (median / worst over the layers)\n")
    print("| sub-block | full map: relative residual (median) | " + " | ".join(
        f"rank {r} ({2 * width * r / width ** 2:.0%} of a full map)" for r in args.ranks) + " |")
    print("|---|---|" + "---|" * len(args.ranks))
    for kind in kinds:
        kept, full_share = {r: [] for r in args.ranks}, []
        for j in range(depth):
            gram, cross, energy = (stats[s(j)] for s in SUBBLOCK_SUMS[kind])
            energy = float(energy)
            full = squared_residual(gram, cross, energy, ridge_solve(gram, cross, RIDGE)[0])
            full_share.append(full / energy)
            for r in args.ranks:
                down, up = reduced_rank(gram, cross, RIDGE, r)
                kept[r].append((energy - squared_residual(gram, cross, energy, down @ up)) / (energy - full))
        print(f"| {kind} | {stat.median(full_share):.3f} | " + " | ".join(
            f"{stat.median(kept[r]):.3f} / {min(kept[r]):.3f}" for r in args.ranks) + " |", flush=True)

    chosen = CHOSEN[args.model]
    held_out = held_out_sources(tokenizer)
    reference = {source: perplexity(dense, b, progress=False) for source, b in held_out.items()}
    model = ghost_prune(load(), tokenizer, calibration, unit="subblock", criterion="manual", subblocks=chosen,
                        **CALIBRATION)
    maps = {}
    for name in chosen:
        layer, kind = int(name.split(".")[0]), name.split(".")[1]
        bypass = getattr(*subblock_slot(model, layer, kind))
        gram = stats[SUBBLOCK_SUMS[kind][0](layer)]
        maps[name] = (bypass.ghost.operator, bypass.ghost.operator.detach().clone().double(), gram)
    removed = sum(p.numel() for p in dense.model.layers.parameters()) - sum(
        p.numel() for n, p in model.named_parameters() if ".layers." in n and "ghost" not in n)
    print(f"\n## {len(chosen)} sub-blocks replaced ({', '.join(chosen)}); dense perplexity wiki "
          f"{reference['wiki']:.2f}, news {reference['news']:.2f}\n")
    print("| maps | removed net of the maps | wiki ppl ratio | news ppl ratio |")
    print("|---|---|---|---|")
    for r in [*args.ranks, width]:
        with torch.no_grad():
            for operator, full, gram in maps.values():
                eps = ridge_epsilon(gram, RIDGE)
                _, vectors = torch.linalg.eigh(full.T @ (gram + eps * torch.eye(width, dtype=gram.dtype)) @ full)
                leading = vectors[:, width - r:]
                operator.copy_((full @ leading @ leading.T).to(operator.dtype))
        ratios = {source: perplexity(model, b, progress=False) / reference[source] for source, b in held_out.items()}
        net = removed - len(chosen) * (2 * width * r if r < width else width * width)
        print(f"| {'full' if r == width else f'rank {r}'} | {net / 1e6:.2f} M | {ratios['wiki']:.3f} | "
              f"{ratios['news']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
