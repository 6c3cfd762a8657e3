"""CPU seconds per healing step of the default ghosted model (8/30 on the packaged model): the attention kernel
(PyTorch's fused SDPA, or eager as `heal` uses on a CPU), side by side in one run, the two interleaved round by
round so that what the host runs beside weighs on both alike.

    python benchmarks/healing_step.py --rounds 4 > benchmarks/results/healing_step.md
"""

from __future__ import annotations

import contextlib
import statistics
import time

from healing import step_timing_setup
from transformers import TrainerCallback

from ghosted_hf.pipelines import healing
from ghosted_hf.pipelines.healing import recipe as healing_recipe  # where heal looks training_attention up

ATTENTION = ("sdpa", "eager")


def main() -> None:
    args, tokenizer, calibration, model = step_timing_setup(__doc__.splitlines()[0], steps=3)
    model.set_attn_implementation("sdpa")
    eager_on_cpu = healing_recipe.training_attention
    times: dict[str, list[float]] = {a: [] for a in ATTENTION}
    for _ in range(args.rounds):
        for attention in times:
            # sdpa: keep the model's own kernel by skipping the switch `heal` makes on a CPU
            healing_recipe.training_attention = eager_on_cpu if attention == "eager" else (lambda *a: contextlib.nullcontext())
            seconds: list[float] = []

            class StepTimes(TrainerCallback):
                def on_step_begin(self, args, state, control, **kwargs):
                    self.clock = time.process_time()

                def on_step_end(self, args, state, control, **kwargs):
                    seconds.append(time.process_time() - self.clock)

            healed = healing.heal(model, tokenizer, calibration, max_steps=args.steps + 1, progress=False,
                                  eval_sequences=0, callbacks=[StepTimes()])
            model = healed.model.unload()  # the adapters removed: the same ghosted model for the next configuration
            times[attention] += seconds[1:]  # the first step warms up
    healing_recipe.training_attention = eager_on_cpu
    reference = statistics.median(times["sdpa"])
    print(f"SmolLM2-135M-Instruct, {args.layers}/30 removed, default healing options, {args.threads} torch thread(s); "
          f"CPU seconds per step, median of {args.rounds} rounds x {args.steps} steps.\n")
    print("| attention | s per step (median) | min - max | relative to sdpa |")
    print("|---|---|---|---|")
    for attention, seconds in times.items():
        median = statistics.median(seconds)
        print(f"| {attention} | {median:.2f} | {min(seconds):.2f} - {max(seconds):.2f} | {median / reference:.2f} |")


if __name__ == "__main__":
    main()
