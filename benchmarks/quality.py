"""Quality benchmark on the packaged SmolLM2-135M-Instruct (30 layers): recovery methods side by side.

For each number of removed layers and each selection (streamline / ghost-aware contiguous, ShortGPT
scattered), every recovery method is fitted from the SAME calibration statistics (Wikipedia calibration
articles) and scored on the SAME held-out tokens: perplexity on the held-out articles, the fraction of the
log-perplexity gap closed between the standard baseline (LLM-Streamline's block plainly removed, same
number of layers) and the dense model, and zero-shot accuracy (lm-eval, packaged validation data, first
`--limit` examples of each task).

    python benchmarks/quality.py --layers 8 4 --limit 40 \
        --short-methods "no recovery" "ghost independent" "ghost sequential" > benchmarks/results/quality.md
"""

from __future__ import annotations

import argparse
import json
import time

from ghosted_hf import assets, ghost_prune
from ghosted_hf.calibration import StatisticsPlan, collect_statistics
from ghosted_hf.data import tokenize_texts
from ghosted_hf.evaluate import ZERO_SHOT_TASKS, gap_closed, perplexity, zero_shot
from ghosted_hf.operators import OPERATOR_KINDS
from ghosted_hf.options import PruneOptions
from ghosted_hf.recipe import boundary_spans

from common import held_out_windows, packaged_model

METHODS = [  # (row name, options)
    ("no recovery", dict(operator="none")),
    ("linearpatch-diag", dict(operator="linearpatch-diag")),
    ("linearpatch-rotate", dict(operator="linearpatch-rotate")),
    ("replaceme-ls (fused)", dict(operator="replaceme-ls")),
    ("folded (c, Q only)", dict(operator="folded-cq")),
    ("folded (c, T; tied)", dict(operator="folded-tied")),
    ("folded", dict(operator="folded")),
    ("ghost independent", dict(operator="ghost", fitting="independent")),
    ("ghost sequential", dict(operator="ghost", fitting="sequential")),
]
SELECTIONS = ["streamline", "ghost-aware", "shortgpt"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 4])
    parser.add_argument("--limit", type=int, default=40, help="Zero-shot examples per task (0: skip zero-shot).")
    parser.add_argument("--methods", nargs="+", default=[name for name, _ in METHODS], help="Rows to run.")
    parser.add_argument("--short-methods", nargs="+", default=None,
                        help="Rows to run for layer counts after the first (default: all).")
    parser.add_argument("--eval-windows", type=int, default=16)
    parser.add_argument("--num-sequences", type=int, default=PruneOptions().num_sequences)
    parser.add_argument("--seq-len", type=int, default=PruneOptions().seq_len)
    args = parser.parse_args()

    tokenizer, load = packaged_model()
    calibration = assets.wikipedia_split("calibration")
    held_out = held_out_windows(tokenizer, args.eval_windows)
    cal_data = tokenize_texts(tokenizer, calibration, args.seq_len, args.num_sequences, 4)
    tasks = list(ZERO_SHOT_TASKS)

    def score(model) -> dict:
        result = {"ppl": perplexity(model, held_out.batches, progress=False)}
        if args.limit:
            accs = zero_shot(model, tokenizer, tasks, limit=args.limit)
            result["zero_shot"] = accs
            result["avg_acc"] = sum(a["acc"] for a in accs.values()) / len(accs)
        return result

    started = time.perf_counter()
    dense = score(load())
    print(f"SmolLM2-135M-Instruct (dequantized Q4_1), fp32. Perplexity: {held_out.num_tokens} held-out tokens "
          f"({args.eval_windows} windows of 512). Calibration: {cal_data.num_tokens} tokens "
          f"({args.num_sequences} x {args.seq_len}). Zero-shot: first {args.limit} validation examples of "
          f"{', '.join(tasks)}; accuracy averaged over tasks.\n")
    print("| removed | selection | layers | method | perplexity | gap closed | avg zero-shot acc |")
    print("|---|---|---|---|---|---|---|")
    print(f"| 0 | - | - | dense | {dense['ppl']:.2f} | - | {dense.get('avg_acc', float('nan')):.3f} |", flush=True)
    records = {"dense": dense}
    for index, n in enumerate(args.layers):
        methods = args.methods if index == 0 or args.short_methods is None else args.short_methods
        baseline = None  # the standard baseline: LLM-Streamline's block plainly removed
        for criterion in SELECTIONS:
            removed = ghost_prune(load(), tokenizer, calibration, num_layers=n, criterion=criterion, operator="none",
                                  num_sequences=args.num_sequences, seq_len=args.seq_len).config.removed_layers
            options = PruneOptions(criterion="manual", layers=removed, num_sequences=args.num_sequences, seq_len=args.seq_len)
            spans = boundary_spans(30, removed)
            plan = StatisticsPlan.union(kind.statistics(s, e) for kind in OPERATOR_KINDS.values() for s, e in spans
                                        if s >= kind.first_removable)
            stats = collect_statistics(load(), cal_data.batches, plan, progress=False)
            for name, method in METHODS:
                if name not in methods and not (name == "no recovery" and criterion == "streamline"):
                    continue
                if removed[0] < OPERATOR_KINDS[method["operator"]].first_removable:
                    continue
                if method.get("fitting") == "independent" and len(spans) == 1:
                    continue  # one boundary: identical to sequential
                model = ghost_prune(load(), tokenizer, calibration, options, statistics=stats, **method)
                result = score(model)
                baseline = baseline or result["ppl"]
                closed = gap_closed(result["ppl"], baseline, dense["ppl"])
                label = name if len(spans) > 1 or "ghost" not in name else "ghost"
                print(f"| {n}/30 | {criterion} | {_ranges(removed)} | {label} | {result['ppl']:.2f} | {closed:.2f} | "
                      f"{result.get('avg_acc', float('nan')):.3f} |", flush=True)
                records[f"{n}/{criterion}/{name}"] = {"removed": removed, **result}
    print(f"\nTotal {time.perf_counter() - started:.0f} s.")
    print("\n<details><summary>raw results (JSON)</summary>\n\n```json\n" + json.dumps(records, indent=1) + "\n```\n</details>")


def _ranges(layers: list[int]) -> str:
    runs, start = [], layers[0]
    for a, b in zip(layers, layers[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}-{a}" if a != start else f"{a}")
            start = b
    return ",".join(runs)


if __name__ == "__main__":
    main()
