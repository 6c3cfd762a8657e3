"""Streaming float64 sums of a plan over batches of captured hidden states."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..architectures import language_config, stream_width
from ..errors import GhostedError
from ..utils.hadamard import rotation
from .declarations import ROTATED_ABS, SUBBLOCK_ROLES, Read
from .origin import config_sha256
from .plan import StatisticsPlan
from .store import CalibrationStatistics


class _LazyCopies(dict):
    """Copies of `source`'s tensors' `rows` in `dtype`, made on first read; reads sharing one tensor share one copy."""

    def __init__(self, source: Mapping[Read, torch.Tensor], rows: slice, device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.source, self.rows, self.device, self.dtype, self.copies = source, rows, device, dtype, {}

    def __missing__(self, key: Read) -> torch.Tensor:
        tensor = self.source[key]
        if id(tensor) not in self.copies:
            self.copies[id(tensor)] = tensor[self.rows].to(device=self.device, dtype=self.dtype)
        value = self[key] = self.copies[id(tensor)]
        return value


PARTIAL_SUMS = ("float64", "float32")  # the precision each chunk's products are formed in; totals are float64
# float32 chose the same layers and perplexities as float64 on both packaged models (benchmarks/results/partial_sums.md)
DEFAULT_PARTIAL_SUMS = "float32"


def sums_width(plan: StatisticsPlan, config: Any) -> int:
    """The width of `plan`'s sums on a model of `config`: the residual stream's where they read it, the hidden size
    where they read sub-blocks only (what a sub-block is given and returns). Where the two differ (hyper-connections'
    several streams), a plan reading both is refused by name."""
    hidden, width = language_config(config).hidden_size, stream_width(config)
    on_stream = {any(role not in SUBBLOCK_ROLES for role, _ in e.reads) for e in plan if not e.statistic.scalar}
    if width != hidden and on_stream == {True, False}:
        raise GhostedError(f"This model's residual carries {width // hidden} streams of {hidden} between layers, "
                           "and its sub-blocks read one: whole layers and sub-blocks cannot be fitted in one pass "
                           "here; use unit 'layer' or 'subblock'.")
    return width if True in on_stream else hidden


class StatisticsAccumulator:
    """The sums of `plan`, every one present from the start (zeros: a process or shard with no batch still has
    every key to reduce), updated one batch of rows ({read: (N, C) tensor}) at a time. Each chunk of rows is summed
    in `partial` precision and added to float64 totals (float32 partial sums run at the float32 rate: twice the
    float64 one on a CPU's vector units and on a GPU without float64 tensor cores, more where TF32 is allowed)."""

    # Fixed-size row chunks: the float64 copies are small and of one size for every batch, so the allocator
    # reuses the same blocks instead of fragmenting (peak memory does not grow with the number of tokens).
    CHUNK = 256

    def __init__(self, plan: StatisticsPlan, hidden_size: int, device: str | torch.device = "cpu",
                 partial: str = DEFAULT_PARTIAL_SUMS) -> None:
        if not plan:
            raise GhostedError("The statistics plan is empty: nothing to collect.")
        if partial not in PARTIAL_SUMS:
            raise GhostedError(f"Partial sums are formed in {' or '.join(PARTIAL_SUMS)}, got {partial!r}.")
        self.hidden_size, self.device, self.partial = hidden_size, torch.device(device), partial
        self.entries = list(plan)
        self.tokens = 0
        self.constants: dict[str, torch.Tensor] = {}
        self.rotation_kind = "none"
        if any(e.statistic is ROTATED_ABS for e in self.entries):
            h, self.rotation_kind = rotation(hidden_size)
            self.constants["rotation"] = h.to(self.device, getattr(torch, partial))
        self.sums = {e.key: torch.zeros(e.statistic.shape(hidden_size), dtype=torch.float64, device=self.device)
                     for e in self.entries}

    def add(self, rows: Mapping[Read, torch.Tensor], ready: int | None = None) -> None:
        """Add one batch's rows to every sum (with `ready`: only to the sums whose deepest read is at index
        `ready`; a layer-by-layer pass adds each sum as soon as its reads exist). Tokens are counted apart."""
        entries = self.entries if ready is None else [e for e in self.entries if e.ready_at == ready]
        count = next(iter(rows.values())).shape[0] if entries else 0
        for start in range(0, count, self.CHUNK):
            # No closure over the rows here: a reference cycle would keep every batch's activations alive until
            # the cyclic GC happens to run.
            x = _LazyCopies(rows, slice(start, start + self.CHUNK), self.device, getattr(torch, self.partial))
            for entry in entries:
                entry.statistic.update(self.sums[entry.key], x, entry.index, self.constants)

    def result(self, depth: int, config: Any = None) -> CalibrationStatistics:
        """The sums as statistics (of the model of `config`, recorded in their origin, where given)."""
        origin = {"model": {"config_sha256": config_sha256(config)}} if config is not None else {}
        origin["partial_sums"] = self.partial
        return CalibrationStatistics(tensors=self.sums, depth=depth, hidden_size=self.hidden_size, tokens=self.tokens,
                                     rotation_kind=self.rotation_kind, origin=origin)
