"""Quality benchmark on a packaged model (default SmolLM2-135M-Instruct; `--model gemma3-270m`): recovery methods
side by side.

For each number of removed layers and each selection (streamline / ghost-aware contiguous, ShortGPT
scattered), every recovery method is fitted from the SAME calibration statistics (Wikipedia calibration
articles) and scored on the SAME held-out tokens: perplexity on the held-out articles, the fraction of the
log-perplexity gap closed between the standard baseline (LLM-Streamline's block plainly removed, same
number of layers) and the dense model, LAMBADA (OpenAI) last-word accuracy and perplexity (first
`--lambada` items), and zero-shot accuracy (lm-eval, packaged validation data, first `--limit` examples of
each task). With `--heal`, the default method (ghost-aware selection, ghost operator) is also scored
after the default healing (`HealOptions()`, `ghosted heal`'s defaults: LoRA, next-token loss on the calibration
articles); `--heal-only` scores LAMBADA and zero-shot for the healed rows only (the others of an earlier run).

    python benchmarks/quality.py --layers 8 4 --limit 40 \
        --short-methods "no recovery" "ghost independent" "ghost sequential" > benchmarks/results/quality.md
    python benchmarks/quality.py --layers 8 4 --selections ghost-aware --methods "no recovery" "ghost sequential" \
        --heal --lambada 5153 --tasks hellaswag piqa winogrande boolq --limit 700 > benchmarks/results/quality_defaults.md
"""

from __future__ import annotations

import argparse
import json
import time

from common import add_model_argument, held_out_windows, layer_ranges, model_title, packaged_model

from ghosted_hf import assets, ghost_prune
from ghosted_hf.evaluate import ZERO_SHOT_TASKS, gap_closed, lambada, perplexity, zero_shot
from ghosted_hf.fitting.operators import OPERATOR_KINDS
from ghosted_hf.options import PruneOptions
from ghosted_hf.pipelines.healing import DEFAULT_STEPS, HealOptions, heal, merge
from ghosted_hf.fitting.units import boundary_spans
from ghosted_hf.pipelines.prune import statistics_plan
from ghosted_hf.statistics import StatisticsPlan, collect_statistics
from ghosted_hf.text.tokens import tokenize_texts

