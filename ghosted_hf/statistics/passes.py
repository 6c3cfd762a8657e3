"""Calibration passes: one interface, two implementations (the whole model in memory, or one decoder layer at a
time in `layerwise`), and the `Calibrator` that runs them over one calibration set. Only per-batch activations are
held (memory does not grow with the calibration tokens); a pass stops after the deepest hidden state its plan reads.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PretrainedConfig, PreTrainedModel

from ..architectures import decoder_layers, language_config
from ..errors import GhostedError
from ..text.tokens import TokenBatches
from ..utils.distributed import all_reduce_sums, check_agreement, process_rank
from ..utils.hashing import string_sha256
from .accumulate import StatisticsAccumulator
from .capture import Patch, capture_hidden_states, input_device, patched_stream, release_freed_memory
from .declarations import Read
from .origin import model_fingerprint
from .plan import StatisticsPlan
from .store import CalibrationStatistics, ShardSpec

Batch = Mapping[str, torch.Tensor]


class CalibrationPass(abc.ABC):
    """How statistics are collected from one dense model; `ghost_prune` takes a model or a pass."""

    config: PretrainedConfig

    @abc.abstractmethod
    def collect(self, batches: Iterable[Batch], plan: StatisticsPlan, *, patch: Patch | None = None,
                device: str | torch.device | None = None, description: str = "Calibration pass",
                progress: bool = True) -> CalibrationStatistics:
        """The sums of `plan` over `batches`. With a `patch`, every source-side read (a fit's input X_s, MLP
        outputs) comes from the model pruned and patched by it, every target from the dense model: how a
        boundary is fitted sequentially. May hold zero tokens (a process without batches)."""

    @abc.abstractmethod
    def fingerprint(self) -> dict[str, Any]:
        """The model's config and weight hashes (see `origin.model_fingerprint`)."""

    @abc.abstractmethod
    def model_for_build(self, removed: Iterable[int]) -> PreTrainedModel:
        """The dense model, for the surgery; the layers in `removed` need not hold real weights."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Rows of the input embedding (token ids must be below it)."""

    def forwards(self, batches: int, patch: Patch | None, plan: StatisticsPlan) -> int:
        """Forward passes run for `batches` batches (a patched pass with targets runs two models)."""
        return batches * (1 + (patch is not None and any(role == "target" for role, _ in plan.reads())))


class FullModelPass(CalibrationPass):
    """The dense model in memory (on any devices, e.g. dispatched by accelerate), run once per batch."""

    def __init__(self, model: PreTrainedModel) -> None:
        meta = next((n for n, p in model.named_parameters() if p.device.type == "meta"), None)
        if meta is not None and not hasattr(model, "hf_device_map"):
            raise GhostedError(f"The model's weights are on the meta device (e.g. {meta}): it was built without loading "
                               "them. Load it with from_pretrained (real weights) before pruning.")
        self.model, self.config = model, model.config

    @property
    def vocab_size(self) -> int:
        return self.model.get_input_embeddings().weight.shape[0]

    def fingerprint(self) -> dict[str, Any]:
        return model_fingerprint(self.model)

    def model_for_build(self, removed: Iterable[int]) -> PreTrainedModel:
        return self.model

    def collect(self, batches: Iterable[Batch], plan: StatisticsPlan, *, patch: Patch | None = None,
                device: str | torch.device | None = None, description: str = "Calibration pass",
                progress: bool = True) -> CalibrationStatistics:
        model = self.model
        device = torch.device(device) if device is not None else input_device(model)
        accumulator = StatisticsAccumulator(plan, model.get_input_embeddings().weight.shape[1], device)
        reads = plan.reads()
        mode = model.training
        try:
            model.eval()  # dropout off; the model's own mode is given back
            # Iterated as given: a generator of batches streams (no list of every batch is made here).
            for batch in tqdm(batches, desc=description, disable=not progress, leave=False):
                keep = batch["attention_mask"].bool()
                if not keep.any():
                    continue
                accumulator.tokens += int(keep.sum())
                # Captured in a helper whose locals die with it: a local here would keep this batch's activations
                # alive through the next batch's forward (peak memory of two batches from the second one on).
                accumulator.add(_batch_rows(model, batch, reads, patch, keep, device))
                release_freed_memory()
        finally:
            model.train(mode)
        return accumulator.result(len(decoder_layers(model)), model.config)


def _batch_rows(model: nn.Module, batch: Batch, reads: set[Read], patch: Patch | None, keep: torch.Tensor,
                device: torch.device) -> dict[Read, torch.Tensor]:
    """The rows of every read of one batch: targets (and, without a patch, everything) from the dense model,
    sources and MLP outputs from the patched stream."""
    def capture(wanted: dict[Read, Read]) -> dict[Read, torch.Tensor]:  # {(role, index in the model run): read}
        got = capture_hidden_states(model, batch, {i for role, i in wanted if role != "mlp"},
                                    {i for role, i in wanted if role == "mlp"}, keep, device)
        return {read: got[("mlp" if role == "mlp" else "input", i)] for (role, i), read in wanted.items()}

    dense = {r for r in reads if patch is None or r[0] == "target"}
    rows = capture({r: r for r in dense}) if dense else {}
    if patch is not None and reads - dense:
        with patched_stream(model, patch):
            rows.update(capture({(role, patch.position(i)): (role, i) for role, i in reads - dense}))
    return rows


