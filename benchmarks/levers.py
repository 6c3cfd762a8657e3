"""Closed-form levers beyond the ghost operator on the packaged SmolLM2-135M-Instruct (30 layers), each against
the current default (ghost-aware selection, ghost operator, sequential fitting, 128 x 512 calibration tokens of
the packaged Wikipedia calibration split), on the same held-out windows as benchmarks/plain_export.py. One dense
statistics pass per depth serves both selections (ghost-aware, and LLM-Streamline for the baseline) and every
row's boundary fit; only a lever's own passes on the patched model come on top.

Levers (all `PruneOptions`): `operator="ghost-affine"` (x -> x W + b), `norm_operator=True` (one more operator at
the final norm's input, fitted on the pruned and patched model), `lookahead="frozen-update"` / `"linearised"` (each
boundary refitted once so that the first kept layer's output matches). For each number of removed layers the default selection picks the
block once; every row is fitted from the SAME dense statistics (one pass), its extra passes on the patched model
use the same calibration tokens. "gap closed" is against LLM-Streamline's block plainly removed (as in
benchmarks/quality.py); "vs default" is the change in log perplexity against the default row.

    python benchmarks/levers.py --layers 8 4 > benchmarks/results/levers.md
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from ghosted_hf import ghost_prune
from ghosted_hf.calibration import StatisticsPlan, collect_statistics
from ghosted_hf.evaluate import gap_closed, perplexity
from ghosted_hf.options import PruneOptions
from ghosted_hf.recipe import statistics_plan

from common import add_setup_arguments, benchmark_setup, layer_ranges

ROWS = {  # row name: the lever's options on top of the default
    "no recovery (same block)": dict(operator="none"),
    "default (ghost)": {},
    "affine (ghost-affine)": dict(operator="ghost-affine"),
    "norm operator": dict(norm_operator=True),
    "lookahead (linearised)": dict(lookahead="linearised"),
    "lookahead (frozen update)": dict(lookahead="frozen-update"),
    "affine + norm operator": dict(operator="ghost-affine", norm_operator=True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_setup_arguments(parser)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    args = parser.parse_args()

    started = time.perf_counter()
    setup = benchmark_setup(args)
    tokenizer, load, calibration, held_out = setup.tokenizer, setup.load, setup.calibration, setup.held_out
    options, data, dense = setup.options, setup.data, setup.dense
    print(f"SmolLM2-135M-Instruct (dequantized Q4_1), fp32; dense perplexity {dense:.2f}. Calibration {data.num_tokens} "
          f"tokens ({options.num_sequences} x {options.seq_len}); {args.eval_windows} held-out windows of 512.\n")
    print("| removed | layers | lever | perplexity | gap closed | log ppl vs default | fit seconds |")
    print("|---|---|---|---|---|---|---|")
    for n in args.layers:
        # Every candidate block's selection and fit statistics (ghost-affine's include ghost's), and Streamline's.
        plan = StatisticsPlan.union([
            statistics_plan(30, PruneOptions.build(options, num_layers=n, operator="ghost-affine")),
            statistics_plan(30, PruneOptions.build(options, num_layers=n, criterion="streamline", operator="none"))])
        stats = collect_statistics(load(), data.batches, plan, progress=False)
        streamline = ghost_prune(load(), tokenizer, calibration, options, statistics=stats, num_layers=n,
                                 criterion="streamline", operator="none")
        baseline = perplexity(streamline, held_out, progress=False)
        print(f"| {n}/30 | {layer_ranges(streamline.config.removed_layers)} | LLM-Streamline's block plainly removed "
              f"(the baseline) | {baseline:.2f} | 0.000 | - | - |", flush=True)
        removed = ghost_prune(load(), tokenizer, calibration, options, statistics=stats, num_layers=n,
                              operator="none").config.removed_layers
        default = None
        for name in args.rows:
            began = time.perf_counter()
            model = ghost_prune(load(), tokenizer, calibration, options, statistics=stats, criterion="manual",
                                layers=removed, **ROWS[name])
            seconds = time.perf_counter() - began
            ppl = perplexity(model, held_out, progress=False)
            if name == "default (ghost)":
                default = ppl
            versus = f"{math.log(ppl) - math.log(default):+.4f}" if default is not None else "-"
            print(f"| {n}/30 | {layer_ranges(removed)} | {name} | {ppl:.2f} | {gap_closed(ppl, baseline, dense):.3f} | "
                  f"{versus} | {seconds:.0f} |", flush=True)
    print(f"\nTotal {time.perf_counter() - started:.0f} s (`python benchmarks/levers.py --layers "
          f"{' '.join(map(str, args.layers))}`, 2 CPU cores shared with other jobs). Fit seconds: ghost_prune from the "
          "shared dense statistics, i.e. the extra passes a lever costs.")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
