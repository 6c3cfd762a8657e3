"""Calibration-size and ridge study on the packaged SmolLM2-135M: held-out perplexity of the ghost fit of
one 8-layer block versus the number of calibration tokens and versus the relative ridge eps.

The block is chosen once by the default ghost-aware selection on the default calibration set; each
size runs its own statistics pass (the first N sequences of the calibration articles), and every ridge
value is solved from the statistics of the `--ridge-tokens` set, so the ridge rows differ only in eps.

    python benchmarks/calibration_study.py --sizes 16 64 256 --ridges 1e-8 1e-6 1e-4 1e-2 --size-ridge 1e-4
"""

from __future__ import annotations

import argparse

from common import held_out_windows, packaged_model

from ghosted_hf import assets, ghost_prune
from ghosted_hf.evaluate import gap_closed, perplexity
from ghosted_hf.fitting.operators import OPERATOR_KINDS
from ghosted_hf.options import PruneOptions
from ghosted_hf.statistics import collect_statistics
from ghosted_hf.text.tokens import tokenize_texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 64, 256], help="Calibration sequences of 512 tokens.")
    parser.add_argument("--ridges", type=float, nargs="+", default=[1e-8, 1e-6, 1e-4, 1e-2])
    parser.add_argument("--ridge-sequences", type=int, default=64)
    parser.add_argument("--size-ridge", type=float, default=PruneOptions().ridge, help="Ridge of the size rows.")
    parser.add_argument("--eval-windows", type=int, default=16)
    args = parser.parse_args()

    tokenizer, load = packaged_model()
    calibration = assets.wikipedia_split("calibration")
    held_out = held_out_windows(tokenizer, args.eval_windows).batches
    dense = perplexity(load(), held_out, progress=False)
    block = ghost_prune(load(), tokenizer, calibration, num_layers=args.num_layers,
                        operator="none").config.ghost_provenance["selection"]["removed"]
    manual = dict(criterion="manual", layers=block)
    plain = perplexity(ghost_prune(load(), tokenizer, calibration, operator="none", num_sequences=4, **manual), held_out,
                       progress=False)
    print(f"Block {block[0]}-{block[-1]} (ghost-aware default selection); dense {dense:.2f}, plainly removed {plain:.2f}; "
          f"{args.eval_windows} held-out windows of 512 tokens. Gap closed relative to this block plainly removed.\n")
    print("| calibration tokens | ridge | perplexity | gap closed |")
    print("|---|---|---|---|")
    s, e = block[0], block[-1] + 1
    for sequences in sorted(set(args.sizes) | {args.ridge_sequences}):
        options = PruneOptions(num_sequences=sequences, **manual)
        data = tokenize_texts(tokenizer, calibration, options.seq_len, sequences, options.batch_size)
        stats = collect_statistics(load(), data.batches, OPERATOR_KINDS["ghost"].statistics(s, e), progress=False)
        ridges = args.ridges if sequences == args.ridge_sequences else [args.size_ridge]
        for ridge in ridges:
            model = ghost_prune(load(), tokenizer, calibration, options, statistics=stats, ridge=ridge)
            ppl = perplexity(model, held_out, progress=False)
            print(f"| {data.num_tokens} | {ridge:g} | {ppl:.2f} | {gap_closed(ppl, plain, dense):.3f} |", flush=True)


if __name__ == "__main__":
    main()
