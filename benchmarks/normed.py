"""The normed operator kinds against the ghost operator on the packaged SmolLM2-135M-Instruct.

`normed` fits the boundary as x + n(x) A (n: RMS normalisation, the form of llama.cpp's DeciLM "linear
attention" block), `ghost-normed` as x W + n(x) A jointly. Each kind is fitted from the same calibration
statistics, at the block the default selection removes (ghost-aware, scored by the ghost residual) and at
the block ghost-aware selection chooses when it scores the kind's own residual, and scored on the same
held-out windows: perplexity, gap closed (LLM-Streamline's block plainly removed -> dense), the share of the
ghost operator's log-perplexity gain over the same block plainly removed, the fit's relative residual, and
LAMBADA.

    python benchmarks/normed.py --layers 8 4 --lambada 500 > benchmarks/results/normed.md
"""

from __future__ import annotations

import argparse
import json
import math
import time

from common import add_model_argument, held_out_windows, layer_ranges, model_title, packaged_model

from ghosted_hf import assets, ghost_prune
from ghosted_hf.evaluate import gap_closed, lambada, perplexity
from ghosted_hf.options import PruneOptions
from ghosted_hf.pipelines.prune import statistics_plan
from ghosted_hf.statistics import StatisticsPlan, collect_statistics
from ghosted_hf.text.tokens import tokenize_texts

KINDS = ("ghost", "normed", "ghost-normed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_argument(parser)
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 4])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--lambada", type=int, default=500, help="LAMBADA items to score (0: skip).")
    parser.add_argument("--eval-windows", type=int, default=16)
    args = parser.parse_args()

    tokenizer, load = packaged_model(args.model)
    title, config = model_title(load, args.model)
    depth = config.num_hidden_layers
    calibration = assets.wikipedia_split("calibration")
    defaults = PruneOptions()
    data = tokenize_texts(tokenizer, calibration, defaults.seq_len, defaults.num_sequences, defaults.batch_size)
    held_out = held_out_windows(tokenizer, args.eval_windows).batches
    started = time.perf_counter()
    dense = perplexity(load(), held_out, progress=False)
    print(f"{title}, fp32. Calibration: {data.num_tokens} tokens (the default {defaults.num_sequences} x "
          f"{defaults.seq_len}); perplexity on {args.eval_windows} held-out windows of 512 tokens (dense {dense:.2f}); "
          f"LAMBADA: first {args.lambada} items. Share of ghost gain: (log plain - log ppl) / (log plain - log ghost), "
          "plain = the same block plainly removed.\n")
    print("| removed | kind | selection scored by | layers | relative residual | perplexity | gap closed | "
          "share of ghost gain | LAMBADA acc |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    records = []
    for n in args.layers:
        plan = StatisticsPlan.union(statistics_plan(config, PruneOptions(num_layers=n, operator=kind, criterion=criterion))
                                    for kind in args.kinds for criterion in ("ghost-aware", "streamline"))
        stats = collect_statistics(load(), data.batches, plan, progress=False)
        prune = lambda **options: ghost_prune(load(), tokenizer, calibration, statistics=stats, num_layers=n,  # noqa: E731
                                              **options)
        streamline = perplexity(prune(criterion="streamline", operator="none"), held_out, progress=False)
        plain: dict[tuple[int, ...], float] = {}
        ghost: dict[tuple[int, ...], float] = {}
        default_block = prune(operator="none").config.ghost_provenance["selection"]["removed"]
        for kind in args.kinds:
            for scored_by in ("ghost", kind) if kind != "ghost" else ("ghost",):
                options = dict(operator=kind) if scored_by == kind else dict(operator=kind, criterion="manual",
                                                                             layers=default_block)
                model = prune(**options)
                block = tuple(model.config.removed_layers)
                for cache, operator in ((plain, "none"), (ghost, "ghost")):
                    if block not in cache:
                        cache[block] = perplexity(prune(operator=operator, criterion="manual", layers=list(block)),
                                                  held_out, progress=False)
                ppl = perplexity(model, held_out, progress=False)
                share = (math.log(plain[block]) - math.log(ppl)) / (math.log(plain[block]) - math.log(ghost[block]))
                residual = model.config.ghost_boundaries[0]["fit"]["relative_residual"]
                lam = lambada(model, tokenizer, limit=args.lambada, progress=False) if args.lambada else None
                records.append(dict(removed=n, kind=kind, scored_by=scored_by, layers=list(block), perplexity=ppl,
                                    relative_residual=residual, plain=plain[block], ghost=ghost[block],
                                    gap_closed=gap_closed(ppl, streamline, dense), share_of_ghost_gain=share,
                                    lambada=lam))
                cell = f"{lam['accuracy']:.3f} ({lam['accuracy_stderr']:.3f})" if lam else "-"
                print(f"| {n}/{depth} | {kind} | {scored_by} residual | {layer_ranges(list(block))} | {residual:.4f} | "
                      f"{ppl:.2f} | {gap_closed(ppl, streamline, dense):.3f} | {share:.3f} | {cell} |", flush=True)
    print(f"\nTotal {time.perf_counter() - started:.0f} s.")
    print("\n<details><summary>raw results (JSON)</summary>\n\n```json\n" + json.dumps(records, indent=1) +
          "\n```\n</details>")


if __name__ == "__main__":
    main()
