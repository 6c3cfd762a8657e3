"""Calibration passes: one interface, two implementations (the whole model in memory, or one decoder layer at a
time in `layerwise`), and the `Calibrator` that runs them over one calibration set. Only per-batch activations are
held (memory does not grow with the calibration tokens); a pass stops after the deepest hidden state its plan reads.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import json
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import PretrainedConfig, PreTrainedModel

from ..architectures import decoder_layers, language_config
from ..errors import GhostedError
from ..remote.format_ghosted import kept_layers
from ..text.tokens import TokenBatches
from ..utils.distributed import all_reduce_sums, check_agreement, process_rank
from ..utils.hashing import string_sha256
from .accumulate import DEFAULT_PARTIAL_SUMS, StatisticsAccumulator, sums_width
from .capture import capture_hidden_states, input_device, release_freed_memory, resumed, watch_subblocks
from .declarations import Read, block_output
from .patch import Patch, patched_stream, same_below
from .origin import model_fingerprint
from .plan import StatisticsPlan
from .store import CalibrationStatistics, ShardSpec

Batch = Mapping[str, torch.Tensor]


class CalibrationPass(abc.ABC):
    """How statistics are collected from one dense model; `ghost_prune` takes a model or a pass."""

    config: PretrainedConfig

    @abc.abstractmethod
    def collect(self, batches: Iterable[Batch], plan: StatisticsPlan, *, patch: Patch | None = None,
                device: str | torch.device | None = None, description: str = "Calibration pass", partial: str = DEFAULT_PARTIAL_SUMS,
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

    def remembering_inputs(self, batches: Iterable[Batch], patch: Patch | None = None) -> contextlib.AbstractContextManager:
        """A context in which patched passes over `batches` may start at their first change from `patch` (the dense
        model without one; a pass that holds the model in memory); elsewhere, nothing changes."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def subblock_outputs(self, keys: Iterable[tuple[int, str]], batch: Batch) -> dict[tuple[int, str], int]:
        """How many values sub-block (layer, kind) returns (0: a bare tensor): what its served bypass returns too."""

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
        # id(batch) -> (the batch, held so that its id is not reused; a patch; the inputs of dense layers under it):
        # where a later patched pass over that batch may start
        self._inputs: dict[int, tuple[Batch, Patch, dict[int, torch.Tensor]]] = {}
        self._remembering = False

    @property
    def vocab_size(self) -> int:
        return self.model.get_input_embeddings().weight.shape[0]

    def fingerprint(self) -> dict[str, Any]:
        return model_fingerprint(self.model)

    def model_for_build(self, removed: Iterable[int]) -> PreTrainedModel:
        return self.model

    def subblock_outputs(self, keys: Iterable[tuple[int, str]], batch: Batch) -> dict[tuple[int, str], int]:
        """Read off one forward of the first two tokens of `batch`."""
        outputs: dict[tuple[int, str], int] = {}
        roles = {(block_output(kind, j)) for j, kind in keys}
        handles = watch_subblocks(self.model, roles, lambda read, value: None, outputs)
        try:
            with torch.no_grad():
                self.model(**{k: v[:1, :2].to(input_device(self.model)) for k, v in batch.items()
                              if k in ("input_ids", "attention_mask")}, use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        return outputs

    @contextlib.contextmanager
    def remembering_inputs(self, batches: Iterable[Batch], patch: Patch | None = None) -> Iterator[None]:
        """Within the context, the input of every decoder layer for `batches` (under `patch`: of every kept layer of
        the model it patches) is kept, and a patched pass over one of them starts at its first change from `patch`
        (many patched passes over a few batches: each candidate's damage, alone or beside the ones picked). Holds
        layers x tokens x width activations."""
        patch = patch or Patch()
        kept = kept_layers(len(decoder_layers(self.model)), patch.removed)
        try:
            for batch in batches:
                found: list[torch.Tensor] = []
                with patched_stream(self.model, patch):
                    handles = [layer.register_forward_pre_hook(
                        lambda module, args, kwargs: found.append((args[0] if args else kwargs["hidden_states"]).detach()),
                        with_kwargs=True) for layer in decoder_layers(self.model)]
                    try:
                        with torch.no_grad():
                            self.model(**{k: v.to(input_device(self.model)) for k, v in batch.items()}, use_cache=False)
                    finally:
                        for handle in handles:
                            handle.remove()
                self._inputs[id(batch)] = (batch, patch, dict(zip(kept, found)))
            self._remembering = True
            yield
        finally:
            self._inputs.clear()
            self._remembering = False

    def collect(self, batches: Iterable[Batch], plan: StatisticsPlan, *, patch: Patch | None = None,
                device: str | torch.device | None = None, description: str = "Calibration pass", partial: str = DEFAULT_PARTIAL_SUMS,
                progress: bool = True) -> CalibrationStatistics:
        model = self.model
        device = torch.device(device) if device is not None else input_device(model)
        accumulator = StatisticsAccumulator(plan, sums_width(plan, model.config), device, partial)
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
                # Captured in a helper whose locals die with it, and dropped once added: a reference here would keep
                # this batch's activations alive through the next batch's forward (peak memory of two batches).
                held = self._inputs.get(id(batch))
                found, known = _batch_rows(model, batch, reads, patch, keep, device, held and held[1:])
                accumulator.add(found)
                del found, held
                if known is not None and not self._remembering:  # the next sequential fit starts there
                    self._inputs[id(batch)] = (batch, *known)
                release_freed_memory()
        finally:
            model.train(mode)
        return accumulator.result(len(decoder_layers(model)), model.config)


def _batch_rows(model: nn.Module, batch: Batch, reads: set[Read], patch: Patch | None, keep: torch.Tensor,
                device: torch.device, known: tuple[Patch, dict[int, torch.Tensor]] | None = None,
                ) -> tuple[dict[Read, torch.Tensor], tuple[Patch, dict[int, torch.Tensor]] | None]:
    """(the rows of every read of one batch, the patched input of the first layer read): targets (and, without a
    patch, everything) from the dense model, sources and sub-block reads from the patched stream, started at the
    deepest layer whose input is `known` under a patch that gives the same stream into it (a sequential fit starts
    where the one before it was read; a damage pass at its candidate)."""
    def capture(wanted: dict[Read, Read]) -> dict[Read, torch.Tensor]:  # {(role, index in the model run): read}
        where = {key: ("input", key[1]) if key[0] in ("source", "target") else key for key in wanted}
        got = capture_hidden_states(model, batch, set(where.values()), keep, device)
        return {read: got[where[key]] for key, read in wanted.items()}

    dense = {r for r in reads if patch is None or r[0] == "target"}
    rows = capture({r: r for r in dense}) if dense else {}
    if patch is None or not reads - dense:
        return rows, None
    depth, first = len(decoder_layers(model)), min(i for _, i in reads - dense)
    fed = set(patch.fed(depth).values())  # (an input a boundary's operator rewrites is not stored or resumed from)
    recorded, inputs = known if known is not None else (patch, {})
    start = max((j for j in inputs if 0 < j <= first and j not in fed and same_below(recorded, patch, j)), default=0)
    stored: dict[int, torch.Tensor] = {}
    position = start - sum(1 for i in patch.removed if i < start)  # (start may be a removed layer: its run's input)
    with patched_stream(model, patch), resumed(model, position, inputs.get(start)):
        handle = (decoder_layers(model)[patch.position(first)].register_forward_pre_hook(
            lambda module, args, kwargs: stored.__setitem__(first, args[0] if args else kwargs["hidden_states"]),
            with_kwargs=True) if first < depth and first not in fed and first not in patch.removed else None)
        try:
            rows.update(capture({(role, patch.position(i)): (role, i) for role, i in reads - dense}))
        finally:
            if handle is not None:
                handle.remove()
    return rows, ((patch, stored) if stored else None)


def as_calibration_pass(model: PreTrainedModel | CalibrationPass) -> CalibrationPass:
    """`model` itself if it is a pass, else the full-model pass over it."""
    return model if isinstance(model, CalibrationPass) else FullModelPass(model)


def collect_statistics(model: PreTrainedModel | CalibrationPass, batches: Iterable[Batch], plan: StatisticsPlan, *,
                       patch: Patch | None = None, device: str | torch.device | None = None, progress: bool = True,
                       description: str = "Calibration pass", partial: str = DEFAULT_PARTIAL_SUMS) -> CalibrationStatistics:
    """Accumulate `plan` over `batches` with one truncated pass of `model` per batch (see `CalibrationPass.collect`)."""
    stats = as_calibration_pass(model).collect(batches, plan, patch=patch, device=device, description=description,
                                               progress=progress, partial=partial)
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
                 shard: ShardSpec | None = None, partial: str = DEFAULT_PARTIAL_SUMS) -> None:
        self.calibration_pass, self.data, self.statistics, self.device = calibration_pass, data, statistics, device
        self.partial = partial  # the precision of each chunk's products (`StatisticsAccumulator`)
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

    def missing(self, plan: StatisticsPlan) -> StatisticsPlan:
        """What of `plan` the statistics at hand (gathered or given) do not hold."""
        return plan.missing_from(self.statistics.tensors if self.statistics is not None else ())

    def ensure(self, plan: StatisticsPlan, purpose: str) -> CalibrationStatistics | None:
        """Statistics holding at least `plan`, running one pass for whatever is missing (None: nothing was
        needed and nothing was given)."""
        missing = self.missing(plan)
        if missing:
            if self.data is None:
                raise GhostedError(f"The given statistics lack what {purpose} needs, and no calibration text was given: "
                                   "pass the calibration text too, or collect statistics with the same options "
                                   "(with several boundaries, --fitting independent needs no further pass).")
            fresh = self.collect(missing, purpose)
            self.statistics = fresh if self.statistics is None else self.statistics.with_tensors(fresh)
        return self.statistics

    def subblock_outputs(self, keys: Iterable[tuple[int, str]]) -> dict[tuple[int, str], int]:
        """How many values each sub-block (layer, kind) returns (see `CalibrationPass.subblock_outputs`)."""
        return self.calibration_pass.subblock_outputs(list(keys), self.data.batches[0])

    def first_batches(self, count: int) -> Calibrator:
        """A calibrator over the first `count` batches of this one's set (a cheaper pass), recording its passes here."""
        part = Calibrator(self.calibration_pass, dataclasses.replace(self.data, batches=self.data.batches[:count]),
                          device=self.device, shard=self.shard, partial=self.partial)
        part.passes = self.passes
        return part

    def merge_passes(self, first: int, purpose: str) -> None:
        """Record the passes from number `first` on as one (many passes of one kind: one line of provenance)."""
        merged, self.passes[first:] = self.passes[first:], []
        if merged:
            self.passes.append({"purpose": purpose, "passes": len(merged),
                                **{key: sum(p[key] for p in merged) for key in ("batches", "forwards")},
                                "seconds": round(sum(p["seconds"] for p in merged), 3),
                                "processes": self.world, "deepest_layer_input": max(p["deepest_layer_input"] for p in merged),
                                "sequential": any(p["sequential"] for p in merged)})

    def collect(self, plan: StatisticsPlan, purpose: str, patch: Patch | None = None) -> CalibrationStatistics:
        """One pass for `plan` (see `CalibrationPass.collect` for `patch`); not merged into the kept statistics."""
        started = time.perf_counter()
        batches = self.my_batches()
        if not self.shard.take(self.data.batches):
            raise GhostedError(f"Shard {self.shard} holds no batch: the calibration set has only "
                               f"{len(self.data.batches)} batches; use fewer shards or more sequences.")
        stats = self.calibration_pass.collect(batches, plan, patch=patch, device=self.device,
                                              description=f"Calibration pass: {purpose}", partial=self.partial)
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
