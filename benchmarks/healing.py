"""Healing at equal compute: LoRA training on the calibration text only (next-token loss, or distillation from
the dense model's logits with `--loss kd`) of three starts with the same number of removed layers — the default
ghosted model, the same block plainly removed, and LLM-Streamline's block plainly removed — scored on the held-out
windows after each compute budget.

A budget is training compute in CPU-minutes: the process CPU time spent in `heal` (evaluation excluded),
summed over torch's threads (one by default). On a machine of shared virtual cores a step's CPU time still
varies with what the host runs beside it (3.9 to 6.6 s for the same step here), so the tables give steps too.
With a constant learning rate the model after budget b of one run is the model a run with budget b would give,
so one run per start serves every budget; with a schedule (the default decays to zero) each budget is its own
run, timed by `heal(minutes=b, clock=time.process_time)`: the schedule decays over the CPU time, and no step
starts once the budget is spent.

    python benchmarks/healing.py --layers 8 --budgets 2.5 5 10 > benchmarks/results/healing.md
    python benchmarks/healing.py --layers 8 --budgets 10 --starts ghosted --lr 1e-3 --schedule constant --lambada 500
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from ghosted_hf import assets, ghost_prune, prune_layers
from ghosted_hf.statistics import CalibrationStatistics, collect_statistics
from ghosted_hf.data import tokenize_texts
from ghosted_hf.evaluate import gap_closed, lambada, perplexity
from ghosted_hf.healing import HealOptions, heal
from ghosted_hf.options import PruneOptions, add_arguments, from_namespace
from ghosted_hf.recipe import statistics_plan

from common import held_out_windows, layer_ranges, packaged_model

STARTS = ("ghosted", "plain", "streamline")


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
    options = from_namespace(HealOptions, args)
    torch.set_num_threads(args.threads)

    tokenizer, load = packaged_model()
    calibration = assets.wikipedia_split("calibration")
    held_out = held_out_windows(tokenizer, args.eval_windows)
    prune = PruneOptions(num_layers=args.layers)
    stats = cached_statistics(Path(args.statistics), load, tokenizer, calibration, prune)
    teacher = load() if args.loss == "kd" else None

    def start(name: str) -> torch.nn.Module:
        if name == "ghosted":
            return ghost_prune(load(), tokenizer, calibration, prune, statistics=stats)
        criterion = "ghost-aware" if name == "plain" else "streamline"
        stock = ghost_prune(load(), tokenizer, calibration, prune, statistics=stats, criterion=criterion, operator="none")
        # heal takes a ghosted model: the same plainly pruned network, with identity operators
        return prune_layers(load(), stock.config.ghost_provenance["stock_export"]["removed_layers"])

    started = time.perf_counter()
    dense = perplexity(load(), held_out.batches, progress=False)
    streamline_plain = perplexity(start("streamline"), held_out.batches, progress=False)
    loss = "KL to the dense model's logits" if args.loss == "kd" else "next-token cross-entropy"
    print(f"SmolLM2-135M-Instruct, fp32, {args.layers}/30 layers removed, {args.threads} torch thread(s). Held-out perplexity on "
          f"{held_out.num_tokens} tokens; gap closed between LLM-Streamline's block plainly removed "
          f"({streamline_plain:.2f}) and dense ({dense:.2f}). Healing: LoRA, {loss}, options "
          f"{json.dumps(options.to_dict())}, on the calibration articles.\n")
    print("| start | removed | budget (CPU-min) | steps | perplexity | gap closed | LAMBADA acc (SE) |")
    print("|---|---|---|---|---|---|---|", flush=True)
    records = []

    def report(name: str, evaluated: torch.nn.Module, budget: float, steps: int, spent: float) -> None:
        ppl = perplexity(evaluated, held_out.batches, progress=False)
        closed = gap_closed(ppl, streamline_plain, dense)
        lam = (lambada(evaluated, tokenizer, limit=args.lambada, progress=False)
               if args.lambada and budget == args.budgets[-1] else None)
        removed = evaluated.config.removed_layers
        records.append(dict(start=name, removed=removed, budget=budget, steps=steps, minutes=spent / 60,
                            perplexity=ppl, gap_closed=closed, lambada=lam))
        cell = f"{lam['accuracy']:.3f} ({lam['accuracy_stderr']:.3f})" if lam else "-"
        print(f"| {name} | {layer_ranges(removed)} | {budget:g} | {steps} | {ppl:.2f} | {closed:.3f} | {cell} |",
              flush=True)

    def train(name: str, model: torch.nn.Module, budgets: list[float], steps: int) -> None:
        """Heal for `steps` steps, reporting whenever the CPU time spent crosses a budget (and after the last step)."""
        spent, clock = 0.0, time.process_time()

        def after_step(peft_model: torch.nn.Module, losses: list[float]) -> bool:
            nonlocal spent, clock
            spent += time.process_time() - clock
            while budgets and (spent >= budgets[0] * 60 or len(losses) == steps):
                report(name, peft_model.eval(), budgets.pop(0), len(losses), spent)
            clock = time.process_time()
            return not budgets

        heal(model, tokenizer, calibration, options, teacher=teacher, progress=False, after_step=after_step,
             steps=steps)

    for name in args.starts:
        model = start(name)
        report(name, model, 0.0, 0, 0.0)
        if options.schedule == "constant":  # the model after budget b of one run is that of a run of budget b
            train(name, model, list(args.budgets), 10**6)
            continue
        for budget in args.budgets:  # the schedule ends with the budget: one run per budget
            clock = time.process_time()
            healed, losses, _ = heal(start(name), tokenizer, calibration, options, teacher=teacher, progress=False,
                                     minutes=budget, clock=time.process_time)
            report(name, healed, budget, len(losses), time.process_time() - clock)
    print(f"\nTotal {time.perf_counter() - started:.0f} s wall.")
    print("\n<details><summary>raw results (JSON)</summary>\n\n```json\n" + json.dumps(records, indent=1) +
          "\n```\n</details>")


def cached_statistics(path: Path, load, tokenizer, calibration, prune: PruneOptions) -> CalibrationStatistics:
    """The statistics every start needs (both criteria, the fit of every contiguous block), computed once."""
    if path.is_file():
        return CalibrationStatistics.load(path)
    model = load()
    batches = tokenize_texts(tokenizer, calibration, prune.seq_len, prune.num_sequences, prune.batch_size).batches
    depth = model.config.num_hidden_layers
    plan = statistics_plan(depth, prune) | statistics_plan(depth, dataclasses.replace(prune, criterion="streamline"))
    stats = collect_statistics(model, batches, plan)
    path.parent.mkdir(parents=True, exist_ok=True)
    stats.save(path)
    return stats


if __name__ == "__main__":
    main()
