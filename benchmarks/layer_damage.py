"""Whole layers chosen by their measured damage (issue #51, item 2): damage measured on the calibration text the
operators were fitted on, or on calibration text they never saw; and that unseen text as the referee between choices.

    python benchmarks/layer_damage.py --model smollm2-135m-instruct    # appends to benchmarks/results/layer_damage.md
    python benchmarks/layer_damage.py --model gemma3-270m

Each layer's damage is the rise of the calibration loss with it alone removed and its boundary's ghost operator fitted
on the dense model (`candidate_fits`, `damages`: how unit 'mixed' measures a whole layer), measured on the first 16
of the 32 fit sequences ("seen": what the sub-block criterion measures on) and on the 16 sequences after them
("unseen"); computed once per model (benchmark-cache/layer-damage-<model>.json). Per budget (a share of the decoder
layers' parameters) the rows are ghost_prune's default choice (`remove=b`: the contiguous run its criterion scores by
fit residual) and as many layers of least damage, runs or not, by each measure. Every row is fitted by ghost_prune on
the 32 sequences (criterion 'manual', sequential fits) and scored: perplexity ratio to the dense model on the seen and
the unseen calibration sequences, and on the held-out sources (16 windows of 512 of the Wikipedia evaluation articles
and of gensim's news articles). "referee" marks, per budget, the row with the lowest ratio on the unseen sequences.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
from common import CALIBRATION, add_model_argument, criterion_fits, held_out_sources, layer_ranges, packaged_model

from ghosted_hf import assets, ghost_prune
from ghosted_hf.evaluate import perplexity
from ghosted_hf.fitting import subblocks as sb
from ghosted_hf.options import PruneOptions
from ghosted_hf.statistics import Calibrator, FullModelPass
from ghosted_hf.text.tokens import tokenize_texts

UNSEEN = 16  # calibration sequences after the fit's, for the unseen damages and ratios


def layer_damages(model, tokenizer, texts: list[str], unseen) -> dict[str, dict[str, float]]:
    """{"seen": ..., "unseen": ...}: each layer's damage with its own operator, on the first damage_sequences of the fit
    sequences and on the unseen ones."""
    depth = model.config.get_text_config().num_hidden_layers
    fits, seen = criterion_fits(model, tokenizer, texts, [sb.SubBlockRef(i, sb.LAYER) for i in range(depth)],
                                CALIBRATION)
    return {name: {ref.name: value for ref, value in sb.damages(calibrator, fits).items()}
            for name, calibrator in (("seen", seen), ("unseen", Calibrator(FullModelPass(model), unseen)))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_argument(parser)
    parser.add_argument("--budgets", nargs="+", default=["12.5%", "25%", "37.5%"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--output", default="benchmarks/results/layer_damage.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer, load = packaged_model(args.model)
    calibration = assets.wikipedia_split("calibration")
    windows = tokenize_texts(tokenizer, calibration, **{**CALIBRATION, "num_sequences": CALIBRATION["num_sequences"] + UNSEEN})
    fitted, seen = (n // CALIBRATION["batch_size"] for n in (CALIBRATION["num_sequences"],
                                                              PruneOptions(**CALIBRATION).damage_sequences))
    scored = {"seen": windows.batches[:seen], "unseen": windows.batches[fitted:]}  # (seen: what criterion_fits scores)
    held_out = held_out_sources(tokenizer)
    dense = load()
    reference = {name: perplexity(dense, batches, progress=False) for name, batches in {**scored, **held_out}.items()}
    cache = Path("benchmark-cache") / f"layer-damage-{args.model}.json"
    if cache.is_file():
        stored = json.loads(cache.read_text())
    else:
        started = time.perf_counter()
        stored = layer_damages(dense, tokenizer, calibration, dataclasses.replace(windows, batches=scored["unseen"]))
        stored["seconds"] = time.perf_counter() - started
        cache.parent.mkdir(exist_ok=True)
        cache.write_text(json.dumps(stored, indent=1))
    del dense
    ranked = {measure: sorted(stored[measure], key=stored[measure].get) for measure in ("seen", "unseen")}

    lines = [f"## {args.model} ({time.strftime('%Y-%m-%d')}): each layer's damage (seen / unseen), least first: "
             + "; ".join(f"{measure}: " + ", ".join(f"{name.split('.')[0]} {stored[measure][name]:.3f}"
                                                    for name in ranked[measure][:8]) for measure in ranked)
             + f"; {stored['seconds']:.0f} s", "",
             "| budget | layers chosen by | layers | removed (net) | seen ratio | unseen ratio | wiki ratio | news ratio |",
             "|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for budget in args.budgets:
        default = ghost_prune(load(), tokenizer, calibration, remove=budget, **CALIBRATION)
        count = len(default.config.ghost_provenance["selection"]["removed"])
        choices = {"default (contiguous run, fit residual)": default}
        for measure in ranked:
            layers = sorted(int(name.split(".")[0]) for name in ranked[measure][:count])
            choices[f"least damage, {measure}"] = lambda layers=layers: ghost_prune(
                load(), tokenizer, calibration, criterion="manual", layers=layers, **CALIBRATION)
        rows, done = [], {}
        for name, choice in choices.items():
            model = (choice if isinstance(choice, torch.nn.Module) else choice()).eval()
            provenance = model.config.ghost_provenance
            layers = layer_ranges(provenance["selection"]["removed"])
            if layers not in done:  # (a choice made twice is fitted and scored once)
                parameters = provenance["parameters"]
                done[layers] = {"net": parameters["dense"] - parameters["pruned"] - parameters.get("operators", 0),
                                **{source: perplexity(model, batches, progress=False) / reference[source]
                                   for source, batches in {**scored, **held_out}.items()}}
            rows.append((name, layers, done[layers]))
            del model
        referee = min(done, key=lambda layers: done[layers]["unseen"])
        for name, layers, result in rows:
            lines.append(f"| {budget} | {name}{' (referee)' if layers == referee else ''} | {layers} | "
                         f"{result['net'] / 1e6:.2f} M | " + " | ".join(
                             f"{result[source]:.3f}" for source in ("seen", "unseen", "wiki", "news")) + " |")
            print(lines[-1], flush=True)
    with Path(args.output).open("a") as handle:
        handle.write(f"\n`python benchmarks/layer_damage.py --model {args.model} --budgets {' '.join(args.budgets)} "
                     f"--threads {args.threads}`\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
