"""The Trainer callbacks `heal` adds: the learning-rate schedule, the step/token/minute budget, the progress bar and
the checkpoint records."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import TrainerCallback

from ...utils.diskio import atomic_write_text
from ...utils.hashing import file_sha256
from .checkpoints import CHECKPOINT_RECORD


def lr_factor(schedule: str, done: float) -> float:
    """Learning rate as a fraction of the peak, after the fraction `done` of the run (steps or time). A linear decay
    to zero anneals a short run into a lower loss than a constant rate does."""
    return max(1.0 - done, 0.0) if schedule == "linear" else 1.0


class Budget:
    """What a run may spend: `steps`, or `seconds` by `clock` (then `fraction` is the share spent). Rank 0's clock
    decides (broadcast every step), so that every process uses the same learning rate and stops at the same step."""

    def __init__(self, steps: int | None, seconds: float | None, clock: Callable[[], float]) -> None:
        self.steps, self.seconds, self.clock, self.spent = steps, seconds, clock, 0.0
        self.fraction, self._started = 0.0, clock()

    def restart(self) -> None:
        self._started = self.clock() - self.spent

    def measure(self, device: torch.device) -> None:
        """Update the fraction of a timed run done (a step run's fraction is its step count: see the scheduler)."""
        self.spent = self.clock() - self._started
        fraction = torch.tensor([self.spent / self.seconds], dtype=torch.float64, device=device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.broadcast(fraction, src=0)
        self.fraction = float(fraction)


class Schedule(TrainerCallback):
    """Measures the budget after every optimizer step (before the scheduler reads it) and stops a timed run."""

    def __init__(self, budget: Budget) -> None:
        self.budget = budget

    def on_train_begin(self, args, state, control, **kwargs):
        self.budget.restart()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.budget.seconds is not None:
            self.budget.measure(args.device)

    def on_step_end(self, args, state, control, **kwargs):
        if self.budget.seconds is not None and self.budget.fraction >= 1:
            control.should_training_stop = True


class Progress(TrainerCallback):
    """One bar (steps, or seconds of a timed run) with the loss and tokens/s, on the main process only."""

    def __init__(self, budget: Budget, tokens_per_step: int, enabled: bool) -> None:
        self.budget, self.tokens_per_step, self.enabled, self.bar = budget, tokens_per_step, enabled, None

    def on_train_begin(self, args, state, control, **kwargs):
        if self.enabled and state.is_world_process_zero:
            timed = self.budget.seconds is not None
            self.bar = tqdm(total=round(self.budget.seconds) if timed else self.budget.steps,
                            unit="s" if timed else "step", desc="Healing", initial=0 if timed else state.global_step)
            self._clock, self._first_step = time.perf_counter(), state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.bar is not None and logs and "loss" in logs:
            speed = (state.global_step - self._first_step) * self.tokens_per_step / (time.perf_counter() - self._clock)
            self.bar.set_postfix(loss=f"{logs['loss']:.4f}", tokens_per_s=f"{speed:.0f}")

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            done = round(self.budget.spent) if self.budget.seconds is not None else state.global_step
            self.bar.update(min(done, self.bar.total) - self.bar.n)

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()


class Record(TrainerCallback):
    """Completes every checkpoint with a record of its files' sha256 (and the time spent, for timed runs), written
    last and atomically: a checkpoint without a valid record is one a kill interrupted, and is never resumed."""

    def __init__(self, budget: Budget, run: dict[str, Any]) -> None:
        self.budget, self.run = budget, run

    def on_save(self, args, state, control, **kwargs):
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()  # every process has written its RNG state
        if not state.is_world_process_zero:
            return
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        files = {p.relative_to(folder).as_posix(): file_sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()}
        atomic_write_text(folder / CHECKPOINT_RECORD, json.dumps({"step": state.global_step, "run": self.run,
                                                                 "seconds_spent": self.budget.spent, "files": files}))
