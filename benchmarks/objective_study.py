"""Objective study on the packaged SmolLM2-135M: does the ghost fit improve when the few massive-activation
tokens (the first position / attention sink) are excluded or when every token is normalised by its RMS?
All variants fit the same block from the same calibration sequences and are scored on the same
held-out windows; gap closed is relative to that block plainly removed.

    python benchmarks/objective_study.py --start 12 --num-sequences 32 --ridge 1e-4
"""

from __future__ import annotations

import argparse

from ghosted_hf import assets, ghost_prune
from ghosted_hf.evaluate import gap_closed, perplexity

from common import held_out_windows, packaged_model

VARIANTS = [dict(), dict(skip_first_tokens=1), dict(skip_first_tokens=4), dict(weighting="rms"),
            dict(weighting="rms", skip_first_tokens=1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start", type=int, default=12)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--num-sequences", type=int, default=32)
    parser.add_argument("--ridge", type=float, default=1e-4)
    parser.add_argument("--eval-windows", type=int, default=16)
    args = parser.parse_args()
    tokenizer, load = packaged_model()
    calibration = assets.wikipedia_split("calibration")
    held_out = held_out_windows(tokenizer, args.eval_windows).batches
    block = list(range(args.start, args.start + args.num_layers))
    dense = perplexity(load(), held_out, progress=False)
    plain = perplexity(ghost_prune(load(), tokenizer, calibration, criterion="manual", layers=block, operator="none",
                                   num_sequences=4), held_out, progress=False)
    print(f"Block {block[0]}-{block[-1]}: dense {dense:.2f}, plainly removed {plain:.2f}; {args.num_sequences} x 512 "
          f"calibration tokens, ridge {args.ridge:g}, {args.eval_windows} held-out windows of 512.\n")
    print("| objective | perplexity | gap closed | relative residual (calibration) |")
    print("|---|---|---|---|")
    for variant in VARIANTS:
        model = ghost_prune(load(), tokenizer, calibration, criterion="manual", layers=block,
                            num_sequences=args.num_sequences, ridge=args.ridge, **variant)
        ppl = perplexity(model, held_out, progress=False)
        closed = gap_closed(ppl, plain, dense)
        name = ", ".join(f"{k}={v}" for k, v in variant.items()) or "plain least squares"
        residual = model.config.ghost_boundaries[0]["fit"]["relative_residual"]
        print(f"| {name} | {ppl:.2f} | {closed:.3f} | {residual:.3f} |", flush=True)


if __name__ == "__main__":
    main()
