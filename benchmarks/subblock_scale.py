"""Sub-blocks at scale (issue #50): `ghost_prune(unit=..., remove=25%)` on a packaged model four ways: in memory in one
process, layer by layer (`LayerwisePass`: one decoder layer in memory), under torchrun with 2 processes, and from 2
`calibrate` shards merged (the candidates' sums from the file, the damage passes and later fits on the text). Each
way runs in its own process; the table gives what it chose, the largest difference of its maps and operators from the
in-memory ones, the held-out perplexity, the wall seconds and the peak resident memory during calibration (sampled
until the pruned model is built; the build loads the pruned model whole in every way) and overall.

    python benchmarks/subblock_scale.py --unit subblock > benchmarks/results/subblock_scale.md
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

WAYS = ("memory", "layerwise", "torchrun", "shards")


class PeakMemory:
    """The peak resident memory of this process, sampled every 20 ms, kept apart before and after `phase` changes."""

    def __init__(self) -> None:
        self.phase, self.peaks = "calibration", {"calibration": 0, "build": 0}
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while True:
            with open("/proc/self/statm") as statm:
                rss = int(statm.read().split()[1]) * page
            self.peaks[self.phase] = max(self.peaks[self.phase], rss)
            time.sleep(0.02)


def worker(args: argparse.Namespace) -> None:
    """One way, in this process: prune, score, save the ghost tensors and a record in `args.out`."""
    peak = PeakMemory()
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ghosted_hf import assets, ghost_prune
    from ghosted_hf.evaluate import perplexity
    from ghosted_hf.pipelines.prune import calibrate
    from ghosted_hf.statistics import CalibrationStatistics, FullModelPass, LayerwisePass, ShardSpec
    from ghosted_hf.text.tokens import tokenize_texts
    from ghosted_hf.utils.distributed import is_main_process

    folder = assets.packaged_model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    calibration = assets.wikipedia_split("calibration")
    options = dict(unit=args.unit, remove=args.remove, seq_len=512, num_sequences=args.num_sequences, batch_size=4,
                   damage_sequences=args.damage_sequences)

    def dense():
        return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)

    started = time.perf_counter()
    statistics = None
    if args.way == "shards":
        parts = [calibrate(dense(), tokenizer, calibration, shard=ShardSpec(i, 2), **options) for i in range(2)]
        statistics = CalibrationStatistics.merge(parts)
    model = LayerwisePass(folder) if args.way == "layerwise" else FullModelPass(dense())
    build = model.model_for_build

    def model_for_build(removed):  # the prune's last call builds the pruned model: memory from here on is the build's
        if list(removed) != list(range(model.config.num_hidden_layers)):
            peak.phase = "build"
        return build(removed)

    model.model_for_build = model_for_build
    ghosted = ghost_prune(model, tokenizer, calibration, statistics=statistics, **options)
    seconds = time.perf_counter() - started
    if not is_main_process():
        return
    held_out = tokenize_texts(tokenizer, assets.wikipedia_split("evaluation"), 512, 16, batch_size=4).batches
    save_file({k: v.detach().contiguous() for k, v in ghosted.ghost_operators().items()}, f"{args.out}/{args.way}.safetensors")
    record = {"way": args.way, "seconds": round(seconds, 1), "removed": ghosted.config.removed_layers,
              "subblocks": ghosted.config.ghost_provenance["selection"].get("subblocks", []),
              "perplexity": perplexity(ghosted, held_out, progress=False),
              "peak_calibration_mib": peak.peaks["calibration"] / 2**20, "peak_mib": max(peak.peaks.values()) / 2**20}
    Path(f"{args.out}/{args.way}.json").write_text(json.dumps(record))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--unit", choices=("subblock", "mixed"), default="subblock")
    parser.add_argument("--remove", default="25%")
    parser.add_argument("--num-sequences", type=int, default=32)
    parser.add_argument("--damage-sequences", type=int, default=8)
    parser.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # (a worker)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.way is not None:
        return worker(args)
    import torch
    from safetensors.torch import load_file

    own = [a for a in sys.argv[1:]]
    records = {}
    with tempfile.TemporaryDirectory() as out:
        for way in args.ways:
            script = [__file__, *own, "--way", way, "--out", out]
            if way == "torchrun":
                command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                           "127.0.0.1", "--master-port", str(free_port()), *script]
                env = {**os.environ, "OMP_NUM_THREADS": "1"}
            else:
                command, env = [sys.executable, *script], dict(os.environ)
            started = time.perf_counter()
            subprocess.run(command, check=True, env=env)
            records[way] = json.loads(Path(f"{out}/{way}.json").read_text())
            records[way]["wall"] = round(time.perf_counter() - started, 1)
            records[way]["tensors"] = load_file(f"{out}/{way}.safetensors")
    base = records[args.ways[0]]
    print(f"{args.model}, unit={args.unit}, remove={args.remove}: calibration {args.num_sequences} x 512 tokens of the "
          f"Wikipedia calibration articles, damage on {args.damage_sequences} sequences; perplexity on 16 held-out windows "
          f"of 512 tokens; max |difference| of every map and operator from the {args.ways[0]} way's.\n")
    print("| way | same choice | max map difference | perplexity | relative perplexity difference | prune s | "
          "peak RSS, calibration (MiB) | peak RSS, with the build (MiB) |")
    print("|---|---|---|---|---|---|---|---|")
    for way, r in records.items():
        same = (r["removed"], r["subblocks"]) == (base["removed"], base["subblocks"])
        gap = max((float((t - base["tensors"][k]).abs().max()) for k, t in r["tensors"].items()), default=0.0) \
            if same else float("nan")
        print(f"| {way} | {'yes' if same else 'no'} | {gap:.2e} | {r['perplexity']:.6f} | "
              f"{abs(r['perplexity'] / base['perplexity'] - 1):.1e} | {r['seconds']:.0f} | "
              f"{r['peak_calibration_mib']:.0f} | {r['peak_mib']:.0f} |")
    print(f"\nChosen: layers {base['removed']}, sub-blocks {', '.join(base['subblocks'])}.")
    print(f"\n`python benchmarks/subblock_scale.py {' '.join(own)}` (torch {torch.__version__}, {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
