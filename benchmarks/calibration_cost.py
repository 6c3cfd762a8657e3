"""Calibration cost on the packaged real model (SmolLM2-135M, 30 layers), measured side by side in one run.

For the same calibration tokens, compares a plain dense forward pass (full model, no hooks) with the
statistics pass of (a) one boundary's ghost fit and (b) the ghost-aware selection of an 8-layer block
(Gram and cross matrices of every candidate block). Peak memory is the resident-set peak above the
memory held before the step (Linux VmHWM, reset between steps); the 4x run repeats (b) on four times
the tokens.

    python benchmarks/calibration_cost.py [--seq-len 512] [--sequences 16] [--batch-size 4]
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ghosted_hf import assets
from ghosted_hf.fitting.selection import SelectionRequest, criterion
from ghosted_hf.statistics import collect_statistics, least_squares
from ghosted_hf.text.tokens import tokenize_texts


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def measure(step) -> tuple[float, float]:
    """(seconds, peak resident bytes above the starting point) of `step()`."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before = _status("VmRSS")
    started = time.perf_counter()
    step()
    return time.perf_counter() - started, _status("VmHWM") - before


ROWS = ("dense forward", "ghost fit, one boundary (12-19)", "ghost-aware selection, 8 layers")


def run_row(name: str, sequences: int, seq_len: int, batch_size: int) -> tuple[float, float, int]:
    """(seconds, peak bytes above the loaded model and tokens, tokens) of one row, in this process."""
    folder = assets.default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    data = tokenize_texts(tokenizer, assets.wikipedia_split("calibration"), seq_len, sequences, batch_size)
    plans = {ROWS[1]: least_squares(12, 20),
             ROWS[2]: criterion("ghost-aware").statistics(
                 SelectionRequest(depth=model.config.num_hidden_layers, num_layers=8))}

    def dense_pass(batches):
        with torch.no_grad():
            for b in batches:
                model(**b, use_cache=False)

    dense_pass(data.batches[:1])  # warm-up, then measure
    if name == ROWS[0]:
        seconds, peak = measure(lambda: dense_pass(data.batches))
    else:
        seconds, peak = measure(lambda: collect_statistics(model, data.batches, plans[name], progress=False))
    return seconds, peak, data.num_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--row", default=None, help=argparse.SUPPRESS)  # internal: measure one row here
    args = parser.parse_args()
    if args.row is not None:
        print(json.dumps(run_row(args.row, args.sequences, args.seq_len, args.batch_size)))
        return

    jobs = [(row, args.sequences) for row in ROWS] + [(ROWS[2], 4 * args.sequences)]
    best: dict[tuple[str, int], tuple[float, float, int]] = {}
    for _ in range(args.repeats):  # every measurement in a fresh process; rows take turns
        for row, sequences in jobs:
            out = subprocess.run([sys.executable, __file__, "--row", row, "--sequences", str(sequences), "--seq-len",
                                  str(args.seq_len), "--batch-size", str(args.batch_size)],
                                 capture_output=True, text=True, check=True)
            seconds, peak, tokens = json.loads(out.stdout.strip().splitlines()[-1])
            old = best.get((row, sequences), (seconds, peak, tokens))
            best[(row, sequences)] = (min(seconds, old[0]), max(peak, old[1]), tokens)
    dense_s, _, dense_tokens = best[(ROWS[0], args.sequences)]
    print(f"SmolLM2-135M fp32, {torch.get_num_threads()} threads, batches of {args.batch_size} x {args.seq_len} tokens; "
          f"each measurement in a fresh process (best time, highest peak of {args.repeats})")
    print("| pass | tokens | seconds | time per token / dense | peak memory above model (MiB) |")
    print("|---|---|---|---|---|")
    for (row, _), (seconds, peak, tokens) in best.items():
        ratio = (seconds / tokens) / (dense_s / dense_tokens)
        print(f"| {row} | {tokens} | {seconds:.2f} | {ratio:.2f}x | {peak / 2**20:.0f} |")


if __name__ == "__main__":
    main()
