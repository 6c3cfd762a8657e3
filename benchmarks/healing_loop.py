"""CPU seconds per healing step (start to start) of the default ghosted model (8/30 on the packaged model): 1.0's hand-written loop
(`legacy_healing.py`) against `heal` on transformers' Trainer, default options, the two interleaved round by round
so that what the host runs beside them weighs on both alike. The first step of every run warms up and is not
counted.

    OMP_NUM_THREADS=1 python benchmarks/healing_loop.py --rounds 4 --steps 6 > benchmarks/results/healing_loop.md
"""

from __future__ import annotations

import statistics
import time

from healing import step_timing_setup
from legacy_healing import legacy_heal
from transformers import TrainerCallback

from ghosted_hf.pipelines.healing import HealOptions, heal


class StepStarts(TrainerCallback):
    """The CPU clock at the start of every step and at the end of training: a step's time is everything the loop
    does between two starts (data, forward, backward, optimizer, schedule, logging)."""

    def __init__(self, starts: list[float]) -> None:
        self.starts = starts

    def on_step_begin(self, args, state, control, **kwargs):
        self.starts.append(time.process_time())

    def on_train_end(self, args, state, control, **kwargs):
        self.starts.append(time.process_time())


def main() -> None:
    args, tokenizer, calibration, model = step_timing_setup(__doc__.splitlines()[0], steps=6)
    options = HealOptions(max_steps=args.steps + 1, eval_sequences=0)
    times: dict[str, list[float]] = {"1.0 loop": [], "Trainer": []}
    for _ in range(args.rounds):
        for name, seconds in times.items():
            starts: list[float] = []
            if name == "1.0 loop":
                peft_model, _ = legacy_heal(model, tokenizer, calibration, options, on_step=starts.append)
            else:
                peft_model = heal(model, tokenizer, calibration, options, progress=False,
                                  callbacks=[StepStarts(starts)]).model
            model = peft_model.unload()  # the adapters removed: the same ghosted model for the next run
            seconds += [b - a for a, b in zip(starts[1:], starts[2:])]
    reference = statistics.median(times["1.0 loop"])
    print(f"SmolLM2-135M-Instruct, {args.layers}/30 removed, default healing options, {args.threads} torch thread(s); "
          f"CPU seconds per step, median of {args.rounds} rounds x {args.steps} steps (first step of each run not "
          "counted).\n")
    print("| implementation | s per step (median) | min - max | relative to the 1.0 loop |")
    print("|---|---|---|---|")
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(f"| {name} | {median:.2f} | {min(seconds):.2f} - {max(seconds):.2f} | {median / reference:.3f} |")


if __name__ == "__main__":
    main()
