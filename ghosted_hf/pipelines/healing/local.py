"""Local distillation, healing's first phase: the few layers after each boundary or replaced sub-block (with its
operator or map) learn to reproduce the dense model's hidden states a few layers on. The dense states are computed
once, for a pool of training sequences, by a forward pass of the dense model stopped at the deepest one needed; each
step then runs only those layers, resumed at the dense stream, with no head and no vocabulary."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import nn
from tqdm.auto import tqdm

from ...architectures import decoder_layers, final_norm, stream_width
from ...errors import GhostedError
from ...remote.format_ghosted import LAYER_TARGET, kept_layers
from ...statistics.capture import StopForward, capture_hidden_states, resumed, stopped_forward
from ...utils.memory import over_half_available
from .callbacks import lr_factor
from .distillation import unwrapped

logger = logging.getLogger(__name__)

STATE_DTYPE = torch.bfloat16  # the cached dense states: half the memory; rounding (2^-8) far below the losses fitted


class LocalRun(NamedTuple):
    """Layers run together from a dense state: `start` (a pruned layer index) fed with the dense input of layer
    `source`, and `targets`, pairs (pruned index, dense index) whose inputs are compared, the last where it stops
    (the pruned depth stands for the final norm's input)."""

    start: int
    source: int
    targets: tuple[tuple[int, int], ...]


def local_runs(config: Any, layers: int) -> list[LocalRun]:
    """The runs of a ghosted model's local phase: each boundary that feeds a layer and each layer with a replaced
    sub-block starts one, compared `layers` layers on; a start inside an earlier run extends it (the student's own
    stream flows on, compared at each target)."""
    total, removed = config.original_num_hidden_layers, set(config.removed_layers)
    original = kept_layers(total, removed) + [total]  # pruned index -> dense (depth -> final norm)
    depth = len(original) - 1
    sources = {b["layer"]: min(b["removed"]) for b in config.ghost_boundaries if b["target"] == LAYER_TARGET}
    for record in config.ghost_subblocks:
        sources.setdefault(record["layer"], original[record["layer"]])
    runs: list[LocalRun] = []
    for start in sorted(sources):
        stop = min(start + layers, depth)
        if runs and start < runs[-1].targets[-1][0]:
            last = runs[-1]
            if stop > last.targets[-1][0]:
                runs[-1] = last._replace(targets=(*last.targets, (stop, original[stop])))
        else:
            runs.append(LocalRun(start, sources[start], ((stop, original[stop]),)))
    if not runs:
        raise GhostedError("Local distillation trains the layers after a boundary or a replaced sub-block, and this "
                           "model has neither (its only boundary feeds the final norm): leave local_layers at 0.")
    return runs


def dense_states(teacher: nn.Module, sequences: torch.Tensor, runs: list[LocalRun], batch_size: int,
                 precision: str = "fp32", progress: bool = True) -> dict[int, torch.Tensor]:
    """The dense model's inputs of the layers the runs start from and compare at (dense index -> sequences x length
    x channels, on the CPU in `STATE_DTYPE`), from one forward pass per batch stopped at the deepest (under bf16
    autocast with `precision` "bf16", as the training steps)."""
    reads = {("input", run.source) for run in runs} | {("input", dense) for run in runs for _, dense in run.targets}
    check_state_memory(len(reads), sequences.shape, stream_width(teacher))
    found: dict[int, list[torch.Tensor]] = {i: [] for _, i in reads}
    for start in tqdm(range(0, len(sequences), batch_size), desc="Dense states", disable=not progress):
        ids = sequences[start:start + batch_size].long()
        keep = torch.ones(ids.shape, dtype=torch.bool)
        with _autocast(teacher, precision):
            captured = capture_hidden_states(teacher, {"input_ids": ids}, reads, keep, torch.device("cpu"))
        for (_, i), rows in captured.items():
            found[i].append(rows.view(*ids.shape, -1).to(STATE_DTYPE))
    return {i: torch.cat(parts) for i, parts in found.items()}


def check_state_memory(states: int, shape: tuple[int, ...], width: int) -> None:
    """Refuse a pool of dense states that needs more than half the memory available to this process (the other half:
    the models, the training step), before the pass that would fill it."""
    needed = states * shape[0] * shape[1] * width * STATE_DTYPE.itemsize
    available = over_half_available(needed)
    if available is not None:
        fits = shape[0] * (available // 2) // needed
        raise GhostedError(f"The local phase's dense states ({states} hidden states of {shape[0]} sequences x "
                           f"{shape[1]} tokens x {width} channels) need {needed / 2**30:.1f} GiB, more than half the "
                           f"{available / 2**30:.1f} GiB available to this process: lower local_sequences (at most "
                           f"{fits} fit) or local_layers (fewer states), or the sequence length.")


def run_inputs(model: nn.Module, ids: torch.Tensor, run: LocalRun, state: torch.Tensor) -> list[torch.Tensor]:
    """The inputs (after any operator) of the run's target layers when `model` runs from layer `run.start` fed with
    `state`, with the graph for the backward pass."""
    layers, norm = decoder_layers(model), final_norm(model)
    found: dict[int, torch.Tensor] = {}
    deepest = run.targets[-1][0]

    def hook(i: int):
        def pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
            found[i] = args[0] if args else kwargs["hidden_states"]
            if i == deepest:
                raise StopForward
        return pre

    # Registered after the operators' own hooks: what is compared is what the layer receives.
    handles = [(layers[i] if i < len(layers) else norm).register_forward_pre_hook(hook(i), with_kwargs=True)
               for i, _ in run.targets]
    try:
        with resumed(model, run.start, state), stopped_forward():
            model(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return [found[i] for i, _ in run.targets]


def relative_error(student: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of |s - d|^2 / |d|^2: each token's error relative to its own size, as the next layer's norm
    sees it (a sink token's huge state does not outweigh the others)."""
    student, dense = student.float(), dense.to(device=student.device, dtype=torch.float32)
    return ((student - dense).square().sum(-1) / dense.square().sum(-1).clamp_min(1e-12)).mean()


def local_loss(model: nn.Module, ids: torch.Tensor, runs: list[LocalRun], states: dict[int, torch.Tensor]
               ) -> torch.Tensor:
    """The mean relative error over every run's targets, each run fed with its dense state (`states`: dense index ->
    these sequences' states)."""
    dtype = model.get_input_embeddings().weight.dtype
    return torch.stack([relative_error(found, states[dense]) for run in runs for found, (_, dense) in
                        zip(run_inputs(model, ids, run, states[run.source].to(ids.device, dtype)), run.targets)]).mean()


def distill_locally(model: nn.Module, teacher: nn.Module, sequences: torch.Tensor, options: Any, precision: str,
                    progress: bool = True) -> list[float]:
    """Train `model`'s adapters (and every ghost operator and map, trained here whatever `train_operators` says:
    they are what the phase corrects) for `options.local_steps` steps of the local loss, AdamW with healing's rate
    and schedule, on the first `options.local_sequences` training sequences, cycled. Returns the losses."""
    inner = unwrapped(model)
    runs = local_runs(inner.config, options.local_layers)
    pool = sequences[:options.local_sequences]
    states = dense_states(teacher, pool, runs, options.per_device_train_batch_size, precision, progress)
    device = next(inner.parameters()).device
    with _operators_trained(inner, not options.train_operators) as ghosts:
        adapters = [p for p in model.parameters() if p.requires_grad and all(p is not g for g in ghosts)]
        # No decay on the operators and maps: it would pull them toward zero, not toward what they were fitted as.
        optimizer = torch.optim.AdamW([{"params": adapters, "weight_decay": options.weight_decay},
                                       {"params": ghosts, "weight_decay": 0.0}], lr=options.learning_rate)
        losses, batch = [], options.per_device_train_batch_size
        model.train()
        for step in tqdm(range(options.local_steps), desc="Local distillation", disable=not progress):
            for group in optimizer.param_groups:
                group["lr"] = options.learning_rate * lr_factor(options.lr_scheduler_type, step / options.local_steps)
            rows = torch.arange(step * batch, (step + 1) * batch) % len(pool)
            with _autocast(inner, precision):
                loss = local_loss(inner, pool[rows].long().to(device), runs, {i: s[rows] for i, s in states.items()})
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
    logger.info("Local distillation over %d run(s) of %d layer(s): loss %.4f -> %.4f in %d steps.", len(runs),
                options.local_layers, losses[0], losses[-1], len(losses))
    return losses


def _autocast(model: nn.Module, precision: str) -> torch.autocast:
    """bf16 autocast on the model's device where `precision` is "bf16" (heal's resolved precision)."""
    device = next(model.parameters()).device
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")


@contextlib.contextmanager
def _operators_trained(model: nn.Module, switch: bool) -> Iterator[list[nn.Parameter]]:
    """Within the context the ghost tensors require a gradient (when `switch`; otherwise PEFT already trains them as
    adapters' peers, and the list is empty)."""
    tensors = list(model.ghost_operators().values()) if switch else []
    for tensor in tensors:
        tensor.requires_grad_(True)
    try:
        yield tensors
    finally:
        for tensor in tensors:
            tensor.requires_grad_(False)