METHODS = [  # (row name, options)
    ("no recovery", dict(operator="none")),
    ("linearpatch-diag", dict(operator="linearpatch-diag")),
    ("linearpatch-rotate", dict(operator="linearpatch-rotate")),
    ("replaceme-ls (fused)", dict(operator="replaceme-ls")),
    ("folded (c, T; tied)", dict(operator="folded-tied")),
    ("folded", dict(operator="folded")),
    ("ghost independent", dict(operator="ghost", fitting="independent")),
    ("ghost sequential", dict(operator="ghost", fitting="sequential")),
    ("normed", dict(operator="normed")),
    ("ghost-normed", dict(operator="ghost-normed")),
]
SELECTIONS = ["streamline", "ghost-aware", "shortgpt"]
DEFAULT = ("ghost-aware", "ghost sequential")  # PruneOptions() defaults: the row --heal heals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_argument(parser)
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 4])
    parser.add_argument("--selections", nargs="+", choices=SELECTIONS, default=SELECTIONS)
    parser.add_argument("--methods", nargs="+", default=[name for name, _ in METHODS], help="Rows to run.")
    parser.add_argument("--short-methods", nargs="+", default=None,
                        help="Rows to run for layer counts after the first (default: all).")
    parser.add_argument("--heal", action="store_true", help="Also score the default row after the default healing.")
    parser.add_argument("--heal-steps", type=int, default=DEFAULT_STEPS, help="Healing steps (a quick check).")
    parser.add_argument("--heal-only", action="store_true",
                        help="With --heal: LAMBADA and zero-shot only for the healed rows (perplexity for all).")
    parser.add_argument("--lambada", type=int, default=0, help="LAMBADA items to score (5153: all; 0: skip).")
    parser.add_argument("--tasks", nargs="+", default=list(ZERO_SHOT_TASKS), choices=list(ZERO_SHOT_TASKS))
    parser.add_argument("--limit", type=int, default=40, help="Zero-shot examples per task (0: skip zero-shot).")
    parser.add_argument("--eval-windows", type=int, default=16)
    parser.add_argument("--num-sequences", type=int, default=PruneOptions().num_sequences)
    parser.add_argument("--seq-len", type=int, default=PruneOptions().seq_len)
    args = parser.parse_args()

    tokenizer, load = packaged_model(args.model)
    title, config = model_title(load, args.model)
    depth = config.num_hidden_layers
    calibration = assets.wikipedia_split("calibration")
    held_out = held_out_windows(tokenizer, args.eval_windows)
    cal_data = tokenize_texts(tokenizer, calibration, args.seq_len, args.num_sequences, 4)
    healing = HealOptions(max_steps=args.heal_steps)

    def score(model, healed: bool = False) -> dict:
        result = {"ppl": perplexity(model, held_out.batches, progress=False)}
        if args.heal_only and not healed:
            return result
        if args.lambada:
            result["lambada"] = lambada(model, tokenizer, limit=args.lambada, progress=False)
        if args.limit:
            accs = zero_shot(model, tokenizer, args.tasks, limit=args.limit)
            result["zero_shot"] = accs
            result["avg_acc"] = sum(a["acc"] for a in accs.values()) / len(accs)
            result["max_stderr"] = max(a["acc_stderr"] for a in accs.values())
        return result

    def row(n: int, selection: str, removed: list[int], label: str, result: dict, baseline: float) -> str:
        lam = result.get("lambada", {})
        cells = [f"{n}/{depth}" if n else "0", selection, layer_ranges(removed) if removed else "-", label, f"{result['ppl']:.2f}",
                 f"{gap_closed(result['ppl'], baseline, dense['ppl']):.3f}" if n else "-",
                 f"{lam['accuracy']:.3f}" if lam else "-", f"{lam['perplexity']:.1f}" if lam else "-",
                 f"{result['avg_acc']:.3f} (SE <= {result['max_stderr']:.3f})" if "avg_acc" in result else "-"]
        return "| " + " | ".join(cells) + " |"

    started = time.perf_counter()
    dense = score(load())
    zero = (f"first {args.limit} validation examples of {', '.join(args.tasks)}; accuracy averaged over tasks, with "
            "the largest per-task standard error" if args.limit else "not run")
    print(f"{title}, fp32. Perplexity: {held_out.num_tokens} held-out tokens "
          f"({args.eval_windows} windows of 512). Calibration: {cal_data.num_tokens} tokens "
          f"({args.num_sequences} x {args.seq_len}). LAMBADA: first {args.lambada} items. Zero-shot: {zero}. "
          f"Healing: {'LoRA, next-token loss, ' + json.dumps(healing.to_dict()) if args.heal else 'not run'}.\n")
    print("| removed | selection | layers | method | perplexity | gap closed | LAMBADA acc | LAMBADA ppl | zero-shot acc |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(row(0, "-", [], "dense", dense, dense["ppl"]), flush=True)
    records = {"dense": dense}
    for index, n in enumerate(args.layers):
        methods = args.methods if index == 0 or args.short_methods is None else args.short_methods
        baseline = None  # the standard baseline: LLM-Streamline's block plainly removed
        criteria = ["streamline"] + [c for c in args.selections if c != "streamline"]
        # One dense pass serves every selection (and, for ghost-aware, the fit of every contiguous block).
        calibration_options = dict(num_layers=n, num_sequences=args.num_sequences, seq_len=args.seq_len)
        selection_stats = collect_statistics(load(), cal_data.batches, StatisticsPlan.union(
            statistics_plan(config, PruneOptions(criterion=c, **calibration_options)) for c in criteria), progress=False)
        kinds = {OPERATOR_KINDS[m["operator"]] for name, m in METHODS if name in methods or name == "no recovery"}
        for criterion in criteria:
            removed = ghost_prune(load(), tokenizer, calibration, statistics=selection_stats, criterion=criterion,
                                  operator="none", **calibration_options).config.ghost_provenance["selection"]["removed"]
            options = PruneOptions(criterion="manual", layers=removed, num_sequences=args.num_sequences, seq_len=args.seq_len)
            spans = boundary_spans(depth, removed)
            plan = StatisticsPlan.union(kind.statistics(s, e) for kind in kinds for s, e in spans
                                        if s >= kind.first_removable).missing_from(selection_stats.tensors)
            stats = (selection_stats.with_tensors(collect_statistics(load(), cal_data.batches, plan, progress=False))
                     if plan else selection_stats)
            for name, method in METHODS:
                is_baseline = name == "no recovery" and criterion == "streamline"
                if not is_baseline and (name not in methods or criterion not in args.selections):
                    continue
                if removed[0] < OPERATOR_KINDS[method["operator"]].first_removable:
                    continue
                if method.get("fitting") == "independent" and len(spans) == 1:
                    continue  # one boundary: identical to sequential
                model = ghost_prune(load(), tokenizer, calibration, options, statistics=stats, **method)
                result = score(model)
                baseline = baseline or result["ppl"]
                label = "ghost" if len(spans) == 1 and name.startswith("ghost ") else name  # one boundary: one fit
                if is_baseline and criterion not in args.selections:
                    label += " (baseline)"
                print(row(n, criterion, removed, label, result, baseline), flush=True)
                records[f"{n}/{criterion}/{name}"] = {"removed": removed, **result}
                if args.heal and (criterion, name) == DEFAULT:
                    healed = merge(heal(model, tokenizer, calibration, healing, progress=False))
                    result = score(healed, healed=True)
                    print(row(n, criterion, removed, label + " + default healing", result, baseline), flush=True)
                    records[f"{n}/{criterion}/{name}/healed"] = {"removed": removed, **result}
    print(f"\nTotal {time.perf_counter() - started:.0f} s.")
    print("\n<details><summary>raw results (JSON)</summary>\n\n```json\n" + json.dumps(records, indent=1) + "\n```\n</details>")


if __name__ == "__main__":
    main()
