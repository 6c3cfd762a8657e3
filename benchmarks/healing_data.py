"""Memory and time of preparing `heal`'s training data: the 1.0 packing (lists of Python ints, one document
tokenized at a time) beside today's (int32 rows, documents tokenized in batches), on the packaged calibration
articles repeated until the corpus has `--tokens` tokens. Each run is a fresh process (peak resident memory
above what the process held before packing), the two interleaved round by round; the rows are checked equal to
the 1.0 sequences, order and text hash included.

    python benchmarks/healing_data.py --tokens 20000000 --rounds 2 > benchmarks/results/healing_data.md
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch
from common import packaged_model

from ghosted_hf import assets
from ghosted_hf.text.documents import Documents
from ghosted_hf.text.tokens import pack_tokens, training_sequences
from ghosted_hf.utils.hashing import text_hash

SEQ_LEN = 256  # heal's default


def legacy_sequences(tokenizer, texts: list[str], seq_len: int, seed: int = 0) -> tuple[list[list[int]], str]:
    """1.0's training sequences (no held-out set): full-length lists of Python ints, shuffled, and the text hash."""
    read: list[str] = []

    def tokens():
        for text in texts:
            read.append(text)
            yield tokenizer(text, add_special_tokens=True)["input_ids"]

    train = [s for s in pack_tokens(tokens(), seq_len, None, tokenizer.eos_token_id) if len(s) == seq_len]
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed)).tolist()
    return [train[i] for i in order], text_hash(read)


def repeats(tokenizer, tokens: int) -> int:
    """How many passes over the calibration articles hold `tokens` tokens."""
    per_pass = sum(len(tokenizer(a)["input_ids"]) + 1 for a in assets.wikipedia_split("calibration"))
    return -(-tokens // per_pass)


def measure(packing: str, passes: int) -> dict[str, float]:
    """Run in a fresh process: pack the corpus one way, report peak memory growth (MiB) and seconds."""
    tokenizer, _ = packaged_model()
    texts = assets.wikipedia_split("calibration") * passes  # the same strings again: no memory of their own
    tokenizer(texts[0])  # warm up before the baseline
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    if packing == "1.0 lists":
        train, digest = legacy_sequences(tokenizer, texts, SEQ_LEN)
        rows = len(train)
    else:
        sequences = training_sequences(tokenizer, Documents(texts, "articles"), SEQ_LEN, held_out=0)
        rows, digest = len(sequences.train), sequences.text_sha256
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"rows": rows, "sha256": digest, "seconds": seconds, "peak_mib": (peak - before) / 1024}


def check_equal() -> None:
    """The int32 rows are the 1.0 sequences, in the same order, with the same text hash."""
    tokenizer, _ = packaged_model()
    texts = assets.wikipedia_split("calibration") * 2
    legacy, digest = legacy_sequences(tokenizer, texts, SEQ_LEN)
    sequences = training_sequences(tokenizer, Documents(texts, "articles"), SEQ_LEN, held_out=0)
    assert sequences.train.tolist() == legacy and sequences.text_sha256 == digest, "the packings differ"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20_000_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", choices=["1.0 lists", "int32 rows, batches"], help=argparse.SUPPRESS)  # --tokens: passes
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.tokens)))
        return
    check_equal()
    passes = repeats(packaged_model()[0], args.tokens)
    results: dict[str, list[dict[str, float]]] = {"1.0 lists": [], "int32 rows, batches": []}
    for _ in range(args.rounds):
        for packing in results:
            out = subprocess.run([sys.executable, __file__, "--child", packing, "--tokens", str(passes)],
                                 capture_output=True, text=True, check=True)
            results[packing].append(json.loads(out.stdout.strip().splitlines()[-1]))
    rows = results["int32 rows, batches"][0]["rows"]
    print(f"Packaged calibration articles, {passes} passes: at least {args.tokens:,} tokens ({rows:,} training "
          f"sequences of {SEQ_LEN}); median of {args.rounds} fresh processes per packing; the two give the same sequences "
          "in the same order.\n")
    print("| packing | peak memory growth (MiB) | seconds | bytes per packed token |")
    print("|---|---|---|---|")
    for packing, runs in results.items():
        peak = statistics.median(r["peak_mib"] for r in runs)
        print(f"| {packing} | {peak:.0f} | {statistics.median(r['seconds'] for r in runs):.1f} | "
              f"{peak * 2**20 / (rows * SEQ_LEN):.1f} |")


if __name__ == "__main__":
    main()
