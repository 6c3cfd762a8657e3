"""Rank-r sub-block maps (issue #51 item 1): how much of a full C x C map's fit a map of rank r keeps, and what a
sub-block choice scores with its maps cut to rank r (2 C r parameters each instead of C^2).

1. Every attention and MLP sub-block's map fitted on the dense model (32 calibration sequences of 512 tokens): the
   share of the output energy the full map explains that the best map of rank r (`fitting.operators.reduced_rank`,
   the statistics alone) still explains, median and worst over the layers, per kind.
2. A sub-block choice (default: the criterion's 12.5% choice of SmolLM2 in benchmarks/results/subblocks.md) built
   by `ghost_prune` with full maps, then each map projected on the r leading directions of its fitted values (the
   dense model's statistics): held-out perplexity ratio to dense (the packaged Wikipedia evaluation articles and
   gensim's news articles, 16 windows of 512 tokens) and the parameters removed net of the maps.
3. A basis shared by the chosen maps (issue #51 item 1; SubFit shares an input basis), at the parameters of separate
   rank-r maps: n maps of rank r hold 2 n C r values, n maps over one shared basis of rank s = 2 n r / (n + 1) as
   many. The shared output basis is exact from the statistics: the leading eigenvectors of the summed fitted-value
   Grams, each map then its full map projected on it. The shared input basis whitens by the maps' pooled input Gram
   and takes the leading directions of the summed G A A^T G, each map then refitted on it exactly. Each map's Gram
   enters divided by the energy its full map explains, so every map's share counts alike (the stream's norm grows
   with depth: raw energies would hand the basis to the last layers). Shared over the whole choice and, where a
   layer's attention and MLP are both chosen, per layer.

    python benchmarks/subblock_ranks.py > benchmarks/results/subblock_ranks.md
"""

from __future__ import annotations

import argparse
import statistics as stat

import torch
from common import CALIBRATION, held_out_sources
from transformers import AutoModelForCausalLM, AutoTokenizer

from ghosted_hf import assets, ghost_prune
from ghosted_hf.evaluate import perplexity
from ghosted_hf.fitting.operators import reduced_rank, ridge_epsilon, ridge_solve, squared_residual
from ghosted_hf.model.loading import NO_HUB_KERNELS
from ghosted_hf.statistics import SUBBLOCK_SUMS, StatisticsPlan, collect_statistics, subblock_terms
from ghosted_hf.statistics.patch import subblock_slot
from ghosted_hf.text.tokens import tokenize_texts

