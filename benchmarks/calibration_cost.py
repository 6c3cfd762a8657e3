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
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ghosted_hf import assets
from ghosted_hf.calibration import StatisticsPlan, collect_statistics
from ghosted_hf.data import tokenize_texts
from ghosted_hf.selection import selection_plan


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    folder = assets.default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    texts = assets.wikipedia_split("calibration")
    small = tokenize_texts(tokenizer, texts, args.seq_len, args.sequences, args.batch_size)
    large = tokenize_texts(tokenizer, texts, args.seq_len, 4 * args.sequences, args.batch_size)
    total = model.config.num_hidden_layers
    plans = {
        "ghost fit, one boundary (12-19)": StatisticsPlan(grams=frozenset({12}), pairs=frozenset({(12, 20)})),
        "ghost-aware selection, 8 layers": selection_plan("ghost-aware", 8, total),
    }

    def dense_pass(batches):
        with torch.no_grad():
            for b in batches:
                model(**b, use_cache=False)

    dense_pass(small.batches[:1])  # warm-up
    rows = []
    for _ in range(args.repeats):  # interleaved, so that machine noise hits every row alike
        rows.append(("dense forward", small.num_tokens, *measure(lambda: dense_pass(small.batches))))
        for name, plan in plans.items():
            rows.append((name, small.num_tokens, *measure(
                lambda: collect_statistics(model, small.batches, plan, progress=False))))
    rows.append(("ghost-aware selection, 8 layers", large.num_tokens, *measure(
        lambda: collect_statistics(model, large.batches, plans["ghost-aware selection, 8 layers"], progress=False))))

    best: dict[tuple[str, int], tuple[float, float]] = {}
    for name, tokens, seconds, peak in rows:
        key = (name, tokens)
        best[key] = (min(seconds, best.get(key, (seconds, peak))[0]), max(peak, best.get(key, (seconds, peak))[1]))
    dense_s, dense_m = best[("dense forward", small.num_tokens)]
    print(f"SmolLM2-135M fp32, {torch.get_num_threads()} threads, batches of {args.batch_size} x {args.seq_len} tokens")
    print(f"| pass | tokens | seconds (best of {args.repeats}) | time per token / dense | peak memory above model (MiB) |")
    print("|---|---|---|---|---|")
    for (name, tokens), (seconds, peak) in best.items():
        ratio = (seconds / tokens) / (dense_s / small.num_tokens)
        print(f"| {name} | {tokens} | {seconds:.2f} | {ratio:.2f}x | {peak / 2**20:.0f} |")
    print(json.dumps({f"{n}@{t}": {"seconds": s, "peak_bytes": m} for (n, t), (s, m) in best.items()}))


if __name__ == "__main__":
    main()
