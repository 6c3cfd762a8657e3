"""Issue #51 item 5: local distillation (`heal(local_layers=...)`) against heal's global phase alone, at equal CPU
time: SmolLM2 8/30 with the defaults, healed on the Wikipedia calibration articles, scored on the held-out Wikipedia
articles and on gensim's news articles (never trained on). Each row reports the share of the log-perplexity gap to
LLM-Streamline's block plainly removed that it closes, on each source, and the CPU time of the whole `heal` call
(process time summed over torch's threads: the dense states, the local steps and the global phase).

A row is "local K x S + global G": local_layers K for S steps, then the global phase (heal's defaults, next-token
loss) for G CPU-minutes by the process clock; a row without "global G" takes one global step (heal always takes
one); "over N" makes the local phase cycle over N sequences instead of 256.

    python benchmarks/local_healing.py --threads 2 --rows "global 12" "local 4x150 + global 8" \\
        "local 4x600 over 512" > benchmarks/results/local_healing.md
"""

from __future__ import annotations

import argparse
import json
import re
import time

import torch
from transformers import TrainerCallback
from common import held_out_sources, packaged_model

from ghosted_hf import assets, ghost_prune
from ghosted_hf.evaluate import gap_closed, perplexity
from ghosted_hf.options import PruneOptions
from ghosted_hf.pipelines.healing import heal

ROW = re.compile(r"(?:local (\d+)x(\d+)(?: over (\d+))?(?: \+ )?)?(?:global ([\d.]+))?$")


def parse_row(row: str) -> dict:
    """"local 4x150 + global 7" -> {local_layers: 4, local_steps: 150, minutes: 7.0}; "over N" caches N sequences."""
    found = ROW.match(row)
    if not found or not row:
        raise SystemExit(f"Cannot read the row {row!r}: write 'global G', 'local KxS + global G' or 'local KxS over N'.")
    layers, steps, pool, minutes = found.groups()
    local = dict(local_layers=int(layers), local_steps=int(steps)) if layers else {}
    if pool:
        local["local_sequences"] = int(pool)
    return {**local, **(dict(minutes=float(minutes)) if minutes and float(minutes) > 0 else dict(max_steps=1))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=["global 12", "local 4x150 + global 8"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer, load = packaged_model()
    calibration, sources = assets.wikipedia_split("calibration"), held_out_sources(tokenizer)
    dense = load()
    reference = {s: perplexity(dense, b, progress=False) for s, b in sources.items()}
    plain = ghost_prune(load(), tokenizer, calibration, PruneOptions(num_layers=args.layers, criterion="streamline"),
                        operator="none")
    baseline = {s: perplexity(plain, b, progress=False) for s, b in sources.items()}
    ghosted = ghost_prune(load(), tokenizer, calibration, PruneOptions(num_layers=args.layers))
    print(f"SmolLM2-135M-Instruct, fp32, {args.layers}/30 layers removed with the defaults "
          f"({ghosted.config.removed_layers}), {args.threads} torch threads. Perplexity on 16 x 512 held-out tokens "
          f"of each source; gap closed between LLM-Streamline's block plainly removed (wiki {baseline['wiki']:.2f}, "
          f"news {baseline['news']:.2f}) and dense (wiki {reference['wiki']:.2f}, news {reference['news']:.2f}). "
          "Healing on the Wikipedia calibration articles, heal's defaults otherwise.\n")
    print("| row | CPU-min (local / all) | steps (local, global) | wiki ppl ratio | news ppl ratio | wiki gap closed | "
          "news gap closed |")
    print("|---|---|---|---|---|---|---|")
    records = []

    def report(row: str, model: torch.nn.Module, local_minutes: float | None, minutes: float, steps: str) -> None:
        ppl = {s: perplexity(model, b, progress=False) for s, b in sources.items()}
        closed = {s: gap_closed(ppl[s], baseline[s], reference[s]) for s in sources}
        records.append(dict(row=row, cpu_minutes=minutes, local_cpu_minutes=local_minutes, steps=steps,
                            perplexity=ppl, gap_closed=closed))
        local = "-" if local_minutes is None else f"{local_minutes:.1f}"
        print(f"| {row} | {local} / {minutes:.1f} | {steps} | {ppl['wiki'] / reference['wiki']:.3f} | "
              f"{ppl['news'] / reference['news']:.3f} | {closed['wiki']:.3f} | {closed['news']:.3f} |", flush=True)

    report("training-free", ghosted, None, 0.0, "-")
    for row in args.rows:
        model = type(ghosted)(ghosted.config)
        model.load_state_dict(ghosted.state_dict())
        start, marks = time.process_time(), []
        healed = heal(model.eval(), tokenizer, calibration, eval_sequences=0, progress=False,
                      clock=time.process_time, callbacks=[_Mark(marks)], **parse_row(row))
        spent = (time.process_time() - start) / 60
        local = (marks[0] - start) / 60 if "local_loss" in healed.record else None
        report(row, healed.model, local, spent,
               f"{healed.record.get('local_steps', 0) if local is not None else 0}, {healed.record['steps']}")
    print("\n<details><summary>raw results (JSON)</summary>\n\n```json\n" + json.dumps(records, indent=1) +
          "\n```\n</details>")


class _Mark(TrainerCallback):
    """Notes the process time when the global phase begins (after the local phase)."""

    def __init__(self, marks: list[float]) -> None:
        self.marks = marks

    def on_train_begin(self, *args, **kwargs) -> None:
        self.marks.append(time.process_time())


if __name__ == "__main__":
    main()
