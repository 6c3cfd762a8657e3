"""Plain export benchmark on a packaged model (default SmolLM2-135M-Instruct, `--model`): how much of the ghost
operator's gain the stock-checkpoint recoveries keep.

For each number of removed layers, the default (ghost-aware) selection picks the block; every recovery is
fitted from the SAME calibration statistics and scored on the SAME held-out tokens. "gap closed" is the
fraction of the log-perplexity gap between this block plainly removed and the dense model; "ghost gain kept"
is (log ppl_plain - log ppl) / (log ppl_plain - log ppl_ghost).

    python benchmarks/plain_export.py --layers 8 4 > benchmarks/results/plain_export.md
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from common import add_setup_arguments, benchmark_setup, model_title

from ghosted_hf import ghost_prune
from ghosted_hf.evaluate import gap_closed, perplexity
from ghosted_hf.fitting.operators import OPERATOR_KINDS
from ghosted_hf.model.surgery import count_parameters
from ghosted_hf.fitting.units import boundary_spans
from ghosted_hf.statistics import StatisticsPlan, collect_statistics

ROWS = [  # (row name, operator kind, needs custom code to run)
    ("no recovery", "none", False),
    ("linearpatch-diag", "linearpatch-diag", True),
    ("linearpatch-rotate", "linearpatch-rotate", True),
    ("replaceme-ls", "replaceme-ls", False),
    ("folded (c, T; embeddings stay tied)", "folded-tied", False),
    ("folded (c, Q, T)", "folded", False),
    ("ghost", "ghost", True),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_setup_arguments(parser)
    args = parser.parse_args()

    started = time.perf_counter()
    setup = benchmark_setup(args)
    tokenizer, load, calibration, held_out = setup.tokenizer, setup.load, setup.calibration, setup.held_out
    options, data, dense = setup.options, setup.data, setup.dense
    dense_parameters = count_parameters(load())
    title, config = model_title(load, args.model)
    depth = config.num_hidden_layers
    print(f"{title}, fp32; dense perplexity {dense:.2f}, {dense_parameters:,} "
          f"parameters. Calibration {data.num_tokens} tokens; {args.eval_windows} held-out windows of 512.\n")
    print("| removed | layers | recovery | stock checkpoint | perplexity | gap closed | ghost gain kept | parameters |")
    print("|---|---|---|---|---|---|---|---|")
    for n in args.layers:
        removed = ghost_prune(load(), tokenizer, calibration, options, num_layers=n,
                              operator="none").config.ghost_provenance["selection"]["removed"]
        spans = boundary_spans(depth, removed)
        plan = StatisticsPlan.union(OPERATOR_KINDS[kind].statistics(s, e) for _, kind, _ in ROWS for s, e in spans
                                    if s >= OPERATOR_KINDS[kind].first_removable)
        stats = collect_statistics(load(), data.batches, plan, progress=False)
        results = {}
        for name, kind, custom in ROWS:
            model = ghost_prune(load(), tokenizer, calibration, options, statistics=stats, criterion="manual",
                                layers=removed, operator=kind)
            results[name] = (perplexity(model, held_out, progress=False), count_parameters(model), custom)
        plain, ghost = results["no recovery"][0], results["ghost"][0]
        for name, (ppl, parameters, custom) in results.items():
            kept = (math.log(plain) - math.log(ppl)) / (math.log(plain) - math.log(ghost))
            print(f"| {n}/{depth} | {removed[0]}-{removed[-1]} | {name} | {'no' if custom else 'yes'} | {ppl:.2f} | "
                  f"{gap_closed(ppl, plain, dense):.3f} | {kept:.2f} | {parameters / 1e6:.1f} M |", flush=True)
    print(f"\nTotal {time.perf_counter() - started:.0f} s.")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
