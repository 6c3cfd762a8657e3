"""Sub-blocks (issue #34): how well a closed-form linear map of the normalised stream a sub-block reads replaces
each attention and MLP sub-block of a real model, and what replacing the k most replaceable ones costs in held-out
perplexity, beside whole-layer ghosted removal at about the same parameter count.

    python benchmarks/subblock_probe.py --model smollm2-135m-instruct      # writes benchmarks/results/subblock_probe.md

A probe, not the feature: each replacement A (C x C, ridge least squares in float64: n(x) A ~ what the sub-block
returned, before any norm after it) is fitted independently from the dense model's statistics and applied by a
forward hook, so the sub-block still runs. Sub-blocks are ranked by their relative residual on the calibration
tokens. Parameters counted net: the sub-block's weights minus the C^2 of its map."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ghosted_hf import assets, ghost_prune
from ghosted_hf.architectures import architecture, decoder_layers
from ghosted_hf.evaluate import perplexity
from ghosted_hf.fitting.operators import ridge_epsilon
from ghosted_hf.model.loading import NO_HUB_KERNELS
from ghosted_hf.text.tokens import tokenize_texts

RIDGE = 1e-6  # PruneOptions' default, relative to the mean diagonal of the Gram matrix


def hidden_input(args, kwargs) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def first(output) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def sub_blocks(model) -> dict[tuple[int, str], torch.nn.Module]:
    family = architecture(model)
    return {(i, kind): block.module(layer) for i, layer in enumerate(decoder_layers(model))
            for kind, block in (("attention", family.attention), ("mlp", family.mlp))}


def statistics(model, batches) -> dict[tuple[int, str], list]:
    """Per sub-block: [Gram n^T n, cross n^T out, ||out||^2] in float64 over every token."""
    sums = {key: [0, 0, 0.0] for key in sub_blocks(model)}
    hooks = []
    for key, module in sub_blocks(model).items():
        def hook(module, args, kwargs, output, key=key):
            n, out = hidden_input(args, kwargs).double().flatten(0, 1), first(output).double().flatten(0, 1)
            acc = sums[key]
            acc[0], acc[1], acc[2] = acc[0] + n.T @ n, acc[1] + n.T @ out, acc[2] + float((out * out).sum())
        hooks.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            for batch in batches:
                model(**batch, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return sums


def fit(gram: torch.Tensor, cross: torch.Tensor, energy: float) -> tuple[torch.Tensor, float]:
    eye = torch.eye(gram.shape[0], dtype=gram.dtype)
    a = torch.linalg.solve(gram + ridge_epsilon(gram, RIDGE) * eye, cross)
    residual = float(((gram @ a) * a).sum() - 2 * (a * cross).sum()) + energy
    return a, residual / energy


def replaced(model, maps: dict[tuple[int, str], torch.Tensor]) -> list:
    hooks = []
    for key, module in sub_blocks(model).items():
        if key in maps:
            def hook(module, args, kwargs, output, a=maps[key]):
                n = hidden_input(args, kwargs)
                out = (n.double() @ a).to(n.dtype)
                return (out, *output[1:]) if isinstance(output, tuple) else out
            hooks.append(module.register_forward_hook(hook, with_kwargs=True))
    return hooks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=assets.DEFAULT_MODEL)
    parser.add_argument("--counts", type=int, nargs="+", default=[4, 8, 16], help="sub-blocks replaced")
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4], help="whole layers ghosted, for reference")
    parser.add_argument("--num-sequences", type=int, default=64)
    parser.add_argument("--output", default="benchmarks/results/subblock_probe.md")
    args = parser.parse_args()
    folder = assets.resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **NO_HUB_KERNELS).eval()
    calibration = assets.wikipedia_split("calibration")
    batches = tokenize_texts(tokenizer, calibration, 512, args.num_sequences, batch_size=4).batches
    held_out = tokenize_texts(tokenizer, assets.wikipedia_split("evaluation"), 512, 16, batch_size=4).batches
    width = model.config.hidden_size
    params = {key: sum(p.numel() for p in module.parameters()) for key, module in sub_blocks(model).items()}
    layer_params = sum(p.numel() for p in decoder_layers(model)[0].parameters())
    sums = statistics(model, batches)
    fits = {key: fit(*acc) for key, acc in sums.items()}
    dense = perplexity(model, held_out, progress=False)
    lines = [f"## {args.model}: {len(decoder_layers(model))} layers, width {width}, {args.num_sequences} x 512 "
             f"calibration tokens; dense perplexity {dense:.2f}", "",
             "Relative residual of each sub-block's linear replacement (layer: attention / MLP):", "",
             ", ".join(f"{i}: {fits[(i, 'attention')][1]:.3f} / {fits[(i, 'mlp')][1]:.3f}"
                       for i in range(len(decoder_layers(model)))), "",
             "| replaced | which | net parameters removed | perplexity |", "|---|---|---|---|"]
    for kinds in (("attention",), ("mlp",), ("attention", "mlp")):
        ranked = sorted((key for key in fits if key[1] in kinds), key=lambda key: fits[key][1])
        for k in args.counts:
            chosen = ranked[:k]
            hooks = replaced(model, {key: fits[key][0] for key in chosen})
            value = perplexity(model, held_out, progress=False)
            for hook in hooks:
                hook.remove()
            net = sum(params[key] - width * width for key in chosen)
            which = ", ".join(f"{i}{'a' if kind == 'attention' else 'm'}" for i, kind in sorted(chosen))
            lines.append(f"| {k} {' + '.join(kinds)} | {which} | {net / 1e6:.2f} M | {value:.2f} |")
            print(lines[-1], flush=True)
    for k in args.layers:
        ghosted = ghost_prune(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **NO_HUB_KERNELS),
                              tokenizer, calibration, num_layers=k, num_sequences=args.num_sequences)
        net = k * layer_params - width * width * len(ghosted.config.ghost_boundaries)
        lines.append(f"| {k} whole layers (ghost, defaults) | {ghosted.config.removed_layers} | {net / 1e6:.2f} M | "
                     f"{perplexity(ghosted, held_out, progress=False):.2f} |")
        print(lines[-1], flush=True)
    Path(args.output).write_text("# Sub-block probe (issue #34)\n\n`python benchmarks/subblock_probe.py --model "
                                 f"{args.model}`\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
