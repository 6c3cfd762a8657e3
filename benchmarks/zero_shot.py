"""Zero-shot accuracy (lm-eval, packaged validation data, first `--limit` examples per task) of the dense
packaged SmolLM2-135M, of plain removal of given blocks, and of saved ghosted models.

    python benchmarks/zero_shot.py --plain 11-18 12-19 --ghosted ghosted-demo-output/smollm2-135m-ghosted --limit 40
"""

from __future__ import annotations

import argparse

from common import packaged_model
from transformers import AutoModelForCausalLM

from ghosted_hf import prune_layers
from ghosted_hf.evaluate import ZERO_SHOT_TASKS, zero_shot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plain", nargs="*", default=[], help="Blocks to remove plainly, e.g. 11-18.")
    parser.add_argument("--ghosted", nargs="*", default=[], help="Saved ghosted model folders.")
    parser.add_argument("--limit", type=int, default=40)
    args = parser.parse_args()
    tokenizer, load = packaged_model()
    models = {"dense": load}
    for block in args.plain:
        start, end = map(int, block.split("-"))
        models[f"layers {block} plainly removed"] = lambda s=start, e=end: prune_layers(load(), list(range(s, e + 1)))
    for path in args.ghosted:
        models[f"ghosted ({path})"] = lambda p=path: AutoModelForCausalLM.from_pretrained(p, trust_remote_code=True).eval()
    tasks = list(ZERO_SHOT_TASKS)
    print(f"Zero-shot accuracy (acc), first {args.limit} validation examples of each task.\n")
    print("| model | " + " | ".join(tasks) + " | average |")
    print("|---|" + "---|" * (len(tasks) + 1))
    for name, make in models.items():
        scores = zero_shot(make(), tokenizer, tasks, limit=args.limit)
        accs = [scores[t]["acc"] for t in tasks]
        print(f"| {name} | " + " | ".join(f"{a:.3f}" for a in accs) + f" | {sum(accs) / len(accs):.3f} |", flush=True)


if __name__ == "__main__":
    main()
