"""Selection- and data-side levers on the packaged SmolLM2-135M-Instruct (30 layers), against the defaults
(ghost-aware contiguous selection, ghost operator, sequential fitting, 128 x 512 tokens of the packaged
Wikipedia calibration split, plain text):

- split removals: the layers removed as up to 2 or 3 separate blocks (`max_blocks`), chosen by the sum of
  each block's dense-model relative residual (cheap: one statistics pass serves every candidate); the best
  removal in exactly two blocks is also built (sequentially fitted) to see whether the score ranks it right;
  `--verify N` sets `verify_candidates` (each later boundary of each candidate costs one calibration pass);
- chat-template calibration text (`calibration_format chat`): every sequence is whole conversations, the
  text as the assistant's reply to a short user request, same number of sequences and tokens;
- sequence length 2048 at equal tokens (32 x 2048 instead of 128 x 512).

Every row is scored on the same held-out windows as benchmarks/plain_export.py; "gap closed" is
`evaluate.gap_closed` against LLM-Streamline's block plainly removed (as in benchmarks/quality.py).

    PYTHONPATH=. python benchmarks/levers_selection.py --layers 8 4 > benchmarks/results/levers_selection.md
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from functools import partial
from pathlib import Path

import torch
from common import held_out_windows, layer_ranges, packaged_model

from ghosted_hf import assets, ghost_prune
from ghosted_hf.calibration import (
    CalibrationStatistics,
    StatisticsPlan,
    collect_statistics,
)
from ghosted_hf.data import tokenize_texts
from ghosted_hf.evaluate import gap_closed, perplexity
from ghosted_hf.options import PruneOptions
from ghosted_hf.recipe import selection_request, statistics_plan
from ghosted_hf.selection import candidate_layers, criterion

logger = logging.getLogger("levers_selection")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 4])
    parser.add_argument("--eval-windows", type=int, default=16)
    parser.add_argument("--max-blocks", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--verify", type=int, default=1,
                        help="verify_candidates of the split rows (each later boundary of each costs one pass).")
    parser.add_argument("--stats-cache", default=None, help="Folder to keep the dense statistics in between runs.")
    parser.add_argument("--skip", nargs="*", default=[], choices=["split", "chat", "seq2048"])
    parser.add_argument("--num-sequences", type=int, default=PruneOptions().num_sequences,
                        help="Sequences of 512 (a quarter as many of 2048); fewer only for a quick check.")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    tokenizer, load = packaged_model()
    calibration = assets.wikipedia_split("calibration")
    held_out = held_out_windows(tokenizer, args.eval_windows).batches
    started = time.perf_counter()
    dense = perplexity(load(), held_out, progress=False)
    sequences = args.num_sequences
    data = {"plain": tokenize_texts(tokenizer, calibration, 512, sequences, 4)}
    if "chat" not in args.skip:
        data["chat"] = tokenize_texts(tokenizer, calibration, 512, sequences, 4, text_format="chat")
    if "seq2048" not in args.skip:
        data["seq2048"] = tokenize_texts(tokenizer, calibration, 2048, sequences // 4, 4)

    # One dense pass per calibration set serves every selection at every depth (and every single-block fit).
    def plan(**overrides) -> StatisticsPlan:
        return StatisticsPlan.union(statistics_plan(30, PruneOptions(num_layers=n, **overrides)) for n in args.layers)

    plans = {"plain": plan(max_blocks=max(args.max_blocks, default=1)) | plan(criterion="streamline"),
             "chat": plan(), "seq2048": plan()}
    stats = {}
    for name, batches in data.items():
        t = time.perf_counter()
        cached = Path(args.stats_cache) / f"{name}-{sequences}-{'-'.join(map(str, args.layers))}.safetensors" \
            if args.stats_cache else None
        if cached is not None and cached.exists():
            stats[name] = CalibrationStatistics.load(cached)
        else:
            stats[name] = collect_statistics(load(), batches.batches, plans[name], progress=False)
            if cached is not None:
                cached.parent.mkdir(parents=True, exist_ok=True)
                stats[name].save(cached)
        logger.info("statistics %s: %.0f s", name, time.perf_counter() - t)

    print(f"SmolLM2-135M-Instruct (dequantized Q4_1), fp32; dense perplexity {dense:.2f} on {args.eval_windows} "
          f"held-out windows of 512. Calibration: {data['plain'].num_tokens} tokens of the packaged Wikipedia "
          "calibration split unless the lever says otherwise. Gap closed: against LLM-Streamline's block plainly "
          "removed. Score: sum over blocks of the dense-model relative residual ||X_s W - X_e||^2 / ||X_e||^2 (the "
          "selection score); fitted: the same sum with later boundaries refitted sequentially (as built).\n")
    print("| removed | lever | layers | score | fitted | perplexity | gap closed |")
    print("|---|---|---|---|---|---|---|", flush=True)
    records = {"dense": dense}

    def report(n: int, baseline: float, lever: str, model, note: dict | None = None) -> None:
        prov = model.config.ghost_provenance
        removed = model.config.removed_layers
        fitted = sum(b["fit"].get("residual_vs_target", float("nan")) for b in model.config.ghost_boundaries)
        score = prov["selection"]["scores"].get(layer_ranges(removed), (note or {}).get("scored_as"))
        ppl = perplexity(model, held_out, progress=False)
        score_text = f"{score:.4f}" if score is not None else "-"
        print(f"| {n}/30 | {lever} | {layer_ranges(removed)} | {score_text} | {fitted:.4f} | {ppl:.2f} | "
              f"{gap_closed(ppl, baseline, dense):.3f} |", flush=True)
        records[f"{n}/{lever}"] = {"removed": removed, "perplexity": ppl, "fitted": fitted, "score": score,
                                   "selection": {k: v for k, v in prov["selection"].items() if k != "block_scores"},
                                   "cost_seconds": prov["cost"]["seconds"], **(note or {})}

    later = []  # (depth, baseline, candidate, rank, score): built last, each costs a sequential calibration pass
    for n in args.layers:
        request = selection_request(30, PruneOptions(num_layers=n, criterion="streamline"))
        streamline = criterion("streamline").select(stats["plain"], request).removed
        baseline = perplexity(ghost_prune(load(), tokenizer, calibration, statistics=stats["plain"],
                                          criterion="manual", layers=streamline, operator="none",
                                          num_sequences=sequences), held_out,
                              progress=False)
        print(f"| {n}/30 | LLM-Streamline block plainly removed (baseline) | {layer_ranges(streamline)} | - | - | "
              f"{baseline:.2f} | 0.000 |", flush=True)

        row = partial(report, n, baseline)
        row("default (1 block)", ghost_prune(load(), tokenizer, calibration, statistics=stats["plain"], num_layers=n,
                                              num_sequences=sequences))
        if "split" not in args.skip:
            for blocks in args.max_blocks:
                split = ghost_prune(load(), tokenizer, calibration, statistics=stats["plain"], num_layers=n,
                                    max_blocks=blocks, verify_candidates=args.verify, num_sequences=sequences)
                lever = f"up to {blocks} blocks" + (f", best {args.verify} verified" if args.verify > 1 else "")
                row(lever, split)
                scores = split.config.ghost_provenance["selection"]["scores"]
                ranked = sorted(scores, key=lambda name: (scores[name], name))
                best_split = next((name for name in ranked if "," in name), None)
                if blocks == 2 and best_split and candidate_layers(best_split) != split.config.removed_layers:
                    later.append((n, baseline, best_split, ranked.index(best_split) + 1, scores[best_split]))
        if "chat" not in args.skip:
            row("chat template (assistant turns)", ghost_prune(load(), tokenizer, calibration, statistics=stats["chat"],
                                                               num_layers=n, calibration_format="chat",
                                                               num_sequences=sequences))
        if "seq2048" not in args.skip:
            row("32 x 2048 tokens", ghost_prune(load(), tokenizer, calibration, statistics=stats["seq2048"],
                                                num_layers=n, seq_len=2048, num_sequences=sequences // 4))
    for n, baseline, name, rank, score in later:  # the best removal in two blocks, built as ghost_prune builds it
        report(n, baseline, f"best 2-block split (score rank {rank})",
               ghost_prune(load(), tokenizer, calibration, statistics=stats["plain"], criterion="manual",
                           layers=candidate_layers(name), num_sequences=sequences), {"scored_as": score})
    print(f"\nTotal {time.perf_counter() - started:.0f} s on 2 CPU cores shared with other jobs.")
    print("\n<details><summary>raw results (JSON)</summary>\n\n```json\n" + json.dumps(records, indent=1) +
          "\n```\n</details>")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
