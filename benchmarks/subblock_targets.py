"""What a sub-block's map is fitted to (issue #51 item 1), for one fixed set of replaced sub-blocks, training-free.

Four fits of the same sub-blocks, each from its input h (its norm's output) by ridge least squares:
- dense: the dense model's h onto the dense model's output (each map fitted alone on the dense model);
- own: h of the model with the earlier maps in place onto what the sub-block returns there (ghosted_hf's
  sequential fit, `fit_sequentially`);
- dense target: that h onto the dense model's output of the sub-block;
- stream: that h onto the dense residual stream after the sub-block minus the patched stream before it (the map also
  undoes what the earlier maps moved, as a boundary's operator maps the patched stream onto the dense one).
Scored as the perplexity ratio to the dense model on the equal-budget table's held-out texts. The sets are the
criterion's choices in benchmarks/results/kv_budget.md. Llama's layout (SmolLM2): the stream before the MLP is read at
its norm's input. Slow: one pass of the dense and three of the patched models per sub-block and batch.

    python benchmarks/subblock_targets.py --set kv25    # appends to benchmarks/results/subblock_targets.md
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from common import held_out_sources, packaged_model

from ghosted_hf import assets
from ghosted_hf.evaluate import perplexity
from ghosted_hf.fitting.operators import ridge_solve
from ghosted_hf.options import PruneOptions
from ghosted_hf.statistics.capture import StopForward, stopped_forward
from ghosted_hf.text.tokens import tokenize_texts

SETS = {"kv25": "5.attention 6.attention 7.attention 14.attention 15.attention 17.attention 28.attention 29.attention"}
FITS = ("dense", "own", "dense target", "stream")


class LinearMap(torch.nn.Module):
    def __init__(self, a: torch.Tensor, kind: str) -> None:
        super().__init__()
        self.a, self.kind = a.float(), kind

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        mapped = hidden_states @ self.a
        return (mapped, None) if self.kind == "attention" else mapped


def read_block(model, j: int, kind: str, batch) -> dict[str, torch.Tensor]:
    """The stream before sub-block `kind` of layer j ("x"), its input ("h") and its output ("y"), float64 rows; the
    pass stops there."""
    layer, width, got = model.model.layers[j], model.config.hidden_size, {}
    norm = layer.input_layernorm if kind == "attention" else layer.post_attention_layernorm
    block = layer.self_attn if kind == "attention" else layer.mlp

    def at_norm(module, args, output):
        got["x"], got["h"] = (t.detach().reshape(-1, width).double() for t in (args[0], output))

    def at_block(module, args, output):
        got["y"] = (output[0] if isinstance(output, tuple) else output).detach().reshape(-1, width).double()
        raise StopForward

    handles = [norm.register_forward_hook(at_norm), block.register_forward_hook(at_block)]
    try:
        with torch.no_grad(), stopped_forward():
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    finally:
        for handle in handles:
            handle.remove()
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", default="kv25", choices=list(SETS))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--output", default="benchmarks/results/subblock_targets.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer, load = packaged_model("smollm2-135m-instruct")
    options = PruneOptions()
    batches = tokenize_texts(tokenizer, assets.wikipedia_split("calibration"), options.seq_len, options.num_sequences,
                             options.batch_size).batches
    chosen = [(int(name.split(".")[0]), name.split(".")[1]) for name in SETS[args.set].split()]
    dense, models = load(), {fit: load() for fit in FITS}
    started = time.perf_counter()
    for j, kind in chosen:
        sums = {fit: [0.0, 0.0] for fit in FITS}
        for batch in batches:
            d = read_block(dense, j, kind, batch)
            sums["dense"][0] += d["h"].T @ d["h"]
            sums["dense"][1] += d["h"].T @ d["y"]
            for fit in FITS[1:]:
                p = read_block(models[fit], j, kind, batch)
                target = {"own": p["y"], "dense target": d["y"], "stream": d["x"] + d["y"] - p["x"]}[fit]
                sums[fit][0] += p["h"].T @ p["h"]
                sums[fit][1] += p["h"].T @ target
        for fit in FITS:
            layer = models[fit].model.layers[j]
            setattr(layer, "self_attn" if kind == "attention" else "mlp",
                    LinearMap(ridge_solve(*sums[fit], options.ridge)[0], kind))
    seconds = time.perf_counter() - started
    held_out = held_out_sources(tokenizer)
    reference = {source: perplexity(dense, b, progress=False) for source, b in held_out.items()}
    lines = [f"\n`python benchmarks/subblock_targets.py --set {args.set} --threads {args.threads}` "
             f"({time.strftime('%Y-%m-%d')}; SmolLM2-135M; {options.num_sequences} x {options.seq_len} calibration "
             f"tokens; {SETS[args.set]}; fits: {seconds:.0f} s)", "",
             "| fitted to | wiki ppl ratio | news ppl ratio |", "|---|---|---|"]
    for fit in FITS:
        ratio = {s: perplexity(models[fit], b, progress=False) / reference[s] for s, b in held_out.items()}
        lines.append(f"| {fit} | {ratio['wiki']:.3f} | {ratio['news']:.3f} |")
        print(lines[-1], flush=True)
    with Path(args.output).open("a") as handle:
        handle.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