RIDGE = 1e-6  # PruneOptions' default
CHOSEN = {"smollm2-135m-instruct": ["5.attention", "6.attention", "7.attention", "13.mlp", "14.attention", "14.mlp",
                                    "15.attention", "15.mlp", "16.mlp", "17.attention", "28.attention", "29.attention"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", choices=list(CHOSEN))
    parser.add_argument("--ranks", nargs="+", type=int, default=[16, 32, 64, 128, 256])
    parser.add_argument("--shared-ranks", nargs="+", type=int, default=[64, 128],
                        help="separate ranks r whose parameters a shared basis gets (section 3)")
    parser.add_argument("--subblocks", nargs="+", help="the choice to score (default: the 12.5%% choice above)")
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
    print(f"`python benchmarks/subblock_ranks.py --model {args.model} --ranks {' '.join(map(str, args.ranks))} "
          f"--shared-ranks {' '.join(map(str, args.shared_ranks))}"
          f"{' --subblocks ' + ' '.join(args.subblocks) if args.subblocks else ''}` "
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

    chosen = args.subblocks or CHOSEN[args.model]
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
                operator.copy_(projected(full, gram, r).to(operator.dtype))
        ratios = {source: perplexity(model, b, progress=False) / reference[source] for source, b in held_out.items()}
        net = removed - len(chosen) * (2 * width * r if r < width else width * width)
        print(f"| {'full' if r == width else f'rank {r}'} | {net / 1e6:.2f} M | {ratios['wiki']:.3f} | "
              f"{ratios['news']:.3f} |", flush=True)
    shared_basis(model, maps, args.shared_ranks, removed, reference, held_out)


def explained(full: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """A map's fitted values' Gram A^T (G + eps I) A: the output energy it explains, per direction."""
    return full.T @ ridged(gram) @ full


def ridged(gram: torch.Tensor) -> torch.Tensor:
    return gram + ridge_epsilon(gram, RIDGE) * torch.eye(gram.shape[0], dtype=gram.dtype)


def leading(matrix: torch.Tensor, s: int) -> torch.Tensor:
    return torch.linalg.eigh((matrix + matrix.T) / 2)[1][:, -s:]


def projected(full: torch.Tensor, gram: torch.Tensor, r: int) -> torch.Tensor:
    """A full map projected on its own r leading output directions: its best map of rank r."""
    basis = leading(explained(full, gram), r)
    return full @ basis @ basis.T


def shared_output(pairs: list[tuple[torch.Tensor, torch.Tensor]], s: int) -> list[torch.Tensor]:
    """Each full map projected on one output basis of rank s: the leading directions of the summed, share-weighted
    fitted-value Grams (exactly the best shared basis for that weighted sum)."""
    grams = [explained(a, g) for a, g in pairs]
    basis = leading(sum(e / e.trace() for e in grams), s)
    return [a @ basis @ basis.T for a, _ in pairs]


def shared_input(pairs: list[tuple[torch.Tensor, torch.Tensor]], s: int) -> list[torch.Tensor]:
    """Each map refitted exactly on one input basis P of rank s: h @ P @ B with B = (P^T G P)^-1 P^T G A. P whitens
    by the pooled input Gram and keeps the leading directions of the summed, share-weighted G A A^T G."""
    grams = [ridged(g) for _, g in pairs]
    values, vectors = torch.linalg.eigh(sum(g / g.trace() for g in grams))
    whiten = vectors @ torch.diag(values.clamp_min(values.max() * 1e-12).rsqrt()) @ vectors.T
    pulls = sum((g @ a @ a.T @ g) / explained(a, g0).trace() for (a, g0), g in zip(pairs, grams))
    basis = whiten @ leading(whiten @ pulls @ whiten, s)
    return [basis @ torch.linalg.solve(basis.T @ g @ basis, basis.T @ g @ a) for (a, _), g in zip(pairs, grams)]


def kept(full: torch.Tensor, gram: torch.Tensor, applied: torch.Tensor) -> float:
    """Share of the output energy the full map explains that `applied` still explains (residual from statistics)."""
    g = ridged(gram)
    return 1 - float(((full - applied).T @ g @ (full - applied)).trace()) / float(explained(full, gram).trace())


def shared_basis(model, maps, ranks, removed, reference, held_out) -> None:
    names, width = list(maps), next(iter(maps.values()))[1].shape[0]
    pairs = [(full, gram) for _, full, gram in maps.values()]
    n = len(names)
    layers = [j for j in sorted({int(x.split(".")[0]) for x in names}) if {f"{j}.attention", f"{j}.mlp"} <= set(names)]
    print(f"\n## A basis shared by the {n} maps, at the parameters of separate rank-r maps\n")
    print("Share of the full map's explained energy kept, mean / worst over the maps (per layer: over the maps of "
          f"layers {layers}, the attention and MLP of one layer sharing a basis).\n")
    print("| separate rank r | separate maps | shared over all: output basis | shared over all: input basis | "
          "per layer: separate | per layer: output basis | per layer: input basis |")
    print("|---|---|---|---|---|---|---|")
    runs = {}
    for r in ranks:
        s = 2 * n * r // (n + 1)
        separate = [projected(full, g, r) for full, g in pairs]
        runs[r] = {f"shared output basis, rank {s}": shared_output(pairs, s),
                   f"shared input basis, rank {s}": shared_input(pairs, s)}
        cells = [separate, *runs[r].values()]
        local = [names.index(f"{j}.{k}") for j in layers for k in ("attention", "mlp")]
        per_layer = [[], [], []]
        for j in layers:
            pair = [pairs[names.index(f"{j}.{k}")] for k in ("attention", "mlp")]
            per_layer[1] += shared_output(pair, 4 * r // 3)
            per_layer[2] += shared_input(pair, 4 * r // 3)
        per_layer[0] = [separate[i] for i in local]
        shares = [[kept(*pairs[i], m) for i, m in enumerate(cell)] for cell in cells]
        shares += [[kept(*pairs[i], m) for i, m in zip(local, cell)] for cell in per_layer]
        print(f"| {r} (shared: {s}, per layer {4 * r // 3}) | " + " | ".join(
            f"{stat.mean(x):.3f} / {min(x):.3f}" if x else "-" for x in shares) + " |", flush=True)
    print("\n| maps (whole choice) | removed net of the maps | wiki ppl ratio | news ppl ratio |")
    print("|---|---|---|---|")
    for r, variants in runs.items():
        s = 2 * n * r // (n + 1)
        for label, applied in variants.items():
            with torch.no_grad():
                for (operator, _, _), m in zip(maps.values(), applied):
                    operator.copy_(m.to(operator.dtype))
            ratios = {source: perplexity(model, b, progress=False) / reference[source] for source, b in held_out.items()}
            print(f"| {label} (separate rank {r}'s parameters) | {(removed - (n + 1) * width * s) / 1e6:.2f} M | "
                  f"{ratios['wiki']:.3f} | {ratios['news']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
