"""Healing at equal compute: LoRA training on the calibration text only (next-token loss, or distillation from
the dense model's logits with `--loss kd`) of starts with the same number of removed layers — the default ghosted
model, the same block plainly removed, LLM-Streamline's block plainly removed, and the `folded` stock export (the
best model servable without custom code) — scored on the held-out windows after each compute budget.
(Results before 2.0 compare 1.0's hand-written loop with `heal` on transformers' Trainer: healing_trainer.md.)

A budget is training compute in CPU-minutes: the process CPU time spent in training (evaluation excluded),
summed over torch's threads (one by default); each budget is its own run, timed by `heal` itself
(`heal(minutes=b, clock=time.process_time)`: the schedule decays to zero over the CPU time, no step starts once
the budget is spent). Training uses every calibration sequence (`eval_sequences=0`): the held-out windows score.

    python benchmarks/healing.py --layers 8 --budgets 2.5 5 10 > benchmarks/results/healing.md
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
from common import held_out_windows, layer_ranges, packaged_model

from ghosted_hf import assets, ghost_prune
from ghosted_hf.evaluate import gap_closed, lambada, perplexity
from ghosted_hf.options import PruneOptions, add_arguments, from_namespace
from ghosted_hf.pipelines.healing import HealOptions, heal
from ghosted_hf.pipelines.prune import statistics_plan
from ghosted_hf.statistics import CalibrationStatistics, collect_statistics
from ghosted_hf.text.tokens import tokenize_texts

STARTS = ("ghosted", "plain", "streamline", "folded")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--budgets", type=float, nargs="+", default=[2.5, 5, 10], help="CPU-minutes.")
    parser.add_argument("--threads", type=int, default=1, help="torch threads.")
    parser.add_argument("--starts", nargs="+", choices=STARTS, default=list(STARTS))
    parser.add_argument("--loss", choices=("lm", "kd"), default="lm",
                        help="lm: next-token loss (ghosted heal's default); kd: KL to the dense model's logits.")
    parser.add_argument("--eval-windows", type=int, default=16)
    parser.add_argument("--lambada", type=int, default=0,
                        help="Also score LAMBADA (first N items: text of another domain than the calibration) after the "
                             "last budget.")
    parser.add_argument("--statistics", default="benchmark-cache/healing-statistics.safetensors",
                        help="Calibration statistics cache (computed once for the default prune options).")
    add_arguments(parser, HealOptions)
    args = parser.parse_args()
    options = dataclasses.replace(from_namespace(HealOptions, args), eval_sequences=0)
    torch.set_num_threads(args.threads)

    tokenizer, load = packaged_model()
    calibration = assets.wikipedia_split("calibration")
    held_out = held_out_windows(tokenizer, args.eval_windows)
    prune = PruneOptions(num_layers=args.layers)
    stats = cached_statistics(Path(args.statistics), load, tokenizer, calibration, prune)
    teacher = load() if args.loss == "kd" else None
    starts: dict[str, torch.nn.Module] = {}

    def start(name: str) -> torch.nn.Module:
        """A fresh copy of the start (the folded export's extra calibration pass is run once)."""
        if name not in starts:
            kind = {"ghosted": {}, "folded": dict(operator="folded"),
                    "plain": dict(operator="none"), "streamline": dict(operator="none", criterion="streamline")}[name]
            starts[name] = ghost_prune(load(), tokenizer, calibration, prune, statistics=stats, **kind)
        copy = type(starts[name])(starts[name].config)
        copy.load_state_dict(starts[name].state_dict())
        return copy.eval()

    started = time.perf_counter()
    dense = perplexity(load(), held_out.batches, progress=False)
    streamline_plain = perplexity(start("streamline"), held_out.batches, progress=False)
    loss = "KL to the dense model's logits" if args.loss == "kd" else "next-token cross-entropy"
    print(f"SmolLM2-135M-Instruct, fp32, {args.layers}/30 layers removed, {args.threads} torch thread(s). Held-out perplexity on "
          f"{held_out.num_tokens} tokens; gap closed between LLM-Streamline's block plainly removed "
          f"({streamline_plain:.2f}) and dense ({dense:.2f}). Healing: LoRA, {loss}, options "
          f"{json.dumps(options.to_dict())}, on the calibration articles.\n")
    print("| start | removed | budget (CPU-min) | steps | CPU s / step | perplexity | gap closed | LAMBADA acc (SE) |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    records = []

    def report(name: str, evaluated: torch.nn.Module, budget: float, steps: int) -> None:
        ppl = perplexity(evaluated, held_out.batches, progress=False)
        closed = gap_closed(ppl, streamline_plain, dense)
        lam = (lambada(evaluated, tokenizer, limit=args.lambada, progress=False)
               if args.lambada and budget == args.budgets[-1] else None)
        removed = starts[name].config.ghost_provenance.get("stock_export", {}).get("removed_layers") \
            or starts[name].config.removed_layers
        records.append(dict(start=name, removed=removed, budget=budget, steps=steps,
                            cpu_s_per_step=budget * 60 / steps if steps else None, perplexity=ppl, gap_closed=closed,
                            lambada=lam))
        cell = f"{lam['accuracy']:.3f} ({lam['accuracy_stderr']:.3f})" if lam else "-"
        per_step = f"{budget * 60 / steps:.2f}" if steps else "-"
        print(f"| {name} | {layer_ranges(removed)} | {budget:g} | {steps} | {per_step} | {ppl:.2f} | "
              f"{closed:.3f} | {cell} |", flush=True)

    for name in args.starts:
        report(name, start(name), 0.0, 0)
        for budget in args.budgets:
            result = heal(start(name), tokenizer, calibration, options, teacher=teacher, progress=False,
                          minutes=budget, clock=time.process_time)
            report(name, result.model, budget, result.record["steps"])
    print(f"\nTotal {time.perf_counter() - started:.0f} s wall.")
    print("\n<details><summary>raw results (JSON)</summary>\n\n```json\n" + json.dumps(records, indent=1) +
          "\n```\n</details>")


def cached_statistics(path: Path, load, tokenizer, calibration, prune: PruneOptions) -> CalibrationStatistics:
    """The statistics every start needs (both criteria, the fit of every contiguous block), computed once."""
    if path.is_file():
        return CalibrationStatistics.load(path)
    model = load()
    batches = tokenize_texts(tokenizer, calibration, prune.seq_len, prune.num_sequences, prune.batch_size).batches
    plan = statistics_plan(model.config, prune) | statistics_plan(model.config, dataclasses.replace(prune, criterion="streamline"))
    stats = collect_statistics(model, batches, plan)
    path.parent.mkdir(parents=True, exist_ok=True)
    stats.save(path)
    return stats


def step_timing_setup(description: str, steps: int) -> tuple[argparse.Namespace, object, list[str], torch.nn.Module]:
    """(arguments, tokenizer, calibration articles, the default ghosted model) of a per-step timing benchmark."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=steps, help="Timed steps per configuration and round.")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--statistics", default="benchmark-cache/healing-statistics.safetensors")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer, load = packaged_model()
    calibration = assets.wikipedia_split("calibration")
    prune = PruneOptions(num_layers=args.layers)
    stats = cached_statistics(Path(args.statistics), load, tokenizer, calibration, prune)
    return args, tokenizer, calibration, ghost_prune(load(), tokenizer, calibration, prune, statistics=stats)


if __name__ == "__main__":
    main()
