"""`ghosted stats collect` and `ghosted stats merge`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..io.files import check_output
from ..model.loading import load_for_calibration
from ..options import PruneOptions, from_namespace, option
from .common import (CALIBRATION_HELP, MODEL_HELP, LoadArgs, MemoryArgs, OutputArgs, calibration_text,
                     check_same_outputs)


@dataclass(kw_only=True)
class StatsCollectArgs(LoadArgs, MemoryArgs, OutputArgs):
    """Arguments of `ghosted stats collect` besides the `PruneOptions`."""

    model: str | None = option(None, MODEL_HELP, positional=True)
    calibration: str | None = option(None, CALIBRATION_HELP)
    shard: str = option("0/1", "Which shard I/N of the calibration batches to collect (every N-th batch from batch I).")
    output: str | None = option(None, "New statistics file to write (safetensors).", required=True)
    device: str | None = option(None, "device_map for loading (e.g. cpu, cuda, auto).")


@dataclass(kw_only=True)
class StatsMergeArgs(OutputArgs):
    """Arguments of `ghosted stats merge`."""

    files: list[str] = option(help="The statistics shards to merge (all N of one run, each once).")
    output: str | None = option(None, "New statistics file to write (safetensors).", required=True)


def cmd_stats_collect(args: argparse.Namespace) -> int:
    """`ghosted stats collect`: the statistics of one shard, written atomically."""
    from ..pipelines.prune import calibrate
    from ..statistics import ShardSpec
    from ..utils.distributed import is_main_process

    run, options = from_namespace(StatsCollectArgs, args), from_namespace(PruneOptions, args)
    shard = ShardSpec.parse(run.shard)
    path = check_output(run.output, (run.model, run.calibration), overwrite=run.overwrite, file=True)
    check_same_outputs(output=run.output, overwrite=run.overwrite, shard=run.shard)
    calibration = calibration_text(run.calibration, options)
    model, tokenizer = load_for_calibration(
        run.model, dtype=run.dtype, device=run.device, max_memory=run.max_memory, layerwise=run.layerwise,
        activations_dir=run.activations_dir, trust_remote_code=run.trust_remote_code, revision=run.revision)
    stats = calibrate(model, tokenizer, calibration, options, shard=shard)
    if is_main_process():  # every process holds the sums; `save` writes all or nothing
        stats.save(path)
        print(f"Wrote shard {shard} ({stats.tokens} tokens, {len(stats.tensors)} statistics) to {path}")
    return 0


def cmd_stats_merge(args: argparse.Namespace) -> int:
    """`ghosted stats merge`: all shards of one run summed into one statistics file."""
    from ..statistics import CalibrationStatistics
    from ..utils.distributed import is_main_process

    run = from_namespace(StatsMergeArgs, args)
    path = check_output(run.output, tuple(run.files), overwrite=run.overwrite, file=True)
    merged = CalibrationStatistics.merge(run.files)
    if is_main_process():
        merged.save(path)
    print(f"Merged {len(run.files)} shards ({merged.tokens} tokens) into {path}")
    return 0
