"""No map where plain removal costs less? (issue #51 item 1): each sub-block's damage removed plainly (its output
dropped, no map) beside its damage replaced by its map, each priced per parameter it saves, and whether offering
plain removal changes the criterion's choice.

Both damages are the criterion's (`fitting.subblocks.damages`: the rise of the calibration loss with the candidate
alone replaced, on the first `damage_sequences` of 32 x 512 calibration tokens, as benchmarks/subblocks.py). The
mapped damages and map sizes come from the criterion cache benchmarks/subblocks.py writes (run it first); the plain
ones are computed here (a zero map: what the sub-block returns dropped) and cached beside it. A candidate is priced
per parameter saved: mapped, damage / (its parameters - its map's); plain, damage / its parameters. The choice at each
budget is made with `choose_to_budget` twice: mapped only, and with each candidate's cheaper option.

    python benchmarks/subblock_nomap.py --model smollm2-135m-instruct > benchmarks/results/subblock_nomap.md
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from common import CALIBRATION, add_model_argument, packaged_model

from ghosted_hf import assets
from ghosted_hf.fitting import subblocks as sb
from ghosted_hf.options import PruneOptions, budget_share
from ghosted_hf.pipelines.prune import decoder_parameters
from ghosted_hf.statistics import Calibrator, FullModelPass
from ghosted_hf.text.tokens import tokenize_texts


def plain_damages(model, tokenizer, candidates: list[sb.SubBlockRef]) -> dict[str, float]:
    """Each candidate's damage with its output dropped, on the criterion's scored batches."""
    options = PruneOptions(**CALIBRATION)
    calibrator = Calibrator(FullModelPass(model), tokenize_texts(tokenizer, assets.wikipedia_split("calibration"),
                                                                 **CALIBRATION))
    outputs, width = calibrator.subblock_outputs((r.layer, r.block) for r in candidates), model.config.hidden_size
    dropped = {ref: sb.SubBlockFit(ref, torch.zeros(width, width, dtype=torch.float64), outputs[(ref.layer, ref.block)])
               for ref in candidates}
    scored = calibrator.first_batches(-(-options.damage_sequences // options.batch_size))
    return {ref.name: value for ref, value in sb.damages(scored, dropped).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_argument(parser)
    parser.add_argument("--budgets", nargs="+", default=["12.5%", "25%", "37.5%"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    criterion = Path("benchmark-cache") / f"subblock-criterion-{args.model}.json"
    if not criterion.is_file():
        raise SystemExit(f"{criterion} is missing: run `python benchmarks/subblocks.py --model {args.model}` first.")
    stored = json.loads(criterion.read_text())
    tokenizer, load = packaged_model(args.model)
    model = load()
    width, total = model.config.hidden_size, decoder_parameters(model)
    candidates = sb.all_subblocks(model.config.num_hidden_layers)
    cache, started, took = Path("benchmark-cache") / f"subblock-nomap-{args.model}.json", time.perf_counter(), "cached"
    if not cache.is_file():
        cache.write_text(json.dumps(plain_damages(model, tokenizer, candidates), indent=1))
        took = f"{time.perf_counter() - started:.0f} s"
    plain = {sb.parse_subblock(name): value for name, value in json.loads(cache.read_text()).items()}
    size = {ref: sb.subblock_parameters(model, ref) for ref in candidates}
    mapped = {ref: stored["damage"][ref.name] for ref in candidates}
    saved = {ref: size[ref] - stored.get("map_parameters", {}).get(ref.name, width * width) for ref in candidates}
    cost = {ref: max(mapped[ref], 0.0) / saved[ref] for ref in candidates}
    plain_cost = {ref: max(plain[ref], 0.0) / size[ref] for ref in candidates}
    cheaper = sorted(ref for ref in candidates if plain_cost[ref] < cost[ref])
    print(f"# No map where plain removal costs less? (issue #51 item 1)\n\n`python benchmarks/subblock_nomap.py --model "
          f"{args.model}` ({args.threads} threads; the plain damages: {took})\n\n{args.model}: {len(candidates)} "
          "sub-blocks; damage in nats of calibration loss, cost = damage per million parameters saved. Sorted by the "
          "mapped cost (the criterion's order).\n")
    print("| sub-block | parameters | map | mapped damage | plain damage | mapped cost | plain cost | plain / mapped |")
    print("|---|---|---|---|---|---|---|---|")
    for ref in sorted(candidates, key=lambda r: (cost[r], r)):
        ratio = f"{plain_cost[ref] / cost[ref]:.2f}" if cost[ref] > 0 else "-"
        print(f"| {ref.name} | {size[ref]:,} | {size[ref] - saved[ref]:,} | {mapped[ref]:+.4f} | {plain[ref]:+.4f} | "
              f"{cost[ref] * 1e6:.4f} | {plain_cost[ref] * 1e6:.4f} | {ratio} |")
    print(f"\nPlain removal costs less per parameter saved for {len(cheaper)} of {len(candidates)}: "
          f"{', '.join(r.name for r in cheaper) or 'none'}.\n")
    print("| budget | mapped only: chosen | with the cheaper option: chosen | plainly removed among them | same choice |")
    print("|---|---|---|---|---|")
    for budget in args.budgets:
        goal = round(budget_share(budget) * total)
        alone = sb.choose_to_budget(mapped, saved, goal)
        option = {ref: (plain[ref], size[ref]) if ref in cheaper else (mapped[ref], saved[ref]) for ref in candidates}
        both = sb.choose_to_budget({r: d for r, (d, _) in option.items()}, {r: s for r, (_, s) in option.items()}, goal)
        print(f"| {budget} | {len(alone)} | {len(both)} | {', '.join(r.name for r in both if r in cheaper) or '-'} | "
              f"{'yes' if alone == both else 'no'} |")


if __name__ == "__main__":
    main()