def as_calibration_pass(model: PreTrainedModel | CalibrationPass) -> CalibrationPass:
    """`model` itself if it is a pass, else the full-model pass over it."""
    return model if isinstance(model, CalibrationPass) else FullModelPass(model)


def collect_statistics(model: PreTrainedModel | CalibrationPass, batches: Iterable[Batch], plan: StatisticsPlan, *,
                       patch: Patch | None = None, device: str | torch.device | None = None, progress: bool = True,
                       description: str = "Calibration pass") -> CalibrationStatistics:
    """Accumulate `plan` over `batches` with one truncated pass of `model` per batch (see `CalibrationPass.collect`)."""
    stats = as_calibration_pass(model).collect(batches, plan, patch=patch, device=device, description=description,
                                               progress=progress)
    if stats.tokens == 0:
        raise GhostedError("The calibration batches contain no real token (every position is padding).")
    return stats


class Calibrator:
    """Statistics passes over one calibration set: gathers what is missing, keeps what was gathered and records what
    each pass cost (for the provenance). Each pass reads only this calibrator's share of the batches: shard `shard`
    of the set and, of that, this process's batches under torch.distributed (rank r of world w takes every w-th
    batch); the float64 sums of the processes are all-reduced, so every process fits the same operators."""

    def __init__(self, calibration_pass: CalibrationPass, data: TokenBatches | None,
                 statistics: CalibrationStatistics | None = None, *, device: str | torch.device | None = None,
                 shard: ShardSpec | None = None) -> None:
        self.calibration_pass, self.data, self.statistics, self.device = calibration_pass, data, statistics, device
        self.shard = shard or ShardSpec()
        self.rank, self.world = process_rank()
        self.passes: list[dict[str, Any]] = []
        self._data_sha256: str | None = None

    @property
    def depth(self) -> int:
        return language_config(self.calibration_pass.config).num_hidden_layers

    @property
    def data_description(self) -> dict[str, Any]:
        return self.data.describe() if self.data is not None else {}

    def data_sha256(self) -> str:
        """The calibration tokens' hash (computed once)."""
        if self._data_sha256 is None:
            self._data_sha256 = self.data.token_sha256()
        return self._data_sha256

    def check_agreement(self, options: Any) -> None:
        """Under torch.distributed, refuse to start unless every process has this model (config and weight
        hashes), this calibration data and these options; a no-op in one process."""
        if self.world == 1:
            return
        claims = {"model": json.dumps(self.calibration_pass.fingerprint(), sort_keys=True),
                  "calibration data": self.data_sha256() if self.data is not None else "",
                  "shard": str(self.shard),
                  "options": json.dumps(dataclasses.asdict(options), sort_keys=True, default=str)}
        check_agreement({k: string_sha256(v) for k, v in claims.items()})

    def my_batches(self) -> list[dict[str, torch.Tensor]]:
        """This process's share of this shard's batches."""
        return ShardSpec(self.rank, self.world).take(self.shard.take(self.data.batches))

    def ensure(self, plan: StatisticsPlan, purpose: str) -> CalibrationStatistics | None:
        """Statistics holding at least `plan`, running one pass for whatever is missing (None: nothing was
        needed and nothing was given)."""
        missing = plan.missing_from(self.statistics.tensors if self.statistics is not None else ())
        if missing:
            if self.data is None:
                raise GhostedError(f"The given statistics lack what {purpose} needs, and no calibration text was given: "
                                   "pass the calibration text too, or collect statistics with the same options "
                                   "(with several boundaries, --fitting independent needs no further pass).")
            fresh = self.collect(missing, purpose)
            self.statistics = fresh if self.statistics is None else self.statistics.with_tensors(fresh)
        return self.statistics

    def collect(self, plan: StatisticsPlan, purpose: str, patch: Patch | None = None) -> CalibrationStatistics:
        """One pass for `plan` (see `CalibrationPass.collect` for `patch`); not merged into the kept statistics."""
        started = time.perf_counter()
        batches = self.my_batches()
        if not self.shard.take(self.data.batches):
            raise GhostedError(f"Shard {self.shard} holds no batch: the calibration set has only "
                               f"{len(self.data.batches)} batches; use fewer shards or more sequences.")
        stats = self.calibration_pass.collect(batches, plan, patch=patch, device=self.device,
                                              description=f"Calibration pass: {purpose}")
        stats.tensors, stats.tokens = all_reduce_sums(stats.tensors, stats.tokens)
        if stats.tokens == 0:
            raise GhostedError("The calibration batches contain no real token (every position is padding).")
        # The whole set's token count: statistics that hold fewer are a part of it, whatever their shard label says.
        stats.origin.update(data=self.data_sha256(), plan=plan.to_json(), shard=str(self.shard),
                            set_tokens=self.data.num_tokens)
        self.passes.append({"purpose": purpose, "batches": len(batches),
                            "forwards": self.calibration_pass.forwards(len(batches), patch, plan),
                            "processes": self.world, "deepest_layer_input": plan.deepest(),
                            "sequential": patch is not None, "seconds": round(time.perf_counter() - started, 3)})
        return stats
